"""Stopping a run cleanly when its scheduler asks (--exit-signal-handler, Megatron's flag): SIGTERM
or SIGUSR1, as Slurm sends before preemption or the time limit and torchrun passes on to its workers.

The handler only records the signal. After each host step the loop calls `agreed_signal`: every
rank contributes what it received (an all-reduce, so all ranks stop after the same step even when
the signal reached only some of them); the run then saves `step_N` and ends with exit code 0, and
a requeued job with --auto-resume continues from that checkpoint. The same request often arrives
twice: Slurm and PBS signal every process of the job, and torchrun forwards its own copy to its
workers; a repeat within REPEAT_WINDOW_S seconds of the first is that copy and is ignored. A second
signal after that ends the process at once, as without the handler (checkpoint writes are atomic,
so nothing half-written remains).
SIGINT (Ctrl-C) is not handled here: it interrupts at once with exit code 130, as before.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REPEAT_WINDOW_S = 10.0
"""A signal this soon after the first is the scheduler's and torchrun's copies of one request (torchrun
forwards within its monitor interval, well under a second), not a user asking again."""

_received: int = 0  # the first exit signal this process received while the handler was installed
_received_at = 0.0  # time.monotonic() of it
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced, while ours is installed
_active = False  # inside `exit_signals` with the handler on (the same on every rank: one config)


class ExitRequested(Exception):
    """The run stopped on an exit signal after its checkpoint; the message is the one-line notice
    the entry point prints before exiting 0."""


def _record(signum: int, frame: FrameType | None) -> None:
    global _received, _received_at
    if _received and time.monotonic() - _received_at < REPEAT_WINDOW_S:
        return  # another copy of the same request
    if _received:  # asked twice: behave as if no handler were installed
        _restore()
        signal.raise_signal(signum)
        return
    _received, _received_at = signum, time.monotonic()


def _restore() -> None:
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous.clear()


@contextlib.contextmanager
def exit_signals(enabled: bool) -> Iterator[None]:
    """Record EXIT_SIGNALS during the block instead of dying of them (the previous handlers come
    back after it). A no-op when not `enabled` or off the main thread (Python handles signals there
    only)."""
    global _received, _active
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    _received, _active = 0, True
    for sig in EXIT_SIGNALS:
        _previous[sig] = signal.signal(sig, _record)
    try:
        yield
    finally:
        _restore()
        _active = False


def agreed_signal(device: torch.device) -> str | None:
    """The name of an exit signal received by any rank since the block began (None if none): a
    collective when distributed, so every rank must call it at the same point of the loop. Costs
    nothing when the handler is not installed."""
    if not _active:
        return None
    code = _received
    if dist.is_initialized():
        flag = torch.tensor([code], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        code = int(flag.item())
    return signal.Signals(code).name if code else None


def exit_notice(signame: str, step: int, checkpoint_dir: str | None, names: tuple[str, ...]) -> str:
    """The one line a run stopped by `signame` after host step `step` prints; `names`: the
    checkpoint written into `checkpoint_dir` (empty when --checkpoint-output-dir is not set)."""
    if not (checkpoint_dir and names):
        return (f"stopped by {signame} after step {step}; no checkpoint saved (set --checkpoint-output-dir "
                "to save one and continue with --auto-resume)")
    return (f"stopped by {signame} after step {step}; saved checkpoint {Path(checkpoint_dir) / names[0]}: rerun "
            "with --auto-resume to continue")
