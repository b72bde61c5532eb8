#!/usr/bin/env python3
"""Pretrain GPT-2 (the Graphcore GPT-2 application's flags, on CPUs and CUDA GPUs). See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2forge.cli import run_script, train_main  # noqa: E402

if __name__ == "__main__":
    run_script(train_main)
