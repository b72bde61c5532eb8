"""Pickle or Megatron mmap -> TFRecord shards (feature input_ids) + tfrecord2idx .index files (see --help).

    python data/write_into_tfrecord.py --input-file-path corpus.pkl --output-file-path tfrecords/

Logic: gpt2forge/preprocess/tfrecord_writer.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/write_into_tfrecord.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.tfrecord_writer import build_parser, write_into_tfrecord  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    write_into_tfrecord(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
