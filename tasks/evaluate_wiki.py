#!/usr/bin/env python3
"""WikiText perplexity with overlapping windows (Megatron-LM protocol). See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.evaluation.cli import wiki_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(wiki_main())
