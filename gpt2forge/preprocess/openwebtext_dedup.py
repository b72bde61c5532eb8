"""The seed's three deduplication commands (Megatron-LM's former `tools/openwebtext`), on dedup.py.

    python data/find_duplicates.py --inputs clean.json url --output pairs.json
    python data/group_duplicate_url.py pairs.json groups.json 0.7
    python data/remove_group_duplicates.py groups.json clean.json dedup.json

Same positional arguments, flags and JSON lines as the seed: pairs are `{main_url: [{other_url:
jaccard}, ...]}`, groups `{"i": [urls]}` with the kept document first. Unlike the seed: fingerprints
are `.npz` (never pickle), the main of every pair and the first of every group is the earliest
document in input order (the seed picked at random), outputs are written atomically, a command
whose output exists skips its work (`--overwrite` redoes it), and bad input stops with one line
naming file:line (exit 2) unless `--skip-bad-lines`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess.dedup import (
    MEMORY_HELP,
    candidate_pairs,
    concat,
    fingerprint_files,
    load_fingerprints,
    save_fingerprints,
    verify_pairs,
)
from gpt2forge.preprocess.jsonl import KEY_FIELDS, atomic_jsonl, read_documents, unreadable
from gpt2forge.preprocess.minhash import JACCARD_MODES, SHINGLES, MinHashParams


def _common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-key", default="text", help="the JSON field holding the text (default: text)")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="count and skip malformed lines instead of stopping at the first one")
    parser.add_argument("--overwrite", action="store_true", help="redo the work even if the output exists")


def _complete(paths: list[str | None], overwrite: bool) -> bool:
    """True (and says so) when every output exists: outputs are atomic, so existing means complete."""
    outputs = [p for p in paths if p]
    if overwrite or not outputs or not all(Path(p).exists() for p in outputs):
        return False
    print(f"{', '.join(outputs)}: already complete; skipping (pass --overwrite to redo)")
    return True


def find_duplicates_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/find_duplicates.py",
        description="Find near-duplicate documents with MinHash LSH, verified by exact Jaccard similarity. "
                    f"Writes {{main_url: [{{other_url: jaccard}}, ...]}} lines. {MEMORY_HELP}.")
    parser.add_argument("--inputs", nargs="*", default=None,
                        help="pairs of input file and key field, e.g. --inputs cc.json url news.json id "
                             "(a document without the field is named line:<n>)")
    parser.add_argument("--load-fingerprints", nargs="*", default=None,
                        help="fingerprint files (.npz from --save-fingerprints) of earlier shards: their "
                             "documents come first, so the inputs are deduplicated against them")
    parser.add_argument("--save-fingerprints", default=None, help="save the fingerprints of the inputs here (.npz)")
    parser.add_argument("--output", default=None, help="pairs file (loose JSON) to write")
    parser.add_argument("--jaccard", choices=JACCARD_MODES, default="union",
                        help="similarity: |A&B| over |A|B| (union, default), the smaller set (min) or the larger (max)")
    parser.add_argument("--heuristic-iter", type=int, default=1,
                        help="mains compared per LSH bucket (1, default: the bucket's first vs the rest; "
                             "-1: all pairs)")
    parser.add_argument("--num-bands", type=int, default=10, help="LSH bands (default 10)")
    parser.add_argument("--num-seeds", type=int, default=100,
                        help="hash functions per signature (default 100); a multiple of --num-bands")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the hash functions (default 1234)")
    parser.add_argument("--shingle", choices=SHINGLES, default="chars", help="shingle type (default chars)")
    parser.add_argument("--ngram", type=int, default=5, help="shingle length in characters or words (default 5)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="pairs with similarity above this are written (default 0.5, the seed's)")
    parser.add_argument("--jaccard-parallel", action="store_true",
                        help="accepted for the seed's scripts; verification always uses --workers")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="worker processes (default: all cores; 0 = this process only)")
    _common_flags(parser)
    return parser


def find_duplicates(args: argparse.Namespace) -> None:
    """Fingerprint the inputs, combine with loaded fingerprints, write verified pairs (seed format)."""
    if not args.inputs and not args.load_fingerprints:
        raise UsageError("nothing to do: pass --inputs FILE KEY [FILE KEY ...] and/or --load-fingerprints F ...")
    if args.inputs and len(args.inputs) % 2:
        raise UsageError(f"--inputs {' '.join(args.inputs)}: give file and key field pairs, "
                         "e.g. --inputs clean.json url")
    if not args.output and not args.save_fingerprints:
        raise UsageError("nothing to write: pass --output pairs.json and/or --save-fingerprints F.npz")
    if not 0.0 <= args.threshold <= 1.0:
        raise UsageError(f"--threshold {args.threshold}: must be in [0, 1]")
    if _complete([args.output, args.save_fingerprints], args.overwrite):
        return
    start, bad = time.perf_counter(), Counter()
    params = MinHashParams(args.shingle, args.ngram, args.num_seeds, args.num_bands, args.seed)
    parts = [load_fingerprints(p) for p in args.load_fingerprints or []]
    if args.inputs:
        inputs = list(zip(args.inputs[::2], args.inputs[1::2]))
        fresh = fingerprint_files(inputs, params, text_key=args.text_key, workers=args.workers,
                                  skip_bad_lines=args.skip_bad_lines, bad=bad)
        if args.save_fingerprints:
            save_fingerprints(fresh, args.save_fingerprints)
        parts.append(fresh)
    fp = concat(parts)
    pairs = []
    if args.output:
        candidates = candidate_pairs(fp, args.heuristic_iter)
        pairs = verify_pairs(fp, candidates, mode=args.jaccard, threshold=args.threshold, workers=args.workers).pairs
        write_pairs(args.output, fp.keys, pairs)
    skipped = f", bad lines skipped: {bad['bad_lines']}" if bad["bad_lines"] else ""
    print(f"documents: {len(fp)}, duplicate pairs: {len(pairs)}, documents in pairs: "
          f"{len({j for _, j, _ in pairs})} to remove, seconds: {time.perf_counter() - start:.2f}{skipped}")


def write_pairs(path: str | Path, keys: list[str], pairs: list[tuple[int, int, float]]) -> None:
    """One `{main_key: [{other_key: jaccard}, ...]}` line per main, mains and others in input order."""
    by_main: dict[int, list] = {}
    for i, j, sim in sorted(pairs):
        by_main.setdefault(i, []).append({keys[j]: round(sim, 6)})
    with atomic_jsonl(path) as out:
        for i, others in by_main.items():
            out.write({keys[i]: others})


def _json_lines(path: str, what: str):
    """(line number, object) of a loose-JSON file of dicts; UsageError naming file:line otherwise."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise unreadable(path, exc) from None
    with f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except ValueError as exc:
                raise UsageError(f"{path}:{n}: not a JSON line ({exc}); expected {what}") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{path}:{n}: a JSON {type(obj).__name__}, not an object; expected {what}")
            yield n, obj


