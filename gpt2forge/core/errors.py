"""User-facing errors: one line that names the flag or file and the fix, exit code 2.

A GPU that runs out of memory or stops answering ends a command the same way
(`naming_gpu_failures`, entered at one place per command: the training loop, the evaluation and
generation commands), with what ran, the memory asked for and free, and the flags that help.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch is imported when a GPU fails
    import torch


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


_OOM_FIGURES = re.compile(r"Tried to allocate (?P<asked>[\d.]+ \w+)\. GPU \d+ has a total capacity of "
                          r"(?P<total>[\d.]+ \w+) of which (?P<free>[\d.]+ \w+) is free\.")
_OOM_HELD = re.compile(r"this process has (?P<held>[\d.]+ \w+) memory in use")
# The CUDA errors of a GPU that went away or faulted (cudaGetErrorString's words), not of a program's
# bug: Xid 79 "fallen off the bus", a driver reset, an uncorrectable ECC error, a hung kernel.
_GPU_LOST = re.compile(r"unspecified launch failure|device(\(s\))? (is/are )?(busy or )?(un|not )available|"
                       r"no CUDA-capable device|uncorrectable ECC error|launch timed out|GPU has fallen off|"
                       r"CUDA error: unknown error|device not ready|context is destroyed", re.I)


def memory_figures(exc: BaseException) -> str:
    """What a CUDA out-of-memory error's message says of the memory: `it asked for 2.00 GiB more with
    1.23 GiB of the GPU's 79.11 GiB free (this process held 77.86 GiB)`; its first sentence when the
    message has another form."""
    text = " ".join(str(exc).split())
    if not (m := _OOM_FIGURES.search(text)):
        return text.split(". ")[0][:200]
    held = f" (this process held {h['held']})" if (h := _OOM_HELD.search(text)) else ""
    return f"it asked for {m['asked']} more with {m['free']} of the GPU's {m['total']} free{held}"


def gpu_failure_line(exc: BaseException, device: torch.device, doing: str, memory_fixes: str, after: str
                     ) -> str | None:
    """One line for `exc` when it is a GPU failure (None when it is not): CUDA out of memory (what
    was running, the memory asked for and free, the flags `memory_fixes` that need less), or a GPU
    that stopped answering (its error and where to look). `after` says what is kept and how to go on."""
    import torch  # lazy: only a failing GPU needs it here

    where = f"{device} ({_gpu_name_or_unknown(device)})" if device.type == "cuda" else str(device)
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in str(exc):
        kind = "CUDA out of memory" if device.type == "cuda" else "out of memory"
        return f"{kind} on {where} in {doing}: {memory_figures(exc)}; {memory_fixes}; {after}"
    said = " ".join(str(exc).split("\n")[0].split())[:200]
    if _GPU_LOST.search(said):  # not a program's CUDA error (an illegal address, a device-side assert)
        return (f"the GPU {where} stopped working in {doing} ({said}): it reset, fell off the bus, hit an "
                f"uncorrectable ECC error or hung; `nvidia-smi` and the kernel log (`dmesg`, NVRM Xid lines) say "
                f"which; {after}")
    return None


def _gpu_name_or_unknown(device) -> str:
    import torch  # lazy, as above

    try:
        return torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError):  # a GPU that fell off the bus may not answer even this
        return "no longer answering"


@contextlib.contextmanager
def naming_gpu_failures(device: torch.device, doing: Callable[[], str], memory_fixes: str, after: str
                        ) -> Iterator[None]:
    """Inside the block, CUDA out of memory or a GPU that stops answering becomes a UsageError whose
    line (`gpu_failure_line`) the entry point prints with exit code 2; `doing()` is called then, so it
    can name the step that failed. Other errors pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        line = gpu_failure_line(exc, device, doing(), memory_fixes, after)
        if line is None:
            raise
        raise UsageError(line) from None
