"""Long fuzz runs: `make fuzz N=100000` (cases spread over the formats) or one case by its seed.

    python tests/fuzz/run.py --cases 100000
    python tests/fuzz/run.py --format megatron --seed 1234      # reproduce one failure

Prints the cases tried and the failures per format, each failure with the seed that reproduces it;
exits 1 when any case failed.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from formats import FORMATS, pristine_files, run_case  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1000, help="total cases, spread evenly over the formats")
    p.add_argument("--format", choices=sorted(FORMATS), action="append", help="only these formats")
    p.add_argument("--seed", type=int, default=None, help="run this one seed (with --format)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds start here")
    args = p.parse_args()
    names = args.format or sorted(FORMATS)
    per_format = max(1, args.cases // len(names))
    failed = 0
    for name in names:
        fmt = FORMATS[name]
        with tempfile.TemporaryDirectory() as tmp:
            pristine = pristine_files(fmt, Path(tmp) / "valid")
            seeds = [args.seed] if args.seed is not None else range(args.first_seed, args.first_seed + per_format)
            t0, bad = time.perf_counter(), []
            for seed in seeds:
                problem = run_case(fmt, seed, Path(tmp) / "case", pristine)
                if problem:
                    bad.append((seed, problem))
                    print(f"FAIL {name} seed {seed}: {problem}", flush=True)
            print(f"{name:<13} {len(seeds):>7} cases, {len(bad)} failures, {time.perf_counter() - t0:.1f} s",
                  flush=True)
            failed += len(bad)
    print(f"total: {failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
