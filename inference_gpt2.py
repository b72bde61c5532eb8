#!/usr/bin/env python3
"""Forward-pass throughput/latency benchmark on generated data (the reference's inference_gpt2.py).
Takes the training flags; see --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2forge.cli import inference_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(inference_main())