def group_pairs(pairs_path: str, groups_path: str, threshold: float = 0.7, overwrite: bool = False) -> None:
    """Union of the pairs at or above `threshold` -> `{"i": [keys]}` lines, the earliest key first."""
    if _complete([groups_path], overwrite):
        return
    shape = '{"main_url": [{"other_url": 0.9}, ...]} per line (find_duplicates.py --output)'
    order: dict[str, int] = {}  # first appearance; the pairs file lists mains in input order
    parent: dict[str, str] = {}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for n, obj in _json_lines(pairs_path, shape):
        for main, others in obj.items():
            if not isinstance(others, list) or not all(isinstance(o, dict) for o in others):
                raise UsageError(f"{pairs_path}:{n}: the value of {main!r} is not a list of objects; expected {shape}")
            for other, sim in ((k, v) for o in others for k, v in o.items()):
                if not isinstance(sim, (int, float)):
                    raise UsageError(f"{pairs_path}:{n}: similarity {sim!r} is not a number; expected {shape}")
                if sim < threshold:
                    continue
                for k in (main, other):
                    order.setdefault(k, len(order))
                    parent.setdefault(k, k)
                a, b = root(main), root(other)
                if a != b:  # the group is named by its earliest member
                    parent[max(a, b, key=order.get)] = min(a, b, key=order.get)
    groups: dict[str, list[str]] = {}
    for k in order:
        groups.setdefault(root(k), []).append(k)
    groups = {g: members for g, members in groups.items() if len(members) > 1}  # a key paired with itself
    with atomic_jsonl(groups_path) as out:
        for i, members in enumerate(groups.values()):
            out.write({str(i): members})
    removed = sum(len(m) - 1 for m in groups.values())
    print(f"out of {removed + len(groups)} urls, only {len(groups)} are unique and {removed} should be removed "
          f"(threshold {threshold})")


def remove_groups(groups_path: str, data_path: str, output_path: str, *, text_key: str = "text",
                  key: str | None = None, skip_bad_lines: bool = False, overwrite: bool = False) -> None:
    """Copy `data_path` to `output_path` without the documents listed after the first in each group."""
    if _complete([output_path], overwrite):
        return
    drop: set[str] = set()
    for n, obj in _json_lines(groups_path, '{"0": ["kept_url", "removed_url", ...]} per line'):
        for members in obj.values():
            if not isinstance(members, list):
                raise UsageError(f"{groups_path}:{n}: a group is not a list of urls; write it with "
                                 "group_duplicate_url.py")
            drop.update(map(str, members[1:]))
    bad, written, removed, removed_chars = Counter(), 0, 0, 0
    key_fields = KEY_FIELDS if key is None else (key,)
    with atomic_jsonl(output_path) as out:
        for doc in read_documents(data_path, text_key, key_fields, skip_bad_lines, bad):
            if doc.key in drop:
                removed += 1
                removed_chars += len(doc.text)
                continue
            out.write(doc.record)
            written += 1
    skipped = f", bad lines skipped: {bad['bad_lines']}" if bad["bad_lines"] else ""
    print(f"written: {written}, removed: {removed} (chars: {removed_chars}){skipped}")
