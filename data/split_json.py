"""Split loose JSON into fixed train / dev / test files: Megatron-LM's `scripts/split_json.py` (seed 001).

    python data/split_json.py --input_files corpus1.json corpus2.json --output_dir splits/ --test_percent 0.05 0.01
    python pretrain_gpt2.py ... --train-data splits/train.json --valid-data splits/dev.json \
        --test-data splits/test.json

writes splits/{train,dev,test}.json and a .map beside each (input file index, line number). Logic:
gpt2forge/preprocess/splits.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/split_json.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import UsageError, cli_main  # noqa: E402
from gpt2forge.preprocess.splits import SPLIT_FILES, split_json  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Resplit loose JSON data into train/dev/test files (lines shuffled "
                                            "with --seed, then cut: dev and test rounded up, train the rest).")
    p.add_argument("--input_files", "--input-files", nargs="+", required=True, help="loose JSON files, in order")
    p.add_argument("--output_dir", "--output-dir", required=True,
                   help="folder for train.json, dev.json, test.json and their .map files (created)")
    p.add_argument("--test_percent", "--test-percent", type=float, nargs="+", default=[0.05, 0.0],
                   help="fractions of all lines for dev, then test (default: 0.05 0)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the shuffle (Megatron's was unseeded)")
    p.add_argument("--overwrite", action="store_true", help="redo the split even when the outputs exist")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.test_percent) > 2:
        raise UsageError(f"--test_percent takes the dev and the test fraction (got {len(args.test_percent)} values)")
    dev, test = (*args.test_percent, 0.0)[:2]
    out = Path(args.output_dir)
    if all((out / name).is_file() for name in SPLIT_FILES) and not args.overwrite:
        print(f"{out}: {', '.join(SPLIT_FILES)} exist (written atomically, so complete); skipping "
              "(pass --overwrite to redo)")
        return 0
    counts = split_json(args.input_files, out, dev, test, args.seed)
    print(", ".join(f"{name}: {n} lines" for name, n in zip(SPLIT_FILES, counts)) + f" in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
