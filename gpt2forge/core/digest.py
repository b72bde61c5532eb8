"""Content digests of files: what checkpoints, evaluation reports and the vocabulary pin record."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(*paths: str | Path) -> str:
    """Hex sha256 over the bytes of `paths`, in order (one file: that file's usual sha256), read in
    4 MiB chunks so large files are never held in memory."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
