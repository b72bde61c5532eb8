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


def generate_parser():
    """The `text_generate_gpt2.py` parser (gpt2forge.textgen)."""
    from .textgen import build_parser

    return build_parser()


@cli_main
def generate_main(argv: Sequence[str] | None = None) -> int:
    """`text_generate_gpt2.py` / `gpt2forge-generate`: KV-cache text generation."""
    from .textgen import run_generate

    return run_generate(argv)


@cli_main
def inference_main(argv: Sequence[str] | None = None) -> int:
    """`inference_gpt2.py`: forward-pass throughput on generated data (the training flags)."""
    from .inference import run_inference

    return run_inference(argv)
