"""MinHash fingerprints per document, one core: numpy against the custom op, on each instruction-set path.

    .venv/bin/python benchmarks/minhash_speed.py                   # 2,000 documents, 5 rounds, ~1 min
    .venv/bin/python benchmarks/minhash_speed.py --docs 500 --rounds 3

The documents are benchmarks/web_corpus.py's (seed 0, web text's length distribution). Two arms,
alternating within each round, CPU time of this process (one thread):
- numpy: what fingerprinting did before the op, `MinHasher.signature` on each document's unique
  shingle hashes (`shingle_hashes`: normalize, hash, sort);
- op: `MinHasher.signatures` on each document's shingle hashes with repeats (normalize, hash) in
  one call of `gpt2forge::minhash_signatures`.
Both include the shingle hashing, so the figure is what a document's signature costs. The op runs
once per instruction-set path this CPU has (GPT2FORGE_OPS_ISA, a child process each); every path's
signatures are checked equal to numpy's before it is timed. Prints one line per path: median CPU
ms per document of each arm over the rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def texts(docs: int) -> list[str]:
    import web_corpus  # benchmarks/web_corpus.py, beside this file

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "web.jsonl"
        web_corpus.write_corpus(docs, corpus, Path(tmp) / "truth.json")
        return [json.loads(line)["text"] for line in corpus.open()]


def child(docs: int, rounds: int) -> dict:
    import numpy as np

    from gpt2forge.ops.library import has_op, ops_isa
    from gpt2forge.preprocess.minhash import MinHasher, MinHashParams

    if not has_op("minhash_signatures"):
        raise SystemExit("minhash_speed.py: the custom ops library is not built; run `make custom_ops`")
    corpus = texts(docs)
    hasher = MinHasher(MinHashParams())

    def numpy_arm():
        return np.stack([hasher.signature(hasher.shingles(t)) for t in corpus])

    def op_arm():
        return hasher.signatures([hasher.all_shingles(t) for t in corpus])

    if not np.array_equal(numpy_arm(), op_arm()):
        raise SystemExit(f"minhash_speed.py: the {ops_isa()} path's signatures differ from numpy's")
    times = {"numpy": [], "op": []}
    for _ in range(rounds):
        for name, arm in (("numpy", numpy_arm), ("op", op_arm)):
            start = time.process_time()
            arm()
            times[name].append((time.process_time() - start) / len(corpus) * 1e3)
    return {"path": ops_isa(), **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.docs, args.rounds)))
        return

    from gpt2forge.ops.library import ISA_ENV, ISA_PATHS

    print(f"{args.docs} documents, {args.rounds} rounds, CPU ms per document (median), one thread")
    for path in ISA_PATHS:
        env = {**os.environ, ISA_ENV: path, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, __file__, "--child", "--docs", str(args.docs), "--rounds",
                              str(args.rounds)], env=env, capture_output=True, text=True)
        if run.returncode:
            print(f"  {path:7}: not run here ({run.stderr.strip().splitlines()[-1] if run.stderr else run.returncode})")
            continue
        r = json.loads(run.stdout.splitlines()[-1])
        print(f"  {r['path']:7}: numpy {r['numpy']:.3f}, op {r['op']:.3f}: {r['numpy'] / r['op']:.2f}x")


if __name__ == "__main__":
    main()
