#!/usr/bin/env python3
"""Train GPT-2 with Hugging Face run_clm_no_trainer.py's flags (gpt2forge's trainer). See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2forge.cli import clm_main, run_script  # noqa: E402

if __name__ == "__main__":
    run_script(clm_main)
