"""User-facing errors: one line that names the flag or file and the fix, exit code 2."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import sys
from collections.abc import Callable, Iterator


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


_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space there or write somewhere else",
    errno.EDQUOT: "the disk quota is used up: free space there or write somewhere else",
    errno.EACCES: "permission denied: make it writable or choose another place",
    errno.EPERM: "operation not permitted: make it writable or choose another place",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.EIO: "an I/O error from the device: check the disk",
    errno.EFBIG: "the file is larger than this system allows: write smaller files or elsewhere",
}


def os_error_line(exc: OSError) -> str:
    """One line for a failed file operation: the path, what the system said, and the fix."""
    where = exc.filename if exc.filename is not None else "a file"
    what = exc.strerror or type(exc).__name__
    hint = _OS_HINTS.get(exc.errno, "check the path")
    return f"{where}: {what} ({hint}); nothing half-written was left behind as complete"


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Give an OSError raised inside the block `path` as its file name when it has none (a write
    to an open file that fails says only "No space left on device"), so the user's line names it."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
        raise


def collect(errors: list[str]) -> None:
    """Raise one UsageError for all collected problems (joined with '; '), if any."""
    if errors:
        raise UsageError("; ".join(errors))


def cli_main(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate an entry point: UsageError becomes `error: <message>` on stderr and exit code 2, as does
    an OSError (full, read-only or failing disk: the path and the fix; writers publish atomically, so
    nothing half-written looks complete), RunError exit code 1."""

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
        except OSError as exc:  # a disk that is full, read-only or failing; a path that cannot be used
            print(f"error: {_where()}{os_error_line(exc)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        return 0 if code is None else int(code)

    return wrapper


def one_line(exc: BaseException) -> str:
    """An exception as one short line: its type and its message with the whitespace folded."""
    text = " ".join(str(exc).split()) or "no detail"
    return f"{type(exc).__name__}: {text[:300]}"


def refused_part(exc: BaseException) -> str:
    """What weights-only unpickling refused, from PyTorch's many-line message (its advice to load
    with weights_only=False is not for us to repeat)."""
    for line in str(exc).splitlines():
        if "Unsupported" in line or "GLOBAL" in line:
            return "refused to unpickle: " + line.split("WeightsUnpickler error:")[-1].strip()[:200]
    return "it holds objects a training state never holds"
