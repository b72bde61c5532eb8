"""data/prepare_corpus.py on many machines: N independent shard tasks, then one merge, whose
outputs are the one-machine run's byte for byte.

    task K of N (`--shard K --num-shards N`, any machine, any order, at the same time):
        the K-th part of the input, cleaned and fingerprinted, into
        <output-dir>/shards/<K>-of-<N>/{clean.jsonl, fingerprints.npz, manifest.json}
    merge (`--num-shards N`, once every task is complete): the shards' fingerprints joined in
        shard order, exact and near dedup over all of them, then decontamination, shuffle and
        tokenization, into <output-dir>, with the one-machine run's manifest

The parts: the input files, in command-line order, are one byte stream cut into N equal ranges;
part K is the lines that start in range K (read_documents' `span`; a line crossing a cut belongs to
the part it starts in). So the parts are contiguous runs of the global document order, and since
cleaning and fingerprinting look at one document at a time, the shards' clean files joined in shard
order are the one-machine clean.jsonl and their joined fingerprints its rows. From there the merge
runs the one-machine code on the same rows: the same exact hashes, LSH candidates and verified
pairs (texts re-read from the shards' clean files), the same earliest-kept choice across shards,
the same shuffle permutation of the same documents. Nothing is decided per shard. The tasks do the
work that grows with the text (language ID, ftfy, quality rules, signatures); the merge joins the
signatures (~0.45 GB per million documents) and reads the corpus once per later stage.

With --two-passes the merge stops after near dedup, and the tasks, run again, each decontaminate and
tokenize the K-th of N line-aligned byte ranges of near.jsonl into their folders
(decontaminated.jsonl, tokens_<key>_document.bin/.idx); the merge, run again, shuffles the tasks'
parts read as one file and writes the .bin/.idx by putting their tokenized documents in the
shuffle's order. Both stages look at one document at a time and tokenization gives each document its
own sequences, so the parts joined are the one-machine decontaminated.jsonl and the gathered .bin/.idx
is what tokenizing the shuffled file writes. The merge then keeps only what grows with the number of
documents (the signatures, the candidate pairs, the shuffle's order) and copies.

Restarts: each task keeps its own manifest (stages `clean`, `fingerprint`, and `decontaminate`,
`tokenize` in a second pass), so a rerun task skips what it finished: a killed task reruns alone,
and rerunning the whole array redoes nothing that is complete. The merge refuses to start while a
task is unfinished, naming the tasks to rerun. Every machine must see <output-dir> and the inputs
at the same paths (a shared file system).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess import clean, decontaminate, dedup, megatron
from gpt2forge.preprocess.manifest import Manifest, hold_folder
from gpt2forge.preprocess.minhash import MinHashParams
from gpt2forge.preprocess.recipe import recipe_path, write_recipe
from gpt2forge.preprocess.stages import (
    clean_stage,
    decontaminate_stage,
    exact_stage,
    fingerprints_of,
    output_files,
    shuffle_order,
    stage_record,
    tokenize_stage,
)

FIRST_PASS = ("clean", "fingerprint")
SECOND_PASS = ("decontaminate", "tokenize")  # --two-passes: after the merge's dedup
TASK_STAGES = FIRST_PASS + SECOND_PASS
_RECORD_KEYS = ("docs_in", "docs_out", "chars_in", "chars_out", "removed", "examples", "settings", "inputs",
                "outputs", "seconds")


def check_args(shard: int | None, num_shards: int, two_passes: bool = False) -> list[str]:
    """The problems of --shard / --num-shards / --two-passes, one line each (empty: none)."""
    if num_shards < 0:
        return [f"--num-shards {num_shards}: must be >= 1 (or 0: one machine)"]
    if shard is not None and not num_shards:
        return [f"--shard {shard}: needs --num-shards N, the number of shard tasks (the job array's size)"]
    if shard is not None and not 0 <= shard < num_shards:
        return [f"--shard {shard}: must be in [0, {num_shards - 1}] for --num-shards {num_shards} "
                f"(Slurm: --array=0-{num_shards - 1}; PBS: -J 0-{num_shards - 1})"]
    if two_passes and not num_shards:
        return ["--two-passes: needs --num-shards N (it splits a sharded run's later stages over the shard tasks)"]
    return []


def parts(inputs: list[Path], num_shards: int) -> list[list[tuple[str, int, int]]]:
    """Each task's [(file, start byte, end byte)]: the inputs as one stream cut into `num_shards`
    equal ranges (module docstring). A task may get no file (more tasks than bytes)."""
    sizes = [p.stat().st_size for p in inputs]
    cuts = [sum(sizes) * k // num_shards for k in range(num_shards + 1)]
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        part, offset = [], 0
        for path, size in zip(inputs, sizes):
            start, end = max(lo, offset), min(hi, offset + size)
            if start < end:
                part.append((str(path.resolve()), start - offset, end - offset))
            offset += size
        out.append(part)
    return out


def shard_dir(out_dir: Path, shard: int, num_shards: int) -> Path:
    return out_dir / "shards" / f"{shard:05d}-of-{num_shards:05d}"


def _task_settings(settings: dict, part: list[tuple[str, int, int]]) -> dict:
    """A task's stage settings: the one-machine clean settings plus its part, the fingerprints', and
    for a second pass decontamination's and tokenization's (not where the merge writes its .bin/.idx)."""
    task = {"clean": settings["clean"] | {"part": part}, "fingerprint": settings["exact_dedup"],
            "decontaminate": settings["decontaminate"]}
    if "tokenize" in settings:
        task["tokenize"] = {k: v for k, v in settings["tokenize"].items() if k != "output_prefix"}
    return task


def _task_files(folder: Path) -> tuple[Path, Path]:
    return folder / "clean.jsonl", folder / "fingerprints.npz"


def _second_files(folder: Path, text_key: str) -> tuple[Path, str, list[Path]]:
    """A task's second-pass files: its part of the corpus decontaminated, and the prefix and files
    of that part tokenized."""
    prefix = f"{folder / 'tokens'}_{text_key}_document"
    return folder / "decontaminated.jsonl", prefix, [Path(prefix + ".bin"), Path(prefix + ".idx")]


def _no_fingerprints(params: MinHashParams) -> dedup.Fingerprints:
    """The fingerprints of a task whose part kept no document (no file to read them from)."""
    return dedup.Fingerprints(params, [], [], np.zeros((0, params.num_perm), np.uint32), np.zeros(0, np.uint64),
                              np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))


def run_task(args: argparse.Namespace, inputs: list[Path], settings: dict, clean_cfg: clean.CleanConfig,
             params: MinHashParams, decon_cfg: decontaminate.DecontaminateConfig) -> Manifest:
    """Shard task `args.shard` of `args.num_shards`: its part cleaned and fingerprinted, and with
    --two-passes, once the merge's dedup is complete, its part of near.jsonl decontaminated and
    tokenized (each stage skipped where its manifest says so); returns the task's manifest."""
    k, n = args.shard, args.num_shards
    part = parts(inputs, n)[k]
    folder = shard_dir(Path(args.output_dir), k, n)
    folder.mkdir(parents=True, exist_ok=True)
    with hold_folder(folder):
        m = _task_stages(args, inputs, _task_settings(settings, part), clean_cfg, params, part, folder)
        if args.two_passes:
            _second_pass(args, m, settings, decon_cfg, folder)
        return m


