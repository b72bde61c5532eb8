"""Drop all but one document of each duplicate group, the seed's command (Megatron-LM's tools/openwebtext):

    python data/remove_group_duplicates.py groups.json clean.json dedup.json

Keeps the first url of each group (the earliest in input order) and every document in no group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/remove_group_duplicates.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.openwebtext_dedup import remove_groups  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="data/remove_group_duplicates.py",
                                     description="Remove grouped duplicates (group_duplicate_url.py) from a corpus.")
    parser.add_argument("groups", help="groups file from group_duplicate_url.py")
    parser.add_argument("data", help="loose-JSON corpus the groups were found in")
    parser.add_argument("output", help="deduplicated loose-JSON corpus to write")
    parser.add_argument("--key", default=None,
                        help="the field naming documents in the groups (default: url, else id, else line:<n>)")
    parser.add_argument("--text-key", default="text", help="the JSON field holding the text (default: text)")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="count and skip malformed lines instead of stopping at the first one")
    parser.add_argument("--overwrite", action="store_true", help="redo the work even if the output exists")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    remove_groups(args.groups, args.data, args.output, text_key=args.text_key, key=args.key,
                  skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
