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
- `collective_failure`: when a collective fails (a peer's process died, or nothing came within the
  collective timeout: a node or its link went away), one line naming the node(s) lost and the
  timeout, instead of gloo's traceback. The preflight records every rank's host name and address
  for it; after a timeout the ranks still running check in at the job's store for a few seconds,
  and the ones that do not are named (a rank that cannot reach the store says so: its own node is
  the one cut off).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import re
import socket
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
_nodes: list[tuple[str, str]] = []  # rank -> (host name, address), gathered by the preflight
CHECK_IN_S = 5.0  # how long the ranks left after a collective timeout wait for each other at the store


def preflight(device: torch.device, timeout: datetime.timedelta = PREFLIGHT_TIMEOUT) -> None:
    """Check that every rank is here and that the backend moves data; a collective of all ranks.
    Raises UsageError (one line, naming the missing ranks or the backend) on failure."""
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    try:
        dist.monitored_barrier(group=(gloo := _gloo_group(timeout)), timeout=timeout, wait_all_ranks=True)
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
    _nodes[:] = [None] * world
    dist.all_gather_object(_nodes, _this_node(), group=gloo)
    log.info(f"Preflight: {world} ranks passed a barrier and an all-reduce over {backend} in "
             f"{time.perf_counter() - t0:.2f} s")


def _this_node() -> tuple[str, str]:
    """(host name, the address this host reaches MASTER_ADDR from: the one its peers see)."""
    host = socket.gethostname()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
            probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
            return host, probe.getsockname()[0]
    except (OSError, ValueError):
        return host, "?"


_COMM_FAILURE = re.compile(r"gloo/transport|Connection (closed|reset) by peer|Timed out waiting|NCCL (error|timeout)",
                           re.I)
# gloo names the peer whose connection closed: "Connection closed by peer [10.77.0.2]:63662",
# "Read error [10.77.0.2]:41603: Connection reset by peer" (its own "[file.cc:553]" has no port).
_PEER = re.compile(r"\[([^\]\s/]+)\]:\d+")
_CLOSED = re.compile(r"Connection (closed|reset) by peer", re.I)


def collective_failure(exc: BaseException, timeout: datetime.timedelta, doing: str) -> str | None:
    """The one line for `exc` when it is a failed collective of this job (None when it is not): the
    node(s) lost, what this rank was `doing`, the backend's own words and the collective `timeout`.
    Unless the backend named the peer, waits up to CHECK_IN_S seconds at the job's store for the
    other ranks that are still running: the ones that do not come are the lost ones."""
    text = str(exc)
    if not dist.is_initialized() or not (isinstance(exc, dist.DistError) or _COMM_FAILURE.search(text)):
        return None
    here = f"on {_node_name(dist.get_rank())}" + (f" during {doing}" if doing else "")  # errors.cli_main names the rank
    said = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
    said = said.split(". ")[0][:200]  # gloo: "[file.cc:553] Connection closed by peer [10.77.0.2]:63662. This is..."
    limit = f"collective timeout {timeout.total_seconds():g} s, GPT2FORGE_DIST_TIMEOUT_MIN"
    if _CLOSED.search(text) and (peer := _PEER.search(text)):
        lost = [r for r, (_, address) in enumerate(_nodes) if address == peer[1] and r != dist.get_rank()]
        who = _describe(lost) if lost else peer[1]
        return (f"{here}: lost the connection to {who}: a process there exited or was killed (its own log or "
                f"torchrun's summary says why) ({said}; {limit})")
    missing = _ranks_not_checking_in(min(CHECK_IN_S, timeout.total_seconds()))
    if missing is None:
        store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"{here}: a collective failed and the job's store at {store} does not answer either: this node "
                f"lost its network, or the node of rank 0 went away ({said}; {limit})")
    if missing:
        return (f"{here}: a collective failed; not answering: {_describe(missing)}: their processes exited, or "
                f"their node or its link is down ({said}; {limit})")
    return f"{here}: a collective failed, yet every rank is still running: a slow rank or link? ({said}; {limit})"


def _node_name(rank: int) -> str:
    return _nodes[rank][0] if rank < len(_nodes) else "?"


def _describe(ranks: list[int]) -> str:
    """`node1 (10.77.0.2: rank 1, 3); node2 (...)`: the ranks grouped by node."""
    by_node: dict[tuple[str, str], list[int]] = {}
    for r in ranks:
        by_node.setdefault(_nodes[r] if r < len(_nodes) else ("?", "?"), []).append(r)
    return "; ".join(f"{host} ({address}: rank {', '.join(map(str, rs))})" for (host, address), rs in by_node.items())


def _ranks_not_checking_in(wait_s: float) -> list[int] | None:
    """The ranks that do not write their key at the job's store within `wait_s` seconds of this
    one; None when this rank cannot reach the store. The store's client can block past its own
    timeout on a link that drops everything, so the check-in runs in a thread given `wait_s` + 2 s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"gpt2forge/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    found: list[list[int]] = []

    def check_in() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))
            store.set(f"{key}{rank}", "1")
            deadline = time.monotonic() + wait_s
            while True:
                missing = [r for r in range(world) if not store.check([f"{key}{r}"])]
                if not missing or time.monotonic() > deadline:
                    found.append(missing)
                    return
                time.sleep(0.25)
        except (RuntimeError, ValueError):  # DistStoreError: the store's host or our link is gone
            return

    thread = threading.Thread(target=check_in, name="gpt2forge-check-in", daemon=True)
    thread.start()
    thread.join(wait_s + 2.0)
    return found[0] if found else None


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
