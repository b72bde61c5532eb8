#!/usr/bin/env python3
"""Pretrain GPT with Megatron-LM / Megatron-DeepSpeed's `pretrain_gpt.py` flags (gpt2forge's trainer). See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2forge.cli import megatron_main, run_script  # noqa: E402

if __name__ == "__main__":
    run_script(megatron_main)
