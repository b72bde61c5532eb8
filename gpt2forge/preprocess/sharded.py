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

Restarts: each task keeps its own manifest (stages `clean`, `fingerprint`), so a rerun task skips
what it finished: a killed task reruns alone, and rerunning the whole array redoes nothing that is
complete. The merge refuses to start while a task is unfinished, naming the tasks to rerun. Every
machine must see <output-dir> and the inputs at the same paths (a shared file system).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess import clean, dedup
from gpt2forge.preprocess.manifest import Manifest, hold_folder
from gpt2forge.preprocess.minhash import MinHashParams
from gpt2forge.preprocess.stages import clean_stage, exact_stage, fingerprints_of, stage_record

TASK_STAGES = ("clean", "fingerprint")


def check_args(shard: int | None, num_shards: int) -> list[str]:
    """The problems of a --shard / --num-shards pair, one line each (empty: none)."""
    if num_shards < 0:
        return [f"--num-shards {num_shards}: must be >= 1 (or 0: one machine)"]
    if shard is not None and not num_shards:
        return [f"--shard {shard}: needs --num-shards N, the number of shard tasks (the job array's size)"]
    if shard is not None and not 0 <= shard < num_shards:
        return [f"--shard {shard}: must be in [0, {num_shards - 1}] for --num-shards {num_shards} "
                f"(Slurm: --array=0-{num_shards - 1}; PBS: -J 0-{num_shards - 1})"]
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
    """A task's stage settings: the one-machine clean settings plus its part, the fingerprints'."""
    return {"clean": settings["clean"] | {"part": part}, "fingerprint": settings["exact_dedup"]}


def _task_files(folder: Path) -> tuple[Path, Path]:
    return folder / "clean.jsonl", folder / "fingerprints.npz"


def _no_fingerprints(params: MinHashParams) -> dedup.Fingerprints:
    """The fingerprints of a task whose part kept no document (no file to read them from)."""
    return dedup.Fingerprints(params, [], [], np.zeros((0, params.num_perm), np.uint32), np.zeros(0, np.uint64),
                              np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))


def run_task(args: argparse.Namespace, inputs: list[Path], settings: dict, clean_cfg: clean.CleanConfig,
             params: MinHashParams) -> Manifest:
    """Shard task `args.shard` of `args.num_shards`: its part cleaned and fingerprinted (or skipped
    where its manifest says so); returns the task's manifest."""
    k, n = args.shard, args.num_shards
    part = parts(inputs, n)[k]
    folder = shard_dir(Path(args.output_dir), k, n)
    folder.mkdir(parents=True, exist_ok=True)
    with hold_folder(folder):
        return _task_stages(args, inputs, _task_settings(settings, part), clean_cfg, params, part, folder)


def _task_stages(args: argparse.Namespace, inputs: list[Path], task: dict, clean_cfg: clean.CleanConfig,
                 params: MinHashParams, part: list[tuple[str, int, int]], folder: Path) -> Manifest:
    k, n = args.shard, args.num_shards
    m = Manifest(folder, {"input": list(map(str, args.input)), "shard": k, "num_shards": n, "stages": task},
                 args.overwrite, TASK_STAGES, may_empty=True)
    clean_path, fp_path = _task_files(folder)
    spans = [(Path(path), (start, end)) for path, start, end in part]
    kept = m.run("clean", inputs, [clean_path], task["clean"], lambda: clean_stage(spans, clean_path, clean_cfg, args))

    def fingerprint() -> dict:
        fp = fingerprints_of(clean_path, params, args) if kept["docs_out"] else _no_fingerprints(params)
        dedup.save_fingerprints(fp, fp_path)
        return stage_record(len(fp), len(fp), kept["chars_out"], kept["chars_out"], {}, {})

    m.run("fingerprint", [clean_path], [fp_path], task["fingerprint"], fingerprint)
    print(f"shard {k} of {n}: complete in {folder}")
    return m


def unfinished(out_dir: Path, inputs: list[Path], settings: dict, num_shards: int) -> list[int]:
    """The tasks whose manifest does not record both stages complete for these inputs and settings."""
    missing = []
    for k, part in enumerate(parts(inputs, num_shards)):
        folder = shard_dir(out_dir, k, num_shards)
        task, (clean_path, fp_path) = _task_settings(settings, part), _task_files(folder)
        m = Manifest(folder, {}, False, TASK_STAGES)
        if not (m.complete("clean", inputs, [clean_path], task["clean"])
                and m.complete("fingerprint", [clean_path], [fp_path], task["fingerprint"])):
            missing.append(k)
    return missing


def _gathered_clean(records: list[dict]) -> dict:
    """The tasks' clean records as the one-machine run's: counts summed, the first examples per rule."""
    removed, examples = Counter(), {}
    for r in records:
        removed.update(r["removed"])
        for rule, texts in r["examples"].items():
            examples.setdefault(rule, []).extend(texts)
    total = {key: sum(r[key] for r in records) for key in ("docs_in", "docs_out", "chars_in", "chars_out")}
    return stage_record(**total, removed=removed, bad_lines=sum(r.get("bad_lines", 0) for r in records),
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
    m.run("clean", cleaned, [], settings["clean"], lambda: _gathered_clean(records))
    m.run("exact_dedup", cleaned + fps, [fp_path, exact_path], settings["exact_dedup"],
          lambda: exact_stage(dedup.concat([dedup.load_fingerprints(p) for p in fps]), fp_path, exact_path))
