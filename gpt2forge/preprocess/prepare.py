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
dedup.MEMORY_HELP) and the shuffle's line offsets and order (26 bytes per document), never the texts.

The stages are gpt2forge/preprocess/stages.py, the manifest gpt2forge/preprocess/manifest.py. With
`--num-shards N` the same pipeline runs as N independent shard tasks (`--shard K`: clean and
fingerprint a part of the input) and one merge (the rest), whose outputs are this run's byte for
byte; `--two-passes` moves decontamination and tokenization into the tasks, run a second time after
the merge's dedup: gpt2forge/preprocess/sharded.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess import clean, decontaminate, dedup, megatron, sharded
from gpt2forge.preprocess.jsonl import atomic_json
from gpt2forge.preprocess.manifest import Manifest, hold_folder
from gpt2forge.preprocess.minhash import JACCARD_MODES, MinHashParams
from gpt2forge.preprocess.stages import (
    clean_stage,
    decontaminate_stage,
    exact_stage,
    fingerprints_of,
    near_stage,
    output_files,
    shuffle_stage,
    tokenize_stage,
)

STAGES = ("clean", "exact_dedup", "near_dedup", "decontaminate", "shuffle", "tokenize")


def check_args(args: argparse.Namespace) -> None:
    problems = [f"--input {p}: no such file" for p in args.input if not Path(p).is_file()]
    problems += [f"--eval-files {p}: no such file" for p in args.eval_files or [] if not Path(p).is_file()]
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        problems.append(f"--output-dir {args.output_dir}: a file, not a folder; name a folder (created when missing)")
    if not 0.0 <= args.threshold <= 1.0:
        problems.append(f"--threshold {args.threshold}: must be in [0, 1]")
    if args.workers < 0:
        problems.append(f"--workers {args.workers}: must be >= 0")
    problems += sharded.check_args(args.shard, args.num_shards, args.two_passes)
    if problems:
        raise UsageError("; ".join(problems))


def stage_settings(args: argparse.Namespace, clean_cfg: clean.CleanConfig, params: MinHashParams,
                   decon_cfg: decontaminate.DecontaminateConfig) -> dict:
    """{stage: the settings its manifest record keeps}: a stage whose settings change re-runs."""
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
    return settings


def prepare_corpus(args: argparse.Namespace) -> Manifest:
    """Run (or resume) every stage for the parsed command line; returns the manifest (a shard
    task's, with `--shard`)."""
    check_args(args)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # the docs' `--output-dir out/` names a folder to create
    clean_cfg = clean.config_from_args(args)
    params = MinHashParams(args.shingle, args.ngram, args.num_seeds, args.num_bands, args.seed)
    decon_cfg = decontaminate.DecontaminateConfig(ngram=args.decontaminate_ngram, mode=args.decontaminate_mode)
    settings = stage_settings(args, clean_cfg, params, decon_cfg)
    inputs = [Path(p) for p in args.input]
    if args.shard is not None:
        return sharded.run_task(args, inputs, settings, clean_cfg, params, decon_cfg)
    with hold_folder(out_dir):
        return _run_stages(args, out_dir, inputs, settings, clean_cfg, params, decon_cfg)