def _task_stages(args: argparse.Namespace, inputs: list[Path], task: dict, clean_cfg: clean.CleanConfig,
                 params: MinHashParams, part: list[tuple[str, int, int]], folder: Path) -> Manifest:
    k, n = args.shard, args.num_shards
    m = Manifest(folder, {"input": list(map(str, args.input)), "shard": k, "num_shards": n,
                          "two_passes": args.two_passes, "stages": task},
                 args.overwrite, TASK_STAGES, may_empty=True)
    clean_path, fp_path = _task_files(folder)
    spans = [(Path(path), (start, end)) for path, start, end in part]
    kept = m.run("clean", inputs, [clean_path], task["clean"], lambda: clean_stage(spans, clean_path, clean_cfg, args))

    def fingerprint() -> dict:
        fp = fingerprints_of(clean_path, params, args) if kept["docs_out"] else _no_fingerprints(params)
        dedup.save_fingerprints(fp, fp_path)
        return stage_record(len(fp), len(fp), kept["chars_out"], kept["chars_out"], {}, {})

    m.run("fingerprint", [clean_path], [fp_path], task["fingerprint"], fingerprint)
    if not args.two_passes:
        print(f"shard {k} of {n}: complete in {folder}")
    return m


def dedup_complete(out_dir: Path, settings: dict) -> bool:
    """Whether the merge in `out_dir` has finished near dedup (near.jsonl) with these settings."""
    files = output_files(out_dir)
    return Manifest(out_dir, {}, False, ()).complete("near_dedup", [files["fingerprints"], files["exact"]],
                                                     [files["near"]], settings["near_dedup"])


