"""--dataset jsonl's first-run tokenization throughput against preprocess_data.py, and a later run's start.

    .venv/bin/python benchmarks/rawtext_tokenize.py                 # 100 MB corpus, 1 worker and all cores
    .venv/bin/python benchmarks/rawtext_tokenize.py --size-mb 2     # quick variant

Same generated corpus (benchmarks/preprocess_throughput.py's: made-up documents, no download), same GPT-2
BPE, same number of worker processes, each tool in its own fresh process:
- preprocess_data.py: `--append-eod --workers W`, its own summary line's seconds (from after the tokenizer
  is loaded: pool start-up, reading, tokenizing, writing);
- the jsonl cache: `rawtext.write_build(..., workers=W)`, its own log line's seconds (the same span).
Reported per tool and W: documents/s and MB/s, and both divided by W (per core); the target is equal
per core. Then the whole first `rawtext.load` (hashing the inputs, building, index maps) and a second
process's `rawtext.load` on the unchanged input (target: under a second; interpreter and import time
excluded, as a run pays them whatever the data).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from preprocess_throughput import make_corpus, word_pool  # noqa: E402

CHILD = """
import sys, time
from pathlib import Path
from gpt2forge.data import DataRequest, rawtext
from gpt2forge.data.args import DataArgs
src, cache, workers, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
req = DataRequest(DataArgs(dataset="jsonl", input_files=[src], data_cache_dir=cache), 1024, 50257)
t0 = time.perf_counter()
if mode == "build":
    rawtext.write_build(Path(cache) / "bench", [Path(src)], "jsonl", req, workers=workers)
else:
    rawtext.load(req)
print(f"load seconds: {time.perf_counter() - t0:.4f}")
"""


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def preprocess_data(src: Path, out: Path, workers: int) -> float:
    """Seconds preprocess_data.py reports for tokenizing `src` on `workers` processes."""
    text = run([sys.executable, "data/preprocess_data.py", "--input", str(src), "--output-prefix", str(out),
                "--append-eod", "--workers", str(workers), "--overwrite"])
    return float(re.search(r"seconds: ([\d.]+)", text)[1])


def jsonl_cache(src: Path, cache: Path, workers: int, mode: str) -> tuple[float, str]:
    """(seconds, log) of the jsonl cache: `build` (write_build's own timer) or `load` (the whole call)."""
    text = run([sys.executable, "-c", CHILD, str(src), str(cache), str(workers), mode])
    if mode == "build":
        return float(re.search(r"tokens in ([\d.]+) s", text)[1]), text
    return float(re.search(r"load seconds: ([\d.]+)", text)[1]), text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=100, help="corpus size (default: 100)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="workers of the all-cores runs (default: all cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    res: dict = {"size_mb": args.size_mb, "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="gpt2forge-bench-") as tmp:
        tmp = Path(tmp)
        src = tmp / "corpus.jsonl"
        docs = make_corpus(src, args.size_mb, word_pool())
        mb = src.stat().st_size / 1e6
        print(f"corpus: {mb:.1f} MB, {docs} documents")
        for workers in sorted({1, args.workers}):
            ref = preprocess_data(src, tmp / f"ref{workers}", workers)
            ours, _ = jsonl_cache(src, tmp / f"cache{workers}", workers, "build")
            for name, secs in (("preprocess_data", ref), ("jsonl_cache", ours)):
                row = {"seconds": secs, "docs_per_s": docs / secs, "mb_per_s": mb / secs,
                       "docs_per_s_per_core": docs / secs / workers, "mb_per_s_per_core": mb / secs / workers}
                res[f"{name}_{workers}w"] = {k: round(v, 3) for k, v in row.items()}
                print(f"{name:16s} {workers:2d} worker(s): {row['docs_per_s']:10,.0f} docs/s "
                      f"{row['mb_per_s']:7.2f} MB/s  per core: "
                      f"{row['docs_per_s_per_core']:9,.0f} docs/s {row['mb_per_s_per_core']:6.2f} MB/s")
            res[f"per_core_ratio_{workers}w"] = round(ref / ours, 3)
            print(f"jsonl cache / preprocess_data per core, {workers} worker(s): {ref / ours:.2f}x")
        cache = tmp / "cache"
        first, log = jsonl_cache(src, cache, args.workers, "load")
        assert "tokenizing" in log, log
        second, log = jsonl_cache(src, cache, args.workers, "load")
        assert "reusing the tokenized cache" in log, log
        res.update(first_load_seconds=round(first, 3), second_load_seconds=round(second, 4))
        print(f"rawtext.load: first run {first:.2f} s (hash, tokenize, index maps); "
              f"second run {second:.3f} s (unchanged input: reused)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