def _run_stages(args: argparse.Namespace, out_dir: Path, inputs: list[Path], settings: dict,
                clean_cfg: clean.CleanConfig, params: MinHashParams,
                decon_cfg: decontaminate.DecontaminateConfig) -> Manifest:
    """The one-machine run's stages, or the merge's, each skipped where the manifest says it is complete."""
    layout = {"num_shards": args.num_shards, "two_passes": args.two_passes} if args.num_shards else {}
    m = Manifest(out_dir, {"input": list(map(str, args.input)), **layout, "stages": settings}, args.overwrite,
                 STAGES)
    files = output_files(out_dir)
    evals = [Path(p) for p in args.eval_files or []]
    if args.num_shards:  # the merge: the shard tasks' clean files and fingerprints, in shard order
        sharded.merge_shards(m, args.num_shards, inputs, settings, files["fingerprints"], files["exact"])
    else:
        m.run("clean", inputs, [files["clean"]], settings["clean"],
              lambda: clean_stage([(p, None) for p in inputs], files["clean"], clean_cfg, args))
        m.run("exact_dedup", [files["clean"]], [files["fingerprints"], files["exact"]], settings["exact_dedup"],
              lambda: exact_stage(fingerprints_of(files["clean"], params, args), files["fingerprints"],
                                  files["exact"]))
    m.run("near_dedup", [files["fingerprints"], files["exact"]], [files["near"]], settings["near_dedup"],
          lambda: near_stage(files["fingerprints"], files["near"], args))
    if args.two_passes:  # the shard tasks decontaminate and tokenize their parts of near.jsonl
        folders = sharded.second_pass_parts(m, args, settings)
        if folders is None:
            return m
        texts, token_files = sharded.second_pass_files(folders, args.text_key)
        m.run("decontaminate", [*texts, *evals], [], settings["decontaminate"],
              lambda: sharded.gathered_decontamination(folders))
    else:
        texts, token_files = [files["decontaminated"]], []
        m.run("decontaminate", [files["near"], *evals], texts, settings["decontaminate"],
              lambda: decontaminate_stage(files["near"], files["decontaminated"], decon_cfg, args))
    chars = m.stages["decontaminate"]["chars_out"]
    m.run("shuffle", texts, [files["shuffled"]], settings["shuffle"],
          lambda: shuffle_stage(texts, files["shuffled"], args.shuffle_seed, chars))
    if args.output_prefix:
        prefix = f"{args.output_prefix}_{args.text_key}_document"
        tokenize = (lambda: sharded.gathered_tokens(args, folders, files["shuffled"], chars)) if args.two_passes \
            else (lambda: tokenize_stage(files["shuffled"], args, chars))
        m.run("tokenize", [files["shuffled"], *token_files], [Path(prefix + ".bin"), Path(prefix + ".idx")],
              settings["tokenize"], tokenize)
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
                    f"{dedup.MEMORY_HELP}; the shuffle keeps 26 bytes per document.")
    p.add_argument("--input", nargs="+", required=True, help="raw loose-JSON files, one object per line")
    p.add_argument("--output-dir", required=True, help="folder for every stage's file and manifest.json")
    p.add_argument("--eval-files", nargs="*", default=[],
                   help="evaluation files to decontaminate against: .json/.jsonl (e.g. LAMBADA) or plain text "
                        "(e.g. wiki.test.tokens); none: the stage only copies")
    p.add_argument("--eval-text-key", default="text", help="text field of .json/.jsonl evaluation files")
    p.add_argument("--decontaminate-ngram", type=int, default=13, help="words per decontamination n-gram")
    p.add_argument("--decontaminate-mode", choices=("drop", "cut"), default="drop",
                   help="drop overlapping documents, or cut the overlapping spans out")
    g = p.add_argument_group("near-duplicate removal (find_duplicates.py's flags; its defaults but --num-bands)")
    g.add_argument("--jaccard", choices=JACCARD_MODES, default="union", help="similarity of candidate pairs")
    g.add_argument("--threshold", type=float, default=0.5, help="pairs above this similarity are duplicates")
    g.add_argument("--heuristic-iter", type=int, default=1, help="mains per LSH bucket (-1: all pairs)")
    g.add_argument("--num-bands", type=int, default=20,
                   help="LSH bands: 20 of 5 rows find a pair of Jaccard 0.8 with probability 0.9996 (the seed's 10 of "
                        "10: 0.68; benchmarks/corpus_scale.py measures both)")
    g.add_argument("--num-seeds", type=int, default=100, help="hash functions per signature")
    g.add_argument("--seed", type=int, default=1234, help="seed of the hash functions")
    g.add_argument("--shingle", choices=("chars", "words"), default="chars", help="shingle type")
    g.add_argument("--ngram", type=int, default=5, help="shingle length in characters or words")
    p.add_argument("--shuffle-seed", type=int, default=1234, help="seed of the document shuffle")
    s = p.add_argument_group("more than one machine (docs/corpus.md; run/prepare_corpus_array.sbatch, .pbs)")
    s.add_argument("--num-shards", type=int, default=0,
                   help="run as N shard tasks plus one merge, whose outputs equal the one-machine run's; "
                        "without --shard: the merge, once every task is complete (0: one machine)")
    s.add_argument("--two-passes", action="store_true",
                   help="the shard tasks also decontaminate and tokenize, each a part of the merge's near.jsonl, "
                        "in a second array run after the merge's deduplication; the merge, run again once they "
                        "are complete, shuffles and writes the .bin/.idx (four submissions: array, merge, array, "
                        "merge; the same outputs)")
    s.add_argument("--shard", type=int, default=None,
                   help="this shard task's index K in [0, N): cleans and fingerprints the K-th of N equal byte "
                        "ranges of the inputs into <output-dir>/shards/ (a job array's task id)")
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
