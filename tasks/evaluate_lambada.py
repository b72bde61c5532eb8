#!/usr/bin/env python3
"""LAMBADA cloze accuracy, non-strict or --strict-lambada (Megatron-LM protocol). See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.evaluation.cli import lambada_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(lambada_main())
