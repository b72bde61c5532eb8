"""Megatron-DeepSpeed's `tools/preprocess_data_many_cores.py` name (seed 000): the same command as
`data/preprocess_data.py`, whose `--workers N` already tokenizes on N cores (see --help).

    python data/preprocess_data_many_cores.py --input my-corpus.json --output-prefix my-gpt2 \
        --vocab gpt2-vocab.json --dataset-impl mmap --tokenizer-type GPT2BPETokenizer \
        --merge-file gpt2-merges.txt --append-eod --workers 60
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/preprocess_data_many_cores.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.megatron import build_parser, preprocess_data  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    preprocess_data(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
