#!/usr/bin/env python3
"""Megatron-LM's `scripts/run_gpt2_eval.py` command line: WikiText, LAMBADA (--cloze-eval) or corpus
perplexity (--webtext-eval), run by evaluate_wiki.py / evaluate_lambada.py. See --help."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.evaluation.cli import run_gpt2_eval_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_gpt2_eval_main())
