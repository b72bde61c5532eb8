#!/usr/bin/env python3
"""Generate text from a GPT-2 checkpoint (ours or a Hugging Face GPT-2 directory). See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2forge.cli import generate_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(generate_main())
