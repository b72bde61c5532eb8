"""Job health under torch.distributed: a preflight check at start-up, a hang watchdog, and waits
for work that rank 0 does alone.

- `preflight`: right after the process group forms, every rank passes a monitored barrier (gloo;
  rank 0 names the ranks that did not arrive) and one all-reduce on the job's own backend
  (NCCL on GPUs), each with a short timeout. A cluster whose ranks meet but cannot move data
  (the classic multi-node NCCL transport problem) fails here in seconds with a hint, not after
  the first step's collective times out.
- `Watchdog`: training must make progress (a micro-batch, a pipeline stage's forward) within
  `GPT2FORGE_HANG_TIMEOUT_MIN` minutes (default 15); otherwise this rank prints which rank and
  what it was doing, dumps the Python stacks of all its threads and exits 1, so torchrun ends the
  job and names the rank. Collectives have their own timeout (`GPT2FORGE_DIST_TIMEOUT_MIN`); the
  watchdog also catches hangs outside them (a data loader, a file system).
- `wait_for_rank0`: the other ranks wait on a gloo barrier with a long timeout while rank 0
  evaluates, samples or writes a checkpoint alone (work that can outlast the collective timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError

PREFLIGHT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("GPT2FORGE_PREFLIGHT_TIMEOUT_S", "120")))
HANG_TIMEOUT_S = 60 * float(os.environ.get("GPT2FORGE_HANG_TIMEOUT_MIN", "15"))
RANK0_TIMEOUT = datetime.timedelta(hours=float(os.environ.get("GPT2FORGE_RANK0_TIMEOUT_H", "6")))

_rank0_group = None


def preflight(device: torch.device, timeout: datetime.timedelta = PREFLIGHT_TIMEOUT) -> None:
    """Check that every rank is here and that the backend moves data; a collective of all ranks.
    Raises UsageError (one line, naming the missing ranks or the backend) on failure."""
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    try:
        dist.monitored_barrier(group=_gloo_group(timeout), timeout=timeout, wait_all_ranks=True)
    except RuntimeError as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"preflight on rank {rank}: not every rank reached the start-up barrier within "
                         f"{timeout.total_seconds():.0f} s ({detail}); check that every node was started with the "
                         "same NNODES / MASTER_ADDR and that no rank is stuck (GPT2FORGE_PREFLIGHT_TIMEOUT_S "
                         "sets the limit)") from None
    probe = torch.ones(1, device=device)
    work = dist.all_reduce(probe, async_op=True)
    try:
        ok = work.wait(timeout) and float(probe.item()) == world
    except RuntimeError:
        ok = False
    if not ok:
        hint = ("NCCL cannot move data between these ranks: set NCCL_DEBUG=INFO to see the transport, and "
                "try NCCL_SOCKET_IFNAME=<interface> or NCCL_IB_DISABLE=1") if "nccl" in backend else \
            "check the network between the nodes"
        raise UsageError(f"preflight on rank {rank}: the ranks met, but an all-reduce over {backend} did not "
                         f"complete correctly within {timeout.total_seconds():.0f} s; {hint}")
    log.info(f"Preflight: {world} ranks passed a barrier and an all-reduce over {backend} in "
             f"{time.perf_counter() - t0:.2f} s")


def _gloo_group(timeout: datetime.timedelta):
    """The default group when it is gloo, else a gloo group of all ranks (monitored_barrier is gloo-only)."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)


def wait_for_rank0() -> None:
    """Barrier of all ranks that tolerates rank 0 working alone for up to GPT2FORGE_RANK0_TIMEOUT_H hours."""
    global _rank0_group
    if not dist.is_initialized():
        return
    if _rank0_group is None:  # created lazily by every rank at the same call, as torch.distributed requires
        _rank0_group = dist.new_group(backend="gloo", timeout=RANK0_TIMEOUT)
    dist.barrier(group=_rank0_group)


class Watchdog:
    """Exit with a stack dump when training makes no progress for `timeout_s` seconds.

    `kick(what)` marks progress; `paused()` suspends the check (phases with their own pace, like
    evaluation or checkpoint writing). Off until the first kick; a no-op when `timeout_s` <= 0.
    """

    def __init__(self, label: str, timeout_s: float = HANG_TIMEOUT_S):
        self.label, self.timeout_s = label, timeout_s
        self.deadline: float | None = None
        self.what = ""
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="gpt2forge-watchdog", daemon=True).start()

    def kick(self, what: str | None = None) -> None:
        """Progress now; `what` (kept until the next one given) says where the run is."""
        self.what = what or self.what
        self.deadline = time.monotonic() + self.timeout_s

    @contextlib.contextmanager
    def paused(self):
        deadline, self.deadline = self.deadline, None
        try:
            yield
        finally:
            if deadline is not None:
                self.kick()

    def _watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.timeout_s / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()

    def _fire(self) -> None:
        sys.stderr.write(f"error: {self.label}: no progress for {self.timeout_s:g} s during {self.what}; "
                         "the stacks of this process's threads follow (waiting in a collective means another rank "
                         "stalled; GPT2FORGE_HANG_TIMEOUT_MIN sets the limit)\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)
