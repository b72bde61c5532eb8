"""User-facing errors: one line that names the flag or file and the fix, exit code 2."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable


class UsageError(ValueError):
    """Bad input from the user (a flag, a file, a checkpoint).

    The message is one line: what is wrong, where (flag or file), and what to do.
    Entry points print it without a traceback and exit with code 2.
    """


class RunError(RuntimeError):
    """A run that cannot go on (it diverged, say): one line saying why and what to do, exit code 1."""


def _where() -> str:
    """`rank R: ` on the ranks other than 0 of a torchrun job, so every error line names its rank."""
    rank = os.environ.get("RANK", "0")
    return f"rank {rank}: " if os.environ.get("WORLD_SIZE", "1") != "1" and rank != "0" else ""


def collect(errors: list[str]) -> None:
    """Raise one UsageError for all collected problems (joined with '; '), if any."""
    if errors:
        raise UsageError("; ".join(errors))


def cli_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate an entry point: UsageError becomes `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> int:
        try:
            code = fn(*args, **kwargs)
        except UsageError as exc:
            print(f"error: {_where()}{exc}", file=sys.stderr)
            return 2
        except RunError as exc:
            print(f"error: {_where()}{exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        return 0 if code is None else int(code)

    return wrapper
