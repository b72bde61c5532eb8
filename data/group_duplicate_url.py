"""Group duplicate pairs into sets, the seed's command (Megatron-LM's tools/openwebtext):

    python data/group_duplicate_url.py pairs.json groups.json [threshold=0.7]

Pairs at or above the threshold are joined (union-find); each group is written as {"i": [urls]},
its earliest document (input order) first: remove_group_duplicates.py keeps that one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/group_duplicate_url.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.openwebtext_dedup import group_pairs  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="data/group_duplicate_url.py",
                                     description="Union duplicate pairs (find_duplicates.py) into groups.")
    parser.add_argument("pairs", help="pairs file from find_duplicates.py --output")
    parser.add_argument("groups", help='groups file to write, {"i": [urls]} per line')
    parser.add_argument("threshold", nargs="?", type=float, default=0.7,
                        help="join pairs with similarity at or above this (default 0.7, the seed's)")
    parser.add_argument("--overwrite", action="store_true", help="redo the work even if the output exists")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    group_pairs(args.pairs, args.groups, args.threshold, overwrite=args.overwrite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
