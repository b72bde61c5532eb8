"""Merge several Megatron indexed datasets (same tokenizer) into one (see --help).

    python data/merge_preprocessed_data.py --datasets p1_text_document p2_text_document \
        --output-prefix merged_text_document

Logic: gpt2forge/preprocess/megatron.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/merge_preprocessed_data.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.megatron import merge, merge_parser  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    merge(merge_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
