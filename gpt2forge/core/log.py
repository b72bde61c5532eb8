"""The one logging helper: rank-aware, plain `%(message)s` lines as the reference printed them.

Only rank 0 prints (torchrun sets RANK); notices are printed once per process.
"""

from __future__ import annotations

import os
import sys

_seen_notices: set[str] = set()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def info(msg: str) -> None:
    """Print a line on rank 0 (stdout, flushed so pipes and benchmark regexes see it live)."""
    if rank() == 0:
        print(msg, flush=True)


def notice(msg: str) -> None:
    """Print `notice: msg` once per process (e.g. a flag that has no effect on this device)."""
    if msg in _seen_notices:
        return
    _seen_notices.add(msg)
    if rank() == 0:
        print(f"notice: {msg}", file=sys.stderr, flush=True)


def banner(title: str) -> None:
    info("-" * 20 + f" {title} " + "-" * 20)
