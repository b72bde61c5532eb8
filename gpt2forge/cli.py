"""Console entry points (also behind the top-level scripts)."""

from __future__ import annotations

from typing import Sequence

from .errors import cli_main


@cli_main
def train_main(argv: Sequence[str] | None = None) -> int:
    """`train_gpt2.py` / `gpt2forge-train`."""
    from .arguments import parse_args
    from .trainer import run_training

    return run_training(parse_args(argv))
