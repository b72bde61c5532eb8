"""Job health under torch.distributed: a preflight check at start-up, a hang watchdog, and waits
for work that rank 0 does alone.

- `preflight`: right after the process group forms, every rank passes a monitored barrier (gloo;
  rank 0 names the ranks that did not arrive) and one all-reduce on the job's own backend
  (NCCL on GPUs), awaited in a thread with a timeout of its own (GPT2FORGE_PREFLIGHT_PROBE_S,
  30 s), not NCCL's watchdog's. A cluster whose ranks meet but cannot move data (the classic
  multi-node NCCL transport problem) fails here in seconds with the backend's words and what they
  mean (`backend_failure_hint`, NCCL's messages and gloo's), not after the first step's
  collective times out.
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
PROBE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("GPT2FORGE_PREFLIGHT_PROBE_S", "30")))
"""How long the preflight's all-reduce may take once every rank is at the barrier: NCCL connects on
it (or fails to), which takes seconds, where its own watchdog would wait the collective timeout."""
HANG_TIMEOUT_S = 60 * float(os.environ.get("GPT2FORGE_HANG_TIMEOUT_MIN", "15"))
RANK0_TIMEOUT = datetime.timedelta(hours=float(os.environ.get("GPT2FORGE_RANK0_TIMEOUT_H", "6")))

_rank0_group = None
_nodes: list[tuple[str, str]] = []  # rank -> (host name, address), gathered by the preflight
CHECK_IN_S = 5.0  # how long the ranks left after a collective timeout wait for each other at the store


def preflight(device: torch.device, timeout: datetime.timedelta = PREFLIGHT_TIMEOUT,
              probe_timeout: datetime.timedelta = PROBE_TIMEOUT) -> None:
    """Check that every rank is here (within `timeout`) and that the backend moves data (one all-reduce
    awaited at most `probe_timeout`, whatever the backend's own watchdog would wait); a collective of
    all ranks. Raises UsageError (one line, naming the missing ranks, or the backend's words and what
    they mean) on failure."""
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
    ok, said = _probe_all_reduce(device, world, probe_timeout)
    if not ok:
        raise UsageError(f"preflight on rank {rank}: the ranks met, but an all-reduce over {backend} did not "
                         f"complete correctly within {probe_timeout.total_seconds():g} s ({said}); "
                         f"{backend_failure_hint(said, backend)} (GPT2FORGE_PREFLIGHT_PROBE_S sets the limit)")
    _nodes[:] = [None] * world
    dist.all_gather_object(_nodes, _this_node(), group=gloo)
    log.info(f"Preflight: {world} ranks passed a barrier and an all-reduce over {backend} in "
             f"{time.perf_counter() - t0:.2f} s")


def _probe_all_reduce(device: torch.device, world: int, timeout: datetime.timedelta) -> tuple[bool, str]:
    """(whether an all-reduce of ones over the default group summed to `world` within `timeout`, what
    failed). It runs in a thread of its own: a NCCL link that never connects blocks the caller until
    NCCL's watchdog gives up (the collective timeout, 10 minutes), and a stuck thread cannot hold
    up the exit (a daemon; the entry point leaves with os._exit under torchrun)."""
    done: dict[str, object] = {}

    def probe() -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                ones = torch.ones(1, device=device)
                dist.all_reduce(ones)
                done["sum"] = float(ones.item())  # waits for the device
        except Exception as exc:  # any failure of the backend is the answer, said in one line
            done["error"] = exc

    thread = threading.Thread(target=probe, name="gpt2forge-preflight", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if "error" in done:
        exc = done["error"]
        return False, first_words(exc)
    if "sum" not in done:
        return False, "no answer: it is still waiting"
    return done["sum"] == world, f"the sum was {done['sum']:g}, not {world}"


def first_words(exc: BaseException) -> str:
    """The backend's own words, cut to 200 characters: NCCL's `Last error:` line when it has one (what
    failed: "socketStartConnect: Connect to 10.77.0.2<43215> failed : No route to host"), else the
    first line without its source location (gloo's `[pair.cc:553] `, NCCL's `NCCL error in: <file>:<line>, `)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
    if "Last error:" in lines[:-1]:
        said = lines[lines.index("Last error:") + 1]
    else:
        said = re.sub(r"^\[[^\]]*\]\s*|^NCCL error in: \S+, ", "", lines[0])
    return said[:200]


# What NCCL's and gloo's messages mean, and the fix: (pattern, hint). NCCL's words: its result names
# (ncclSystemError, ncclRemoteError, ...), "socketStartConnect: Connect to <address> failed", "NET/IB",
# torch's "Watchdog caught collective operation timeout"; gloo's: "Connection closed by peer",
# "Timed out waiting", "gloo/transport".
_NCCL_HINTS = (
    (r"Duplicate GPU detected|ncclInvalidUsage", "two ranks share one GPU: start one process per GPU "
     "(--nproc_per_node at most the GPUs of a node) and leave CUDA_VISIBLE_DEVICES the same on every rank"),
    (r"socketStartConnect|Connect to .* failed|No route to host|Connection refused|Software caused connection "
     r"abort|no socket interface found|Bootstrap", "NCCL's sockets cannot reach the other nodes: set "
     "NCCL_SOCKET_IFNAME=<interface> to the network the nodes share (NCCL_DEBUG=INFO lists what it tried) and "
     "check that no firewall blocks the ports between them"),
    (r"NET/IB|ibv_|IBV_|InfiniBand", "the InfiniBand transport failed: check the links (ibstat), or run over "
     "sockets with NCCL_IB_DISABLE=1"),
    (r"ncclRemoteError|remote process exit", "a process on another node exited or lost its network: its own log "
     "or torchrun's summary says why"),
    (r"ncclUnhandledCudaError|unhandled cuda error|Cuda failure", "a CUDA error inside NCCL: check the GPUs "
     "(nvidia-smi) and that every node runs the same driver and NCCL"),
    (r"ncclSystemError|unhandled system error|/dev/shm|shm", "a system call of NCCL failed: in a container, "
     "/dev/shm may be too small (docker --shm-size=1g or NCCL_SHM_DISABLE=1); NCCL_DEBUG=INFO names the call"),
    (r"Watchdog caught collective operation timeout|timed out|still waiting|Timeout", "no data moved: the ranks "
     "met but their GPUs cannot reach each other; set NCCL_DEBUG=INFO to see the transport, and try "
     "NCCL_SOCKET_IFNAME=<interface> or NCCL_IB_DISABLE=1"),
    (r"ncclInternalError|NCCL communicator was aborted|NCCL error", "NCCL failed: set NCCL_DEBUG=INFO to see why"),
)
_GLOO_HINTS = (
    (r"Connection (closed|reset) by peer", "a peer's process exited: its own log or torchrun's summary says why"),
    (r"Connection refused|Cannot assign requested address|Address family not supported|gloo/transport",
     "gloo cannot reach the other nodes: set GLOO_SOCKET_IFNAME=<interface> to the network the nodes share, "
     "and check MASTER_ADDR"),
    (r"Timed out|still waiting", "check the network between the nodes (GLOO_SOCKET_IFNAME=<interface>)"),
)


def backend_failure_hint(said: str, backend: str) -> str:
    """What a failed collective's message `said` means and what to do, for the job's `backend` (NCCL's
    messages where the backend includes NCCL, else gloo's)."""
    hints = (_NCCL_HINTS + _GLOO_HINTS) if "nccl" in backend else _GLOO_HINTS
    for pattern, hint in hints:
        if re.search(pattern, said, re.I):
            return hint
    if "nccl" in backend:
        return ("NCCL cannot move data between these ranks: set NCCL_DEBUG=INFO to see the transport, and try "
                "NCCL_SOCKET_IFNAME=<interface> or NCCL_IB_DISABLE=1")
    return "check the network between the nodes"


def _this_node() -> tuple[str, str]:
    """(host name, the address this host reaches MASTER_ADDR from: the one its peers see)."""
    host = socket.gethostname()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing
            probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
            return host, probe.getsockname()[0]
    except (OSError, ValueError):
        return host, "?"


_COMM_FAILURE = re.compile(r"gloo/transport|Connection (closed|reset) by peer|Timed out waiting|NCCL (error|timeout)|"
                           r"ncclRemoteError|ncclSystemError|ncclInternalError|NCCL communicator was aborted|"
                           r"Watchdog caught collective operation timeout", re.I)
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
