"""Extracted Wikipedia -> .pkl of token-id lists, one EOS per article (see --help).

    python3 ./data/wikipedia_preprocess.py --input-file-path <extracted-folder> \
        --output-file-path <out-folder> [--use-bpe]

Logic: gpt2forge/preprocess/wikipedia.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/wikipedia_preprocess.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.wikipedia import build_parser, wikipedia_preprocess  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    wikipedia_preprocess(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
