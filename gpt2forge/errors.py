"""User-facing errors: one line that names the flag or file and the fix, exit code 2."""

from __future__ import annotations

import functools
import sys
from typing import Callable


class UsageError(ValueError):
    """Bad input from the user (a flag, a file, a checkpoint).

    The message is one line: what is wrong, where (flag or file), and what to do.
    Entry points print it without a traceback and exit with code 2.
    """


class RunError(RuntimeError):
    """A run that cannot go on (it diverged, say): one line saying why and what to do, exit code 1."""


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
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except RunError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        return 0 if code is None else int(code)

    return wrapper
