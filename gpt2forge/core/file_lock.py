"""One exclusive lock on a file (`fcntl.flock`), held for a block.

The kernel drops the lock when its holder ends, SIGKILL included, so no stale lock outlives a
process. Three rooms use it: the tokenized-text cache (wait, saying so), the per-CPU peak FLOP/s
cache (wait, silently; no lock where the folder is read-only) and prepare_corpus.py's output folder
(refuse, naming the holder; warn where the file system has no locks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""flock's errors on a file system without locks (some network file systems)."""


@contextlib.contextmanager
def exclusive(path: str | Path, *, if_held: Callable[[str], None] | None = None, sign: bool = False,
              best_effort: bool = False) -> Iterator[bool]:
    """Hold an exclusive lock on `path` (created if needed) while the block runs; yields whether it
    is locked.

    Args:
        if_held: called when another process holds the lock, with what that process signed there
            (`pid N on HOST`, or ""); it raises to refuse, or returns, and the lock is waited for.
        sign: once locked, write `pid N on HOST` into the file for the next one's `if_held`.
        best_effort: where the file cannot be opened, run the block unlocked (yields False) instead
            of raising. A file system without locks always runs the block unlocked (yields False).
    """
    try:
        f = open(path, "a+", encoding="utf-8")
    except OSError:
        if not best_effort:
            raise
        yield False
        return
    with f:  # closing the file releases the lock
        locked = True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if if_held is not None:
                f.seek(0)
                if_held(f.read().strip())
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in NO_LOCKS:
                raise
            locked = False
        if locked and sign:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        yield locked


__all__ = ["NO_LOCKS", "exclusive"]
