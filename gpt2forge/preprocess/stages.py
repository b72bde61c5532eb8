"""The stages of data/prepare_corpus.py, each a function from its input file(s) to its output
file(s) and its manifest record (gpt2forge/preprocess/manifest.py): clean, exact dedup (with the
fingerprints), near dedup, decontaminate, shuffle, tokenize. gpt2forge/preprocess/prepare.py runs
them in order on one machine; gpt2forge/preprocess/sharded.py runs the clean stage and the
fingerprinting per shard task and the rest in its merge (with --two-passes, decontamination and
tokenization in the tasks too).
"""

from __future__ import annotations

import argparse
import array
import contextlib
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2forge.core.atomic import atomic_file
from gpt2forge.preprocess import clean, decontaminate, dedup, megatron
from gpt2forge.preprocess.jsonl import atomic_jsonl, read_documents
from gpt2forge.preprocess.minhash import MinHashParams


def output_files(out_dir: Path) -> dict[str, Path]:
    """The files of the one-machine run (and of a sharded run's merge) in --output-dir, by name:
    clean, fingerprints, exact, near, decontaminated, shuffled (the .bin/.idx are --output-prefix's)."""
    names = ("clean", "exact", "near", "decontaminated", "shuffled")
    return {name: out_dir / f"{name}.jsonl" for name in names} | {"fingerprints": out_dir / "fingerprints.npz"}


def stage_record(docs_in: int, docs_out: int, chars_in: int, chars_out: int, removed: dict, examples: dict,
            **extra) -> dict:
    return {"docs_in": docs_in, "docs_out": docs_out, "chars_in": chars_in, "chars_out": chars_out,
            "removed": {k: int(v) for k, v in removed.items() if v}, "examples": examples, **extra}


def clean_stage(inputs: list[tuple[Path, tuple[int, int] | None]], output: Path, cfg: clean.CleanConfig,
                args: argparse.Namespace) -> dict:
    """Every input, in order, through the Cleaner into one file. An input is a file and the span of
    bytes to read (None: all of it; a shard task's part, gpt2forge.preprocess.sharded)."""
    summary, bad = clean.CleanSummary(), Counter()

    def documents():
        for path, span in inputs:
            yield from read_documents(path, text_key=args.text_key, skip_bad_lines=args.skip_bad_lines, bad=bad,
                                      span=span)

    with atomic_jsonl(output) as out:
        bar = tqdm(clean.clean_documents(documents(), cfg, args.workers), desc="clean", unit=" docs", disable=None)
        for doc, text, rule in bar:
            summary.add(doc.text, text, rule)
            if text is not None:
                out.write(doc.record | {args.text_key: text})
    return stage_record(summary.docs_in, summary.docs_out, summary.chars_in, summary.chars_out, summary.removed,
                   summary.examples, bad_lines=bad["bad_lines"])


def _examples(fp: dedup.Fingerprints, rows: np.ndarray) -> list[str]:
    """The (truncated) texts of the first few `rows`, re-read from their files."""
    rows = rows[:clean.EXAMPLES_PER_RULE]
    texts = dedup.read_texts(fp, rows) if len(rows) else {}
    return [f"{fp.keys[i]}: {texts[i][:clean.EXAMPLE_CHARS]}" for i in rows.tolist()]


def _kept_record(fp: dedup.Fingerprints, before: np.ndarray, removed: np.ndarray, rule: str) -> dict:
    """Counts for a dedup stage: documents not `before`-removed in, those not `removed` out."""
    chars = fp.chars
    newly = removed & ~before
    return stage_record(int((~before).sum()), int((~removed).sum()), int(chars[~before].sum()),
                   int(chars[~removed].sum()), {rule: int(newly.sum())}, {rule: _examples(fp, np.flatnonzero(newly))})


def fingerprints_of(src: Path, params: MinHashParams, args: argparse.Namespace) -> dedup.Fingerprints:
    """The fingerprints of the documents of `src` (a stage's file), row i = document i."""
    return dedup.fingerprint_files([(str(src), None)], params, text_key=args.text_key, workers=args.workers,
                                   progress=True)


