"""Atomic file writes and links: readers see the old file or the new one, never half of one.

Data goes to a temporary file in the destination folder, is flushed to disk, and is renamed into
place (a rename within one file system is atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gpt2forge.core.errors import naming


def fsync_path(path: str | Path) -> None:
    """Flush a file or a directory to disk, so a rename never publishes unwritten data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: int = 0o644) -> Iterator[BinaryIO]:
    """A binary file whose contents appear at `path` only if the block completes (its folder is
    created if needed); for outputs too large to hold as one bytes object."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with naming(path), os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
        fsync_path(path.parent)  # the rename itself reaches the disk
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write `data` (bytes, or text as UTF-8) to `path`, creating its folder if needed."""
    with atomic_file(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def replace_with_link(path: str | Path, target: str) -> None:
    """Make `path` a symbolic link to `target` (relative to path's folder), replacing a link or file
    already there in one rename, so a reader sees the old entry or the new link, never neither."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
