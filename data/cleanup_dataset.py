"""ftfy, keep one language, drop short documents: the seed's Megatron cleanup step.

    python data/cleanup_dataset.py raw.json clean.json              # English, >= 128 GPT-2 tokens
    python data/cleanup_dataset.py raw.json clean.json --lang tr --workers 8 --quality

Loose JSON in and out ({"text": ..., "url": ...} per line). Logic: gpt2forge/preprocess/clean.py;
guide: docs/corpus.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/cleanup_dataset.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.clean import add_arguments, run_clean  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Clean a loose-JSON corpus: ftfy fix_text, language ID (lid.176, no download), minimum "
                    "length, optional quality rules. Memory: a few chunks of text, flat in corpus size.")
    parser.add_argument("input", help="loose JSON, one {\"text\": ...} object per line")
    parser.add_argument("output", help="cleaned loose JSON (written atomically)")
    add_arguments(parser)
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_clean(args.input, args.output, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
