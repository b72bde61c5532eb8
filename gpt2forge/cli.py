"""Console entry points (also behind the top-level scripts)."""

from __future__ import annotations

from collections.abc import Sequence

from gpt2forge.core.errors import cli_main


@cli_main
def train_main(argv: Sequence[str] | None = None) -> int:
    """`train_gpt2.py` / `gpt2forge-train`."""
    from gpt2forge.train.args import parse_args  # lazy: a console script imports only its own command
    from gpt2forge.train.trainer import run_training  # lazy: a console script imports only its own command

    return run_training(parse_args(argv))


def generate_parser():
    """The `text_generate_gpt2.py` parser (gpt2forge.generate.cli)."""
    from gpt2forge.generate.cli import build_parser  # lazy: a console script imports only its own command

    return build_parser()


@cli_main
def generate_main(argv: Sequence[str] | None = None) -> int:
    """`text_generate_gpt2.py` / `gpt2forge-generate`: KV-cache text generation."""
    from gpt2forge.generate.cli import run_generate  # lazy: a console script imports only its own command

    return run_generate(argv)


@cli_main
def inference_main(argv: Sequence[str] | None = None) -> int:
    """`inference_gpt2.py`: forward-pass throughput on generated data (the training flags)."""
    from gpt2forge.tools.throughput import run_inference  # lazy: a console script imports only its own command

    return run_inference(argv)
