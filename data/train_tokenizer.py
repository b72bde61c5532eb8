"""Train a byte-level BPE tokenizer of a given size on any corpus (e.g. Turkish); see --help.

    python data/train_tokenizer.py --input tr_corpus.jsonl --vocab-size 32000 --output-dir tokenizers/tr-bpe

Logic: gpt2forge/preprocess/bpe.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/train_tokenizer.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.bpe import build_parser, train_tokenizer  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    train_tokenizer(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
