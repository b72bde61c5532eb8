"""The whole `prepare_corpus.py` at several corpus sizes: wall time, CPU seconds and peak memory of
each stage, disk used, and what each stage removed scored against the planted truth; then each
stage's growth, fitted through the measured sizes, projected to a target size.

    .venv/bin/python benchmarks/corpus_scale.py --docs 250000 500000 1000000 --work /data/scale \
        --contaminate lambada_test.jsonl --project 8000000 --json scale.json

Each size: benchmarks/web_corpus.py writes the corpus and its truth into `--work` (reused when a
corpus of that size and seed is already there), then `data/prepare_corpus.py` runs in its own
process (clean, language ID, exact and near dedup, decontamination against `--contaminate`,
shuffle, GPT-2 `.bin/.idx`). A sampler reads the process tree every `--interval` seconds from /proc:
CPU seconds (user + system of the process, its live workers and the workers it has reaped) and
memory as PSS (proportional set size: pages shared by forked workers count once in total, not once
per worker; RSS where smaps_rollup is unreadable). A stage ends at the line prepare_corpus.py prints
after it; its CPU seconds are the difference at its two ends, its peak memory the largest sample
between them, its wall time the one the manifest records.

Growth: per stage, CPU seconds as a power of the documents (the exponent b of a least-squares line
through log seconds against log documents: 1 is linear), projected from the largest size; memory and
disk as a line with an intercept (the interpreter and its imports are a fixed cost). Wall time at the
target is the projected CPU seconds over the parallelism each stage showed at the largest size.

Only Linux (/proc). CPU seconds do not change much with other load on the machine, wall time does:
the report prints the 1-minute load before and after each size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import web_corpus  # noqa: E402

STAGE_LINE = re.compile(r"^(clean|exact_dedup|near_dedup|decontaminate|shuffle|tokenize): (kept|complete)")
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    """`pid` and every descendant alive now."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system seconds of `pid` and of the children it has waited for (utime, stime, cutime, cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / TICKS


def memory_bytes(pid: int) -> int:
    """PSS of `pid` (RSS where smaps_rollup cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return 0


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Sampler(threading.Thread):
    """Samples a process tree's CPU seconds, memory and its output folder's size until stopped.
    CPU: the sum over the live tree (each process's own and reaped children's), never lower than
    the last sample (a worker that exits moves its seconds into its parent's reaped count)."""

    def __init__(self, pid: int, folder: Path, interval: float):
        super().__init__(daemon=True)
        self.pid, self.folder, self.interval = pid, folder, interval
        self.cpu, self.peak_memory, self.peak_disk = 0.0, 0, 0
        self.lock, self.done = threading.Lock(), threading.Event()

    def sample(self) -> None:
        pids = tree(self.pid)
        cpu = sum(cpu_seconds(p) for p in pids)
        memory = sum(memory_bytes(p) for p in pids)
        disk = folder_bytes(self.folder) if self.folder.exists() else 0
        with self.lock:
            self.cpu = max(self.cpu, cpu)
            self.peak_memory = max(self.peak_memory, memory)
            self.peak_disk = max(self.peak_disk, disk)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()

    def cut(self) -> tuple[float, int, int]:
        """(CPU seconds so far, peak memory and disk since the last cut); starts the next interval."""
        self.sample()
        with self.lock:
            out = (self.cpu, self.peak_memory, self.peak_disk)
            self.peak_memory = self.peak_disk = 0
        return out


def load1() -> float:
    return os.getloadavg()[0]


def make_corpus(docs: int, work: Path, seed: int, contaminate: list[str]) -> tuple[Path, dict]:
    corpus, truth_path = work / f"web_{docs}_s{seed}.jsonl", work / f"web_{docs}_s{seed}.truth.json"
    if not (corpus.is_file() and truth_path.is_file()):
        start = time.perf_counter()
        web_corpus.write_corpus(docs, corpus, truth_path, seed, contaminate)
        print(f"  wrote {corpus.name} ({corpus.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
              flush=True)
    return corpus, json.loads(truth_path.read_text())


def run_size(docs: int, args: argparse.Namespace) -> dict:
    work = Path(args.work)
    corpus, truth = make_corpus(docs, work, args.seed, args.contaminate)
    out = work / f"out_{docs}_s{args.seed}"
    cmd = [sys.executable, str(ROOT / "data" / "prepare_corpus.py"), "--input", str(corpus), "--output-dir", str(out),
           "--eval-files", *args.contaminate, "--output-prefix", str(out / "corpus"), "--append-eod",
           "--workers", str(args.workers), "--overwrite", *args.prepare_flags.split()]
    before = load1()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
    sampler = Sampler(proc.pid, out, args.interval)
    sampler.start()
    stages, last_cpu = {}, 0.0
    for line in proc.stdout:
        m = STAGE_LINE.match(line)
        if not m:
            continue
        cpu, memory, disk = sampler.cut()
        stages[m.group(1)] = {"cpu_seconds": round(cpu - last_cpu, 2), "peak_memory_mb": round(memory / 2**20),
                              "peak_disk_gb": round(disk / 1e9, 3)}
        print(f"  {line.rstrip()}  [CPU {cpu - last_cpu:.0f} s, peak {memory / 2**20:.0f} MB]", flush=True)
        last_cpu = cpu
    code = proc.wait()
    sampler.done.set()
    wall = time.perf_counter() - start
    if code:
        raise SystemExit(f"error: prepare_corpus.py exited {code} at {docs} documents: rerun `{' '.join(cmd)}` "
                         "to see why")
    manifest = json.loads((out / "manifest.json").read_text())
    for name, record in manifest["stages"].items():
        stages[name].update(wall_seconds=record["seconds"], docs_in=record["docs_in"], docs_out=record["docs_out"],
                            removed=record["removed"])
    scored = web_corpus.account(truth, web_corpus.stage_removals(corpus, out))
    return {"docs": docs, "corpus_gb": round(corpus.stat().st_size / 1e9, 3), "wall_seconds": round(wall, 1),
            "cpu_seconds": round(sum(s["cpu_seconds"] for s in stages.values()), 1),
            "peak_memory_mb": max(s["peak_memory_mb"] for s in stages.values()),
            "disk_gb": round(folder_bytes(out) / 1e9, 3), "load_before": before, "load_after": load1(),
            "stages": stages, "scored": scored}


def power_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(b, log a) of y = a x^b by least squares on the logs."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)
    return b, my - b * mx


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) by least squares."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def project(runs: list[dict], target: int) -> dict:
    """Per stage: the CPU exponent, and CPU seconds, wall seconds and peak memory at `target` documents."""
    docs = [r["docs"] for r in runs]
    largest = max(runs, key=lambda r: r["docs"])
    out = {}
    for name in largest["stages"]:
        cpu = [r["stages"][name]["cpu_seconds"] for r in runs]
        memory = [r["stages"][name]["peak_memory_mb"] for r in runs]
        b, _ = power_fit(docs, cpu)
        cpu_at = largest["stages"][name]["cpu_seconds"] * (target / largest["docs"]) ** b
        parallel = largest["stages"][name]["cpu_seconds"] / max(largest["stages"][name]["wall_seconds"], 1e-9)
        slope, intercept = line_fit(docs, memory)
        out[name] = {"cpu_exponent": round(b, 3), "cpu_seconds": round(cpu_at), "parallelism": round(parallel, 2),
                     "wall_seconds": round(cpu_at / max(parallel, 1e-9)),
                     "peak_memory_mb": round(intercept + slope * target),
                     "memory_mb_per_million_docs": round(slope * 1e6)}
    slope, intercept = line_fit(docs, [r["disk_gb"] for r in runs])
    return {"docs": target, "stages": out, "wall_seconds": sum(s["wall_seconds"] for s in out.values()),
            "peak_memory_mb": max(s["peak_memory_mb"] for s in out.values()),
            "disk_gb": round(intercept + slope * target, 1)}


