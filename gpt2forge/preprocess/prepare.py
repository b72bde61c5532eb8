"""The whole corpus path in one command (data/prepare_corpus.py), with a manifest and resumable stages.

    clean -> exact dedup -> near dedup -> decontaminate -> shuffle -> [tokenize to .bin/.idx]

Each stage reads the previous stage's file in `--output-dir` and writes its own atomically:
`clean.jsonl`, `fingerprints.npz` + `exact.jsonl`, `near.jsonl`, `decontaminated.jsonl`,
`shuffled.jsonl`, then `<output-prefix>_<text-key>_document.{bin,idx}`. After each stage
`manifest.json` is rewritten (atomically) with the stage's record: documents and characters in and
out, removals by rule, up to 3 removed examples per rule (truncated), its settings, the size and
mtime of its inputs and the sizes of its outputs. A stage is skipped when its record matches: same
settings, inputs unchanged, outputs present at their recorded sizes. A stage that re-runs rewrites
its output, so every stage after it sees a changed input and re-runs too; `--overwrite` redoes all.

Deduplication fingerprints `clean.jsonl` once (documents are rows: duplicate URLs and several input
files need no keys); exact duplicates are removed first, then near duplicates among the rest, the
earliest document of each group kept. Memory: the fingerprints (~0.45 GB per million documents,
dedup.MEMORY_HELP) and the shuffle's line offsets (8 bytes per document), never the texts.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import glob
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2forge.core.atomic import fsync_path
from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess import clean, decontaminate, dedup, megatron
from gpt2forge.preprocess.jsonl import atomic_json, atomic_jsonl, read_documents
from gpt2forge.preprocess.minhash import JACCARD_MODES, MinHashParams

FORMAT = "gpt2forge-prepare-manifest"
VERSION = 1
STAGES = ("clean", "exact_dedup", "near_dedup", "decontaminate", "shuffle", "tokenize")


def _signature(paths: list[Path]) -> dict:
    """{path: {size, mtime_ns}} of stage inputs: a rewritten input invalidates the stages after it."""
    out = {}
    for p in paths:
        st = Path(p).stat()
        out[str(Path(p).resolve())] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def remove_stale_temporaries(paths: list[Path]) -> None:
    """Delete the temporary siblings of `paths` that a killed run left: `.<name>.tmp-<pid>`
    (atomic_jsonl, the shuffle) and `.<name>.<random>.tmp` (write_atomic, the .bin/.idx writer).
    SIGKILL runs no cleanup, so without this each killed stage would leave a copy of its output
    behind, a corpus-sized file at scale. Hence one run per output folder at a time."""
    for path in paths:
        for tmp in path.parent.glob(f".{glob.escape(path.name)}.*"):
            if tmp.name.endswith(".tmp") or ".tmp-" in tmp.name:
                tmp.unlink(missing_ok=True)


def _plain(obj) -> object:
    """`obj` as it reads back from JSON (tuples -> lists), so settings compare equal after a reload."""
    return json.loads(json.dumps(obj))


class Manifest:
    """manifest.json in the output folder: loaded at start, rewritten atomically after each stage."""

    def __init__(self, out_dir: Path, settings: dict, overwrite: bool):
        self.path = out_dir / "manifest.json"
        self.overwrite = overwrite
        old = {}
        if self.path.is_file() and not overwrite:
            try:
                old = json.loads(self.path.read_text(encoding="utf-8"))
            except ValueError:
                old = {}  # a damaged manifest only costs a re-run
        self.stages: dict = old.get("stages", {}) if old.get("format") == FORMAT else {}
        self.settings = _plain(settings)
        self.skipped: list[str] = []

    def save(self) -> None:
        removed = Counter()
        for record in self.stages.values():
            removed.update(record.get("removed", {}))
        atomic_json(self.path, {"format": FORMAT, "version": VERSION, "settings": self.settings,
                                "removed_by_rule": dict(removed), "stages": self.stages})

    def run(self, name: str, inputs: list[Path], outputs: list[Path], settings: dict,
            work: Callable[[], dict]) -> dict:
        """The stage's record: the saved one when complete, else `work()`'s, saved."""
        settings, sig = _plain(settings), _signature(inputs)
        prev = self.stages.get(name)
        sizes = {str(p.resolve()): p.stat().st_size for p in outputs if p.is_file()}
        if (not self.overwrite and prev and prev.get("settings") == settings and prev.get("inputs") == sig
                and prev.get("outputs") == sizes and len(sizes) == len(outputs)):
            print(f"{name}: complete ({', '.join(p.name for p in outputs)}); skipping")
            self.skipped.append(name)
            return prev
        for later in STAGES[STAGES.index(name):]:  # they all re-run after this one: drop their old records
            self.stages.pop(later, None)
        remove_stale_temporaries([*outputs, self.path])
        start = time.perf_counter()
        record = work()
        record.update(settings=settings, inputs=sig, seconds=round(time.perf_counter() - start, 3),
                      outputs={str(p.resolve()): p.stat().st_size for p in outputs})
        self.stages[name] = record
        self.save()
        print(_line(name, record))
        if not record["docs_out"]:
            raise UsageError(f"{name} removed every document ({_line(name, record)}); nothing is left for the "
                             "next stage: check the input and the settings (e.g. --lang, --min-tokens)")
        return record


def _line(name: str, r: dict) -> str:
    rules = ", ".join(f"{k} {v}" for k, v in sorted(r.get("removed", {}).items())) or "none"
    return (f"{name}: kept {r['docs_out']} of {r['docs_in']} documents ({r['chars_out']} of {r['chars_in']} "
            f"characters); removed: {rules}; {r['seconds']:.2f} s")


def _record(docs_in: int, docs_out: int, chars_in: int, chars_out: int, removed: dict, examples: dict,
            **extra) -> dict:
    return {"docs_in": docs_in, "docs_out": docs_out, "chars_in": chars_in, "chars_out": chars_out,
            "removed": {k: int(v) for k, v in removed.items() if v}, "examples": examples, **extra}


def clean_stage(inputs: list[Path], output: Path, cfg: clean.CleanConfig, args: argparse.Namespace) -> dict:
    """Every input file, in order, through the Cleaner into one file."""
    summary, bad = clean.CleanSummary(), Counter()

    def documents():
        for path in inputs:
            yield from read_documents(path, text_key=args.text_key, skip_bad_lines=args.skip_bad_lines, bad=bad)

    with atomic_jsonl(output) as out:
        bar = tqdm(clean.clean_documents(documents(), cfg, args.workers), desc="clean", unit=" docs", disable=None)
        for doc, text, rule in bar:
            summary.add(doc.text, text, rule)
            if text is not None:
                out.write(doc.record | {args.text_key: text})
    return _record(summary.docs_in, summary.docs_out, summary.chars_in, summary.chars_out, summary.removed,
                   summary.examples, bad_lines=bad["bad_lines"])


def _examples(fp: dedup.Fingerprints, rows: np.ndarray) -> list[str]:
    """The (truncated) texts of the first few `rows`, re-read from their file."""
    rows = rows[:clean.EXAMPLES_PER_RULE]
    wanted = {int(fp.line[i]): int(i) for i in rows}
    texts = {}
    if not wanted:
        return []
    for doc in read_documents(fp.sources[0]["path"], fp.sources[0]["text_key"]):
        if doc.line in wanted:
            texts[wanted[doc.line]] = f"{fp.keys[wanted[doc.line]]}: {doc.text[:clean.EXAMPLE_CHARS]}"
        if doc.line >= max(wanted):
            break
    return [texts[int(i)] for i in rows if int(i) in texts]


def _kept_record(fp: dedup.Fingerprints, before: np.ndarray, removed: np.ndarray, rule: str) -> dict:
    """Counts for a dedup stage: documents not `before`-removed in, those not `removed` out."""
    chars = fp.chars
    newly = removed & ~before
    return _record(int((~before).sum()), int((~removed).sum()), int(chars[~before].sum()),
                   int(chars[~removed].sum()), {rule: int(newly.sum())}, {rule: _examples(fp, np.flatnonzero(newly))})


def exact_stage(src: Path, fp_path: Path, output: Path, params: MinHashParams, args: argparse.Namespace) -> dict:
    fp = dedup.fingerprint_files([(str(src), None)], params, text_key=args.text_key, workers=args.workers,
                                 progress=True)
    dedup.save_fingerprints(fp, fp_path)
    dup = dedup.exact_duplicates(fp)
    dedup.write_kept(fp, dup, output)
    return _kept_record(fp, np.zeros(len(fp), bool), dup, "exact_duplicate")


def _subset(fp: dedup.Fingerprints, rows: np.ndarray) -> dedup.Fingerprints:
    return dedup.Fingerprints(fp.params, fp.sources, [fp.keys[i] for i in rows.tolist()], fp.signatures[rows],
                              fp.exact[rows], fp.source[rows], fp.line[rows], fp.chars[rows])


def near_stage(fp_path: Path, output: Path, args: argparse.Namespace) -> dict:
    """Near duplicates among the documents exact dedup kept, by row (the fingerprints' own file)."""
    fp = dedup.load_fingerprints(fp_path)
    before = dedup.exact_duplicates(fp)
    rows = np.flatnonzero(~before)
    near_sub, pairs = dedup.near_duplicates(_subset(fp, rows), mode=args.jaccard, threshold=args.threshold,
                                            heuristic_iter=args.heuristic_iter, workers=args.workers,
                                            progress=True)
    removed = before.copy()
    removed[rows[near_sub]] = True
    dedup.write_kept(fp, removed, output)
    return _kept_record(fp, before, removed, "near_duplicate") | {"pairs": len(pairs)}


def decontaminate_stage(src: Path, output: Path, cfg: decontaminate.DecontaminateConfig,
                        args: argparse.Namespace) -> dict:
    s = decontaminate.decontaminate_file(src, output, [str(p) for p in args.eval_files or []], cfg,
                                         workers=args.workers, text_key=args.text_key,
                                         eval_text_key=args.eval_text_key)
    return _record(s.docs_in, s.pieces_out, s.chars_in, s.chars_out, {"contaminated": s.docs_contaminated},
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


def shuffle_stage(src: Path, output: Path, seed: int, chars: int) -> dict:
    """Lines of `src` in a seeded random order, streamed: memory is the line offsets and the
    permutation (24 bytes per document), never the texts; each line is read by seeking."""
    starts, ends = line_offsets(src)
    order = np.random.default_rng(seed).permutation(len(starts))
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        with open(src, "rb") as f, open(tmp, "wb") as out:
            for i in order.tolist():
                f.seek(starts[i])
                line = f.read(int(ends[i] - starts[i]))
                out.write(line if line.endswith(b"\n") else line + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, output)
        fsync_path(output.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return _record(len(order), len(order), chars, chars, {}, {})


def tokenize_stage(src: Path, args: argparse.Namespace, chars: int) -> dict:
    """preprocess_data.py on the shuffled corpus (`chars` of text in); records tokens, not characters, out."""
    argv = ["--input", str(src), "--output-prefix", args.output_prefix, "--json-key", args.text_key,
            "--tokenizer-type", args.tokenizer_type, "--workers", str(max(1, args.workers)), "--overwrite"]
    for flag, value in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                        ("--tokenizer-name-or-path", args.tokenizer_name_or_path)):
        if value:
            argv += [flag, value]
    if args.append_eod:
        argv.append("--append-eod")
    stats = megatron.preprocess_data(megatron.build_parser().parse_args(argv))
    return _record(stats.documents + stats.skipped, stats.documents, chars, chars, {"empty": stats.skipped}, {},
                   tokens=stats.tokens)


def check_args(args: argparse.Namespace) -> None:
    problems = [f"--input {p}: no such file" for p in args.input if not Path(p).is_file()]
    problems += [f"--eval-files {p}: no such file" for p in args.eval_files or [] if not Path(p).is_file()]
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        problems.append(f"--output-dir {args.output_dir}: a file, not a folder; name a folder (created when missing)")
    if not 0.0 <= args.threshold <= 1.0:
        problems.append(f"--threshold {args.threshold}: must be in [0, 1]")
    if args.workers < 0:
        problems.append(f"--workers {args.workers}: must be >= 0")
    if problems:
        raise UsageError("; ".join(problems))


def prepare_corpus(args: argparse.Namespace) -> Manifest:
    """Run (or resume) every stage for the parsed command line; returns the manifest."""
    check_args(args)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # the docs' `--output-dir out/` names a folder to create
    clean_cfg = clean.config_from_args(args)
    params = MinHashParams(args.shingle, args.ngram, args.num_seeds, args.num_bands, args.seed)
    decon_cfg = decontaminate.DecontaminateConfig(ngram=args.decontaminate_ngram, mode=args.decontaminate_mode)
    common = {"text_key": args.text_key}
    settings = {"clean": dataclasses.asdict(clean_cfg) | common | {"skip_bad_lines": args.skip_bad_lines},
                "exact_dedup": dataclasses.asdict(params) | common,
                "near_dedup": {"jaccard": args.jaccard, "threshold": args.threshold,
                               "heuristic_iter": args.heuristic_iter},
                "decontaminate": dataclasses.asdict(decon_cfg) | {"eval_text_key": args.eval_text_key},
                "shuffle": {"shuffle_seed": args.shuffle_seed}}
    if args.output_prefix:
        settings["tokenize"] = {k: getattr(args, k) for k in ("output_prefix", "tokenizer_type", "vocab_file",
                                                              "merge_file", "tokenizer_name_or_path", "append_eod")}
    m = Manifest(out_dir, {"input": list(map(str, args.input)), "stages": settings}, args.overwrite)
    files = {name: out_dir / f"{name}.jsonl" for name in ("clean", "exact", "near", "decontaminated", "shuffled")}
    fp_path = out_dir / "fingerprints.npz"
    inputs = [Path(p) for p in args.input]
    m.run("clean", inputs, [files["clean"]], settings["clean"],
          lambda: clean_stage(inputs, files["clean"], clean_cfg, args))
    m.run("exact_dedup", [files["clean"]], [fp_path, files["exact"]], settings["exact_dedup"],
          lambda: exact_stage(files["clean"], fp_path, files["exact"], params, args))
    m.run("near_dedup", [fp_path, files["exact"]], [files["near"]], settings["near_dedup"],
          lambda: near_stage(fp_path, files["near"], args))
    m.run("decontaminate", [files["near"], *map(Path, args.eval_files or [])], [files["decontaminated"]],
          settings["decontaminate"], lambda: decontaminate_stage(files["near"], files["decontaminated"],
                                                                 decon_cfg, args))
    chars = m.stages["decontaminate"]["chars_out"]
    m.run("shuffle", [files["decontaminated"]], [files["shuffled"]], settings["shuffle"],
          lambda: shuffle_stage(files["decontaminated"], files["shuffled"], args.shuffle_seed, chars))
    if args.output_prefix:
        prefix = f"{args.output_prefix}_{args.text_key}_document"
        m.run("tokenize", [files["shuffled"]], [Path(prefix + ".bin"), Path(prefix + ".idx")],
              settings["tokenize"], lambda: tokenize_stage(files["shuffled"], args, chars))
    elif m.stages.pop("tokenize", None):  # tokenized by an earlier run, not this one
        m.save()
    if args.manifest:
        atomic_json(args.manifest, json.loads(m.path.read_text(encoding="utf-8")))
    return m


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="data/prepare_corpus.py",
        description="Raw loose JSON -> cleaned, deduplicated, decontaminated, shuffled corpus (and optionally "
                    "Megatron .bin/.idx), one resumable command with a manifest.json of every stage. "
                    f"{dedup.MEMORY_HELP}; the shuffle keeps 16 bytes per document.")
    p.add_argument("--input", nargs="+", required=True, help="raw loose-JSON files, one object per line")
    p.add_argument("--output-dir", required=True, help="folder for every stage's file and manifest.json")
    p.add_argument("--eval-files", nargs="*", default=[],
                   help="evaluation files to decontaminate against: .json/.jsonl (e.g. LAMBADA) or plain text "
                        "(e.g. wiki.test.tokens); none: the stage only copies")
    p.add_argument("--eval-text-key", default="text", help="text field of .json/.jsonl evaluation files")
    p.add_argument("--decontaminate-ngram", type=int, default=13, help="words per decontamination n-gram")
    p.add_argument("--decontaminate-mode", choices=("drop", "cut"), default="drop",
                   help="drop overlapping documents, or cut the overlapping spans out")
    g = p.add_argument_group("near-duplicate removal (find_duplicates.py's defaults)")
    g.add_argument("--jaccard", choices=JACCARD_MODES, default="union", help="similarity of candidate pairs")
    g.add_argument("--threshold", type=float, default=0.5, help="pairs above this similarity are duplicates")
    g.add_argument("--heuristic-iter", type=int, default=1, help="mains per LSH bucket (-1: all pairs)")
    g.add_argument("--num-bands", type=int, default=10, help="LSH bands")
    g.add_argument("--num-seeds", type=int, default=100, help="hash functions per signature")
    g.add_argument("--seed", type=int, default=1234, help="seed of the hash functions")
    g.add_argument("--shingle", choices=("chars", "words"), default="chars", help="shingle type")
    g.add_argument("--ngram", type=int, default=5, help="shingle length in characters or words")
    p.add_argument("--shuffle-seed", type=int, default=1234, help="seed of the document shuffle")
    t = p.add_argument_group("tokenization (optional; preprocess_data.py's flags)")
    t.add_argument("--output-prefix", default=None,
                   help="also write <prefix>_<text-key>_document.{bin,idx} from the shuffled corpus")
    t.add_argument("--tokenizer-type", choices=megatron.TOKENIZER_TYPES, default="GPT2BPETokenizer",
                   help="tokenizer of the .bin/.idx (see preprocess_data.py)")
    t.add_argument("--vocab-file", default=None, help="GPT-2-style vocab.json (with --merge-file)")
    t.add_argument("--merge-file", default=None, help="GPT-2-style merges.txt (with --vocab-file)")
    t.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    clean.add_arguments(p)  # --lang, --min-tokens, --tokenizer-name-or-path, --workers, --overwrite, ...
    p.set_defaults(manifest=None)  # output-dir/manifest.json is always written; --manifest F also copies it to F
    return p
