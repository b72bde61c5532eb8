"""Fuzzing of train_gpt2.py's flags: every flag given each of a set of bad or extreme values.

A case is `(flag, value)` on a tiny generated-data run. The outcome must be success or one line
`error: ...` with exit code 2 (argparse's own exit 2 included); a traceback, another exit code or a
multi-line error is a failure. Two tiers:

  preflight  parse the flags and run the checks the trainer makes before it allocates anything
             (the model's shape, one step's batch, the weights against the host's memory): fast,
             every `make test` (tests/fuzz/test_flags.py)
  run        `train_main` itself, in this process, two updates, each case under a time limit
             (a case that is still training at the limit, such as --training-steps 99999999999,
             is reported as such, not as a failure)

    python tests/fuzz/flags.py            # preflight, every flag x VALUES
    python tests/fuzz/flags.py --run      # the whole run for each case (about 5 minutes here)
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

SKIP = {"--help", "--config", "--checkpoint-input-dir", "--input-files", "--dataset", "--compile-only", "--profile",
        "--torch-compile", "--model-config", "--num-workers", "--checkpoint-output-dir", "--train-path"}
"""Flags the base command fixes (a path, the data source) or whose job is to exit early."""

TINY = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2,
        "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "activation_function": "gelu_new"}


def cases() -> list[tuple[str, str | None]]:
    """(flag, value) for every flag of the trainer's parser; None: the flag alone (a switch)."""
    from gpt2forge.train.args import build_parser

    out = []
    for action in build_parser()._actions:
        name = next((s for s in action.option_strings if s.startswith("--")), None)
        if name is None or name in SKIP:
            continue
        values = [str(c) for c in action.choices] if action.choices else list(VALUES)
        out += [(name, None)] if action.nargs == 0 else [(name, v) for v in values]
    return out


def base_argv(folder: Path) -> list[str]:
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


def preflight(argv: list[str]) -> int:
    """What the trainer checks before allocating, with its CLI's error handling: the exit code."""
    from gpt2forge.core.errors import cli_main
    from gpt2forge.train.args import parse_args
    from gpt2forge.train.model_setup import check_step_fits_host, check_weights_fit_host, resolve_model_config

    @cli_main
    def check(argv: list[str]) -> int:
        cfg = parse_args(argv)
        check_step_fits_host(cfg)
        check_weights_fit_host(resolve_model_config(cfg)[0])
        return 0

    return check(argv)


def run_case(flag: str, value: str | None, folder: Path, run: bool, seconds: int = 40) -> str | None:
    """None when the case ends in success or one `error:` line with exit code 2; else the problem
    ('still training' when a --run case reaches the time limit)."""
    from gpt2forge.cli import train_main

    argv = [*base_argv(folder), *([flag] if value is None else [f"{flag}={value}"])]
    err = io.StringIO()
    try:
        with time_limit(seconds), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = train_main(argv) if run else preflight(argv)
    except Expired:
        return "still training" if run else f"preflight took over {seconds} s"
    except SystemExit as exc:  # argparse: a value of the wrong type
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 -- the point: anything escaping the CLI is a failure
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    errors = [line for line in err.getvalue().splitlines() if line.startswith(("error:", "train_gpt2.py: error"))]
    if code == 2 and len(errors) == 1:
        return None
    if code == 0 and not errors:
        return None
    return f"exit {code} with {len(errors)} error line(s): {err.getvalue()[-200:]!r}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="train each case (two updates) instead of the preflight")
    p.add_argument("--seconds", type=int, default=40, help="time limit per case")
    args = p.parse_args()
    failed, slow, t0 = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # a run writes its metrics under ./runs
        all_cases = cases()
        for flag, value in all_cases:
            problem = run_case(flag, value, Path(tmp), args.run, args.seconds)
            if problem == "still training":
                slow.append((flag, value))
            elif problem:
                failed.append((flag, value))
                print(f"FAIL {flag} {value!r}: {problem}", flush=True)
    print(f"{len(all_cases)} cases ({'run' if args.run else 'preflight'}), {len(failed)} failures, "
          f"{len(slow)} still training at {args.seconds} s ({', '.join(f'{f} {v}' for f, v in slow) or 'none'}), "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
