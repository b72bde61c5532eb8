"""Fuzzing of the trainer's flags: every flag given each of a set of bad or extreme values, for
`train_gpt2.py` and for `pretrain_gpt.py` (Megatron-LM's flags, the same trainer).

A case is `(front end, flag, value)` on a tiny run of generated tokens (Megatron's `--mock-data`).
The outcome must be success or one line `error: ...` with exit code 2 (argparse's own exit 2
included); a traceback, another exit code or a multi-line error is a failure. Two tiers:

  preflight  parse the flags and run the checks the trainer makes before it allocates anything
             (the model's shape, one step's batch, the weights against the host's memory): fast,
             every `make test` (tests/fuzz/test_flags.py)
  run        `train_main` itself, in this process, two updates, each case under a time limit
             (a case that is still training at the limit, such as --training-steps 99999999999,
             is reported as such, not as a failure)

    python tests/fuzz/flags.py            # preflight, every flag x VALUES, both front ends
    python tests/fuzz/flags.py --run      # the whole run for each case (a few minutes here)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VALUES = ("-1", "0", "1", "3", "nan", "inf", "-inf", "1e30", "abc", "0.5", "99999999999", "")
"""Values every flag is given (a flag with choices is given each of its choices instead)."""

SKIP = {
    "train": {"--help", "--config", "--checkpoint-input-dir", "--input-files", "--dataset", "--compile-only",
              "--profile", "--torch-compile", "--model-config", "--num-workers", "--checkpoint-output-dir",
              "--train-path"},
    "megatron": {"--help", "--data-path", "--train-data", "--load", "--save", "--vocab-file", "--merge-file",
                 "--tokenizer-name-or-path", "--mock-data", "--num-workers", "--deepspeed_config", "--deepspeed-config",
                 "--print-equivalent"},
}
"""Per front end: flags the base command fixes (a path, the data source) or whose job is to exit early."""

TINY = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2,
        "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "activation_function": "gelu_new"}


def parser(front_end: str) -> argparse.ArgumentParser:
    if front_end == "megatron":
        from gpt2forge.frontends.megatron import build_parser
    else:
        from gpt2forge.frontends.graphcore import build_parser
    return build_parser()


def cases(front_end: str = "train") -> list[tuple[str, str | None]]:
    """(flag, value) for every flag of the front end's parser; None: the flag alone (a switch)."""
    out = []
    for action in parser(front_end)._actions:
        name = next((s for s in action.option_strings if s.startswith("--")), None)
        if name is None or name in SKIP[front_end]:
            continue
        values = [str(c) for c in action.choices] if action.choices else list(VALUES)
        out += [(name, None)] if action.nargs == 0 else [(name, v) for v in values]
    return out


def base_argv(folder: Path, front_end: str = "train") -> list[str]:
    if front_end == "megatron":
        return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                "--max-position-embeddings", "64", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                "--mock-data", "--num-workers", "0", "--save", str(folder / "out")]
    config = folder / "tiny.json"
    if not config.is_file():
        config.write_text(json.dumps(TINY))
    return ["--model-config", str(config), "--dataset", "generated", "--training-steps", "2", "--batch-size", "2",
            "--max-len", "16", "--torch-compile", "false", "--num-workers", "0",
            "--checkpoint-output-dir", str(folder / "out")]


class Expired(BaseException):
    """A case's time limit (not an OSError such as TimeoutError, which the CLI would report as an error line)."""


@contextlib.contextmanager
def time_limit(seconds: int):
    def expire(*_):
        raise Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def preflight(argv: list[str], front_end: str = "train") -> int:
    """What the trainer checks before allocating, with its CLI's error handling: the exit code."""
    from gpt2forge.core.errors import cli_main
    from gpt2forge.frontends import graphcore as args
    from gpt2forge.frontends import megatron as megatron_args
    from gpt2forge.model.build import check_weights_fit_host
    from gpt2forge.train.setup import check_step_fits_host

    @cli_main
    def check(argv: list[str]) -> int:
        cfg = megatron_args.parse_args(argv, world_size=1) if front_end == "megatron" else args.parse_args(argv)
        check_step_fits_host(cfg)
        check_weights_fit_host(cfg.model_source().config)
        return 0

    return check(argv)


def run_case(flag: str, value: str | None, folder: Path, run: bool, seconds: int = 40,
             front_end: str = "train") -> str | None:
    """None when the case ends in success or one `error:` line with exit code 2; else the problem
    ('still training' when a --run case reaches the time limit)."""
    from gpt2forge.cli import megatron_main, train_main

    main = megatron_main if front_end == "megatron" else train_main
    argv = [*base_argv(folder, front_end), *([flag] if value is None else [f"{flag}={value}"])]
    err = io.StringIO()
    try:
        with time_limit(seconds), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv) if run else preflight(argv, front_end)
    except Expired:
        return "still training" if run else f"preflight took over {seconds} s"
    except SystemExit as exc:  # argparse: a value of the wrong type
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 -- the point: anything escaping the CLI is a failure
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:") or ": error:" in line]
    if code == 2 and len(errors) == 1:
        return None
    if code == 0 and not errors:
        return None
    return f"exit {code} with {len(errors)} error line(s): {err.getvalue()[-200:]!r}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="train each case (two updates) instead of the preflight")
    p.add_argument("--seconds", type=int, default=40, help="time limit per case")
    p.add_argument("--front-end", choices=sorted(SKIP), action="append", help="only these (default: all)")
    args = p.parse_args()
    failed = 0
    for front_end in args.front_end or sorted(SKIP):
        bad, slow, t0 = [], [], time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)  # a run writes its metrics under ./runs
            all_cases = cases(front_end)
            for flag, value in all_cases:
                problem = run_case(flag, value, Path(tmp), args.run, args.seconds, front_end)
                if problem == "still training":
                    slow.append((flag, value))
                elif problem:
                    bad.append((flag, value))
                    print(f"FAIL {front_end} {flag} {value!r}: {problem}", flush=True)
        print(f"{front_end}: {len(all_cases)} cases ({'run' if args.run else 'preflight'}), {len(bad)} failures, "
              f"{len(slow)} still training at {args.seconds} s ({', '.join(f'{f} {v}' for f, v in slow) or 'none'}), "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
