"""preprocess_data.py throughput (tokens/s) and peak memory vs the plain Hugging Face baseline.

    .venv/bin/python benchmarks/preprocess_throughput.py                  # 100 MB corpus
    .venv/bin/python benchmarks/preprocess_throughput.py --size-mb 8      # quick variant

Same run, same corpus, same GPT-2 BPE:
- baseline: `transformers.GPT2TokenizerFast` loaded from the folder holding
  gpt2forge/assets/vocab.json + merges.txt (local files only, never the hub), one document at a time,
  one process, reading the same JSON lines
  (`--baseline-mb` of them: a rate, measured on the corpus's first MB);
- ours: `data/preprocess_data.py --append-eod --workers 1` and `--workers <all cores>`, as
  subprocesses, tokens/s from their summary line (it includes pool start-up, reading and writing).
Peak memory is the largest sum of PSS (proportional RSS: shared pages split between the
processes sharing them) over the tool's process tree (parent + workers), sampled
every 50 ms from /proc, for the all-workers run at the full size and at a quarter of it: bounded
memory means both are about the same.

The corpus is generated (no download): words drawn from the stdlib-docstring corpus
(gpt2forge.text.corpus) with their natural frequencies, plus 200,000 random made-up words drawn 5% of
the time, so documents are all different and a word cache cannot memorise the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpt2forge.text.corpus import build_documents  # noqa: E402
from gpt2forge.text.vocab import asset_dir  # noqa: E402


def word_pool(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(words, cumulative probabilities): stdlib-docstring words with their natural frequencies,
    plus 200,000 made-up words holding 5% of the mass (more distinct words than a BPE cache holds)."""
    words = re.findall(r"\S+", " ".join(build_documents()))
    vocab, counts = np.unique(np.array(words), return_counts=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 12, size=200_000)
    letters = rng.integers(ord("a"), ord("z") + 1, size=int(lengths.sum())).astype(np.uint8)
    made_up = [w.decode() for w in np.split(letters, np.cumsum(lengths)[:-1]) for w in [w.tobytes()]]
    probs = np.concatenate([0.95 * counts / counts.sum(), np.full(len(made_up), 0.05 / len(made_up))])
    return np.concatenate([vocab.astype(object), np.array(made_up, dtype=object)]), np.cumsum(probs)


def make_corpus(path: Path, size_mb: float, pool: tuple[np.ndarray, np.ndarray], seed: int = 0) -> int:
    """Write ~size_mb MB of loose JSON documents (200-2000 words) to `path`; returns documents."""
    words, cdf = pool
    rng = np.random.default_rng(seed)
    target, written, docs = int(size_mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            n = int(rng.integers(200, 2000))
            doc = words[np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1]), len(words) - 1)]
            text = " ".join(doc.tolist()).replace(". ", ".\n\n", 1 + n // 80)  # paragraphs
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def baseline(path: Path, max_mb: float) -> tuple[int, float]:
    """GPT2TokenizerFast, one document at a time, one process: (tokens, seconds)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, as the plain way runs
    from transformers import GPT2TokenizerFast

    # The folder holds vocab.json + merges.txt; local_files_only: never the hub.
    tok = GPT2TokenizerFast.from_pretrained(str(asset_dir()), local_files_only=True)
    assert tok.encode("Hello world") == [15496, 995], "baseline tokenizer is not GPT-2's"
    eod, tokens, read = tok.eos_token_id, 0, 0
    start = time.perf_counter()
    with open(path, "rb") as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"]) + [eod]
            tokens += len(ids)
            read += len(line)
            if read >= max_mb * 1e6:
                break
    return tokens, time.perf_counter() - start


def _tree_rss(root: int) -> int:
    """Sum of PSS (bytes) of `root` and its descendants."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    total = 0
    for pid in tree:
        try:
            # PSS, not RSS: forked workers share the parent's pages, and RSS would count them
            # once per process.
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            continue
    return total


def ours(path: Path, workers: int, out_dir: Path) -> dict:
    """Run data/preprocess_data.py; returns tokens, seconds, tokens/s and peak tree RSS (bytes)."""
    cmd = [sys.executable, str(REPO / "data/preprocess_data.py"), "--input", str(path),
           "--output-prefix", str(out_dir / f"w{workers}"), "--append-eod",
           "--workers", str(workers), "--overwrite"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    m = re.search(r"tokens: (\d+), seconds: ([\d.]+), tokens/s: (\d+)", out)
    return {"tokens": int(m[1]), "seconds": float(m[2]), "tokens_per_s": int(m[3]), "peak_rss": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=100, help="corpus size (default: 100)")
    parser.add_argument("--baseline-mb", type=float, default=20,
                        help="MB of the corpus the baseline tokenizes (a rate; default: 20)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="workers of the all-cores run (default: all cores)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpt2forge-bench-") as tmp:
        tmp = Path(tmp)
        big, small = tmp / "big.jsonl", tmp / "small.jsonl"
        t0 = time.perf_counter()
        pool = word_pool()
        make_corpus(big, args.size_mb, pool)
        make_corpus(small, args.size_mb / 4, pool, seed=1)
        print(f"corpus: {big.stat().st_size / 1e6:.1f} MB and {small.stat().st_size / 1e6:.1f} MB "
              f"generated in {time.perf_counter() - t0:.1f}s")
        b_tokens, b_secs = baseline(big, min(args.baseline_mb, args.size_mb))
        base = b_tokens / b_secs
        one = ours(big, 1, tmp)
        many = ours(big, args.workers, tmp)
        many_small = ours(small, args.workers, tmp)
    res = {
        "baseline_tokens_per_s": round(base), "ours_1_worker_tokens_per_s": one["tokens_per_s"],
        f"ours_{args.workers}_workers_tokens_per_s": many["tokens_per_s"],
        "per_core_speedup": round(one["tokens_per_s"] / base, 2),
        "scaling_efficiency": round(many["tokens_per_s"] / one["tokens_per_s"] / args.workers, 2),
        "peak_rss_mb_full": round(many["peak_rss"] / 2**20), "peak_rss_mb_quarter":
            round(many_small["peak_rss"] / 2**20), "peak_rss_mb_1_worker": round(one["peak_rss"] / 2**20),
        "size_mb": args.size_mb, "cpu_count": os.cpu_count(),
    }
    print(f"baseline GPT2TokenizerFast, 1 doc at a time: {base:,.0f} tokens/s ({b_tokens} tokens)")
    print(f"ours, 1 worker: {one['tokens_per_s']:,} tokens/s  ({res['per_core_speedup']}x baseline "
          f"per core)")
    print(f"ours, {args.workers} workers: {many['tokens_per_s']:,} tokens/s  (scaling efficiency "
          f"{res['scaling_efficiency']})")
    print(f"peak RSS (parent + workers), {args.workers} workers: {res['peak_rss_mb_full']} MB at "
          f"{args.size_mb} MB, {res['peak_rss_mb_quarter']} MB at {args.size_mb / 4} MB; "
          f"1 worker: {res['peak_rss_mb_1_worker']} MB")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