def exact_stage(fp: dedup.Fingerprints, fp_path: Path, output: Path) -> dict:
    """Save `fp` to `fp_path`; write its documents but the exact duplicates of earlier ones to `output`."""
    dedup.save_fingerprints(fp, fp_path)
    dup = dedup.exact_duplicates(fp)
    dedup.write_kept(fp, dup, output)
    return _kept_record(fp, np.zeros(len(fp), bool), dup, "exact_duplicate")


def near_stage(fp_path: Path, output: Path, args: argparse.Namespace) -> dict:
    """Near duplicates among the documents exact dedup kept, by row (the fingerprints' own file)."""
    fp = dedup.load_fingerprints(fp_path)
    before = dedup.exact_duplicates(fp)
    near = dedup.near_duplicates(fp, mode=args.jaccard, threshold=args.threshold, heuristic_iter=args.heuristic_iter,
                                 workers=args.workers, progress=True, rows=np.flatnonzero(~before))
    removed = before | near.removed
    dedup.write_kept(fp, removed, output)
    return _kept_record(fp, before, removed, "near_duplicate") | {
        "candidates": near.candidates, "compared": near.compared, "pairs": len(near.pairs)}


def decontaminate_stage(src: Path, output: Path, cfg: decontaminate.DecontaminateConfig,
                        args: argparse.Namespace, span: tuple[int, int] | None = None) -> dict:
    """The documents of `src` (those starting in `span`'s bytes, when given) minus their overlaps
    with the evaluation files."""
    s = decontaminate.decontaminate_file(src, output, [str(p) for p in args.eval_files or []], cfg,
                                         workers=args.workers, text_key=args.text_key,
                                         eval_text_key=args.eval_text_key, span=span)
    return stage_record(s.docs_in, s.pieces_out, s.chars_in, s.chars_out, {"contaminated": s.docs_contaminated},
                   {"contaminated": s.examples} if s.examples else {}, ngrams_matched=s.ngrams_matched)


def line_offsets(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends): int64 byte offsets of each non-blank line of `path`, 16 bytes per document."""
    starts, ends = array.array("q"), array.array("q")
    pos = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                starts.append(pos)
                ends.append(pos + len(raw))
            pos += len(raw)
    return np.frombuffer(starts, np.int64), np.frombuffer(ends, np.int64)


def shuffle_order(count: int, seed: int) -> np.ndarray:
    """The shuffle's permutation of `count` documents: output line i is input line order[i]."""
    return np.random.default_rng(seed).permutation(count)


def shuffle_stage(srcs: list[Path], output: Path, seed: int, chars: int) -> dict:
    """Lines of `srcs` (read as one file, in order) in a seeded random order, streamed: memory is
    the line offsets and the permutation (26 bytes per document), never the texts; each line is
    read by seeking."""
    offsets = [line_offsets(src) for src in srcs]
    starts = np.concatenate([s for s, _ in offsets])
    ends = np.concatenate([e for _, e in offsets])
    file_of = np.repeat(np.arange(len(srcs), dtype=np.int16), [len(s) for s, _ in offsets])
    order = shuffle_order(len(starts), seed)
    with contextlib.ExitStack() as stack, atomic_file(output) as out:
        files = [stack.enter_context(open(src, "rb")) for src in srcs]
        for i in order.tolist():
            f = files[file_of[i]]
            f.seek(starts[i])
            line = f.read(int(ends[i] - starts[i]))
            out.write(line if line.endswith(b"\n") else line + b"\n")
    return stage_record(len(order), len(order), chars, chars, {}, {})


def tokenize_stage(src: Path, args: argparse.Namespace, chars: int, output_prefix: str | None = None) -> dict:
    """preprocess_data.py on the shuffled corpus (`chars` of text in) into `output_prefix` (default
    --output-prefix); records tokens, not characters, out."""
    argv = ["--input", str(src), "--output-prefix", output_prefix or args.output_prefix, "--json-key", args.text_key,
            "--tokenizer-type", args.tokenizer_type, "--workers", str(max(1, args.workers)), "--overwrite"]
    for flag, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                        ("--tokenizer-name-or-path", args.tokenizer_name_or_path)):
        if value:
            argv += [flag, value]
    if args.append_eod:
        argv.append("--append-eod")
    stats = megatron.preprocess_data(megatron.build_parser().parse_args(argv))
    return stage_record(stats.documents + stats.skipped, stats.documents, chars, chars, {"empty": stats.skipped}, {},
                   tokens=stats.tokens)