def _second_pass(args: argparse.Namespace, m: Manifest, settings: dict, decon_cfg: decontaminate.DecontaminateConfig,
                 folder: Path) -> None:
    """The task's K-th of N line-aligned byte ranges of the merge's near.jsonl, decontaminated and
    tokenized into its folder; or, before the merge has deduplicated, a line saying what is next."""
    k, n = args.shard, args.num_shards
    if not dedup_complete(Path(args.output_dir), settings):
        print(f"shard {k} of {n}: first pass complete in {folder}; next: the merge (deduplication), then this "
              "task again for its second pass (--two-passes)")
        return
    near = output_files(Path(args.output_dir))["near"]
    span = next(((start, end) for _, start, end in parts([near], n)[k]), (0, 0))  # (0, 0): no line of its own
    task = m.settings["stages"]
    dec, prefix, token_files = _second_files(folder, args.text_key)
    evals = [Path(p) for p in args.eval_files or []]
    kept = m.run("decontaminate", [near, *evals], [dec], task["decontaminate"],
                 lambda: decontaminate_stage(near, dec, decon_cfg, args, span))
    if args.output_prefix:
        m.run("tokenize", [dec], token_files, task["tokenize"],
              lambda: tokenize_stage(dec, args, kept["chars_out"], output_prefix=str(folder / "tokens")))
    print(f"shard {k} of {n}: second pass complete in {folder}")


def unfinished(out_dir: Path, inputs: list[Path], settings: dict, num_shards: int) -> list[int]:
    """The tasks whose manifest does not record both first-pass stages complete for these inputs and settings."""
    missing = []
    for k, part in enumerate(parts(inputs, num_shards)):
        folder = shard_dir(out_dir, k, num_shards)
        task, (clean_path, fp_path) = _task_settings(settings, part), _task_files(folder)
        m = Manifest(folder, {}, False, TASK_STAGES)
        if not (m.complete("clean", inputs, [clean_path], task["clean"])
                and m.complete("fingerprint", [clean_path], [fp_path], task["fingerprint"])):
            missing.append(k)
    return missing


def _unfinished_second(out_dir: Path, settings: dict, num_shards: int, args: argparse.Namespace) -> list[int]:
    """The tasks whose manifest does not record their second pass complete on this near.jsonl."""
    near, evals = output_files(out_dir)["near"], [Path(p) for p in args.eval_files or []]
    task = _task_settings(settings, [])  # the second pass's settings do not depend on the part
    missing = []
    for k in range(num_shards):
        folder = shard_dir(out_dir, k, num_shards)
        dec, _, token_files = _second_files(folder, args.text_key)
        m = Manifest(folder, {}, False, TASK_STAGES)
        if not (m.complete("decontaminate", [near, *evals], [dec], task["decontaminate"])
                and ("tokenize" not in task or m.complete("tokenize", [dec], token_files, task["tokenize"]))):
            missing.append(k)
    return missing


def _gathered(records: list[dict]) -> dict:
    """The tasks' records of one stage as the one-machine run's: counts summed (their own too, e.g.
    bad_lines, tokens), the first examples per rule in shard order."""
    removed, examples = Counter(), {}
    for r in records:
        removed.update(r["removed"])
        for rule, texts in r["examples"].items():
            examples.setdefault(rule, []).extend(texts)
    total = {key: sum(r[key] for r in records) for key in ("docs_in", "docs_out", "chars_in", "chars_out")}
    extra = {key: sum(r[key] for r in records) for key in records[0] if key not in _RECORD_KEYS}
    return stage_record(**total, removed=removed, **extra,
                        examples={rule: texts[:clean.EXAMPLES_PER_RULE] for rule, texts in examples.items()})


