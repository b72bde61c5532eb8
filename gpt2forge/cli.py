"""Console entry points (also behind the top-level scripts)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gpt2forge.core.errors import RunError, UsageError, cli_main

if TYPE_CHECKING:  # the annotation only: a console script imports only its own command
    from gpt2forge.frontends.flag_table import FrontEnd


@cli_main
def train_main(argv: Sequence[str] | None = None) -> int:
    """`train_gpt2.py` / `gpt2forge-train`."""
    from gpt2forge.frontends.graphcore import parse_args  # lazy: a console script imports only its own command
    from gpt2forge.train.trainer import run_training  # lazy: a console script imports only its own command

    return run_training(parse_args(argv))


@cli_main
def megatron_main(argv: Sequence[str] | None = None) -> int:
    """`pretrain_gpt.py` / `pretrain_gpt2.py` / `gpt2forge-pretrain-gpt`: Megatron-LM's flags, the same trainer."""
    from gpt2forge.frontends import megatron  # lazy: a console script imports only its own command

    return _foreign_main(argv, megatron.translate, megatron.FRONT_END)


@cli_main
def clm_main(argv: Sequence[str] | None = None) -> int:
    """`train_clm.py` / `gpt2forge-train-clm`: Hugging Face run_clm_no_trainer.py's flags, the same trainer."""
    from gpt2forge.frontends import run_clm  # lazy: a console script imports only its own command

    return _foreign_main(argv, run_clm.translate, run_clm.FRONT_END)


def _foreign_main(argv: Sequence[str] | None, translate: Callable[[Sequence[str]], dict],
                  front_end: FrontEnd) -> int:
    """Another tool's flags -> TrainConfig -> the one trainer (or, with --print-equivalent, its
    train_gpt2.py command line). Its errors name the tool's flags, not train_gpt2.py's
    (`flag_table.in_own_words`)."""
    import shlex  # lazy, as the imports below

    from gpt2forge.frontends.flag_table import equivalent_command, in_own_words, wants_equivalent  # lazy: as above
    from gpt2forge.train.config import TrainConfig  # lazy: a console script imports only its own command
    from gpt2forge.train.trainer import run_training  # lazy: a console script imports only its own command

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        values = translate(argv)
        if wants_equivalent(argv):
            print("python train_gpt2.py " + shlex.join(equivalent_command(values)))
            return 0
        return run_training(TrainConfig.from_flat(values))
    except (UsageError, RunError) as exc:
        raise type(exc)(in_own_words(str(exc), front_end.own_words(argv))) from None


def run_script(main: Callable[[], int]) -> None:
    """Exit with `main()`'s code: what the training scripts at the top of the repository do."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun the job is done here (process group destroyed, files closed), but in 5 of
        # 90 two-process CPU test runs a rank aborted during interpreter teardown ("terminate
        # called without an active exception", no Python frame), so torchrun reported a finished
        # run as failed. Leave without the teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


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
    from gpt2forge.tools.inference import run_inference  # lazy: a console script imports only its own command

    return run_inference(argv)