def print_run(r: dict) -> None:
    print(f"{r['docs']:,} documents ({r['corpus_gb']} GB): wall {r['wall_seconds']:.0f} s, "
          f"CPU {r['cpu_seconds']:.0f} s, peak {r['peak_memory_mb']} MB, disk {r['disk_gb']} GB; "
          f"1-minute load {r['load_before']:.2f} before, {r['load_after']:.2f} after")
    print(f"  {'stage':<14}{'docs in':>10}{'out':>10}{'wall s':>9}{'CPU s':>9}{'docs/CPU s':>12}{'peak MB':>9}")
    for name, s in r["stages"].items():
        print(f"  {name:<14}{s['docs_in']:>10,}{s['docs_out']:>10,}{s['wall_seconds']:>9.1f}{s['cpu_seconds']:>9.1f}"
              f"{s['docs_in'] / max(s['cpu_seconds'], 1e-9):>12,.0f}{s['peak_memory_mb']:>9}")
    for name, s in r["scored"].items():
        extra = ""
        if "recall_by_jaccard" in s:
            extra = "; recall by Jaccard " + ", ".join(f"{k}: {v:.3f}" for k, v in s["recall_by_jaccard"].items())
        print(f"  {name}: removed {s['removed']:,}, planted {s['expected']:,}, recall {s['recall']:.4f}, "
              f"precision {s['precision']:.4f}{extra}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--docs", type=int, nargs="+", required=True, help="corpus sizes, in documents")
    p.add_argument("--work", required=True, help="folder for the corpora and the runs (several times the corpus)")
    p.add_argument("--contaminate", nargs="*", default=[],
                   help="evaluation files planted in the corpus and decontaminated against")
    p.add_argument("--seed", type=int, default=0, help="the corpus generator's seed")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="prepare_corpus.py --workers")
    p.add_argument("--prepare-flags", default="", help="more prepare_corpus.py flags, e.g. '--quality'")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--project", type=int, default=8_000_000, help="documents to project to")
    p.add_argument("--runs", nargs="*", default=[],
                   help="earlier --json files whose runs join the fit (same code and flags: check their commits)")
    p.add_argument("--json", default=None, help="write every run and the projection here")
    args = p.parse_args(argv)
    missing = [f for f in args.contaminate if not Path(f).is_file()]
    if missing:
        p.error(f"--contaminate: no such file: {', '.join(missing)}")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    runs = [r for path in args.runs for r in json.loads(Path(path).read_text())["runs"]]
    for docs in args.docs:
        print(f"{docs:,} documents:", flush=True)
        runs.append(run_size(docs, args) | {"commit": commit})
        print_run(runs[-1])
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs}, indent=1))
    result = {"runs": runs}
    if len({r["docs"] for r in runs}) >= 2:
        result["projection"] = proj = project(runs, args.project)
        print(f"projected to {args.project:,} documents: wall {proj['wall_seconds'] / 60:.0f} min, peak "
              f"{proj['peak_memory_mb']} MB, disk {proj['disk_gb']} GB")
        for name, s in proj["stages"].items():
            print(f"  {name:<14}CPU ~ docs^{s['cpu_exponent']:.2f}: {s['cpu_seconds']:,} CPU s, x{s['parallelism']} "
                  f"parallel -> {s['wall_seconds']:,} s; peak {s['peak_memory_mb']} MB "
                  f"({s['memory_mb_per_million_docs']} MB per million documents)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