def merge_shards(m: Manifest, num_shards: int, inputs: list[Path], settings: dict, fp_path: Path,
                 exact_path: Path) -> None:
    """The merge's first two stages: `clean` (the tasks' records gathered) and `exact_dedup` (their
    fingerprints joined in shard order, saved to `fp_path`, exact duplicates removed into
    `exact_path`). UsageError naming the tasks to rerun when one is not complete."""
    out_dir = m.path.parent
    missing = unfinished(out_dir, inputs, settings, num_shards)
    if missing:
        ids = ",".join(map(str, missing))
        raise UsageError(
            f"--num-shards {num_shards}: shard task(s) {ids} not complete in {out_dir / 'shards'} (not run, killed, "
            f"still running, or run with other flags or inputs); run them again with these flags and --shard K "
            f"(e.g. sbatch --array={ids} run/prepare_corpus_array.sbatch ...), then the merge")
    folders = [shard_dir(out_dir, k, num_shards) for k in range(num_shards)]
    records = [Manifest(f, {}, False, TASK_STAGES).stages["clean"] for f in folders]
    cleaned = [_task_files(f)[0] for f, r in zip(folders, records) if r["docs_out"]]  # empty parts: no rows
    fps = [_task_files(f)[1] for f in folders]
    m.run("clean", cleaned, [], settings["clean"], lambda: _gathered(records))
    m.run("exact_dedup", cleaned + fps, [fp_path, exact_path], settings["exact_dedup"],
          lambda: exact_stage(dedup.concat([dedup.load_fingerprints(p) for p in fps]), fp_path, exact_path))


def second_pass_parts(m: Manifest, args: argparse.Namespace, settings: dict) -> list[Path] | None:
    """With --two-passes, after the merge's near dedup: the tasks' folders, in shard order, when every
    task has decontaminated (and tokenized) its part of near.jsonl. Otherwise None, printing what to
    run next, when this merge has just deduplicated; a UsageError naming the tasks to rerun when
    dedup was already complete (the second pass ran, or should have)."""
    out_dir, n = m.path.parent, args.num_shards
    missing = _unfinished_second(out_dir, settings, n, args)
    if not missing:
        return [shard_dir(out_dir, k, n) for k in range(n)]
    ids = ",".join(map(str, missing))
    if "near_dedup" in m.skipped:
        raise UsageError(f"--two-passes: shard task(s) {ids} have not decontaminated and tokenized their part of "
                         f"{out_dir / 'near.jsonl'} (not run since the merge's dedup, killed, or run with other "
                         f"flags); run them again with these flags and --shard K (e.g. sbatch --array={ids} "
                         "run/prepare_corpus_array.sbatch ...), then the merge")
    print(f"deduplication complete in {out_dir}; next, the second pass: the shard tasks again with these flags "
          f"(sbatch --array=0-{n - 1} run/prepare_corpus_array.sbatch ...), then this merge again")
    return None


def second_pass_files(folders: list[Path], text_key: str) -> tuple[list[Path], list[Path]]:
    """The tasks' decontaminated parts and their tokenized files (.bin, .idx of each), in shard order."""
    files = [_second_files(f, text_key) for f in folders]
    return [dec for dec, _, _ in files], [p for _, _, tokens in files for p in tokens]


def gathered_decontamination(folders: list[Path]) -> dict:
    """The merge's `decontaminate` record with --two-passes: the tasks' records gathered."""
    return _gathered([Manifest(f, {}, False, TASK_STAGES).stages["decontaminate"] for f in folders])


def gathered_tokens(args: argparse.Namespace, folders: list[Path], shuffled: Path, chars: int) -> dict:
    """The merge's `tokenize` stage with --two-passes: the tasks' tokenized parts, documents put in the
    shuffle's order, into --output-prefix's .bin/.idx, byte for byte what tokenizing `shuffled` writes
    (each document is tokenized alone); its record is the tasks' gathered, `chars` of text in."""
    records = [Manifest(f, {}, False, TASK_STAGES).stages["tokenize"] for f in folders]
    tokenized = [Path(_second_files(f, args.text_key)[1]) for f in folders]
    prefix = f"{args.output_prefix}_{args.text_key}_document"
    recipe_path(prefix).unlink(missing_ok=True)
    order = shuffle_order(sum(r["docs_in"] for r in records), args.shuffle_seed)
    megatron.gather_documents(tokenized, order, Path(prefix))
    spec = megatron.tokenizer_spec(args)
    write_recipe(prefix, shuffled, args.text_key, args.append_eod, spec, megatron.check_eod(spec, args.append_eod))
    return _gathered(records) | {"chars_in": chars, "chars_out": chars}
