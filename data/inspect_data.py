"""Summarise a data file: documents, tokens, dtype, vocabulary range, a decoded sample (see --help).

    python data/inspect_data.py my-gpt2_text_document          # Megatron prefix
    python data/inspect_data.py corpus.pkl
    python data/inspect_data.py tfrecords/data_0.tfrecord

Logic: gpt2forge/preprocess/describe.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/inspect_data.py` from a plain checkout (no pip install needed).
# (Not named inspect.py: a script's folder comes first on sys.path, so data/inspect.py would
# shadow the standard library's `inspect` for every script in data/.)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.describe import build_parser, inspect_main  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    inspect_main(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
