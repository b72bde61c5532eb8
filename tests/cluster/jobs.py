"""Training jobs on the namespaced cluster: the tiny run of tests/parallel/test_distributed.py
(`args`: 2-layer GPT-2, generated tokens, 4 steps, global batch 8, LAMB with ZeRO-1), started on
every node the way a user starts it, and the losses it logs.

Losses come from the metrics file (full precision), not the step lines (4 decimals).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netns

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "parallel"))
from test_distributed import STEP, args  # noqa: E402  (the suite's tiny distributed run)

__all__ = ["STEP", "args", "eth0_bytes", "finish", "losses", "losses_by_step", "set_flag", "single_process",
           "start_on_nodes", "torchrun_c10d", "wait_for", "worker_pids"]

JOB_TIMEOUT_S = 240  # no job of these tests runs longer on 2 cores; a hang fails the test instead


def set_flag(argv: list[str], flag: str, *values: str) -> list[str]:
    """argv with `flag`'s value(s) replaced (appended when absent)."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        end = i + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        argv[i + 1:end] = values
    else:
        argv += [flag, *values]
    return argv


def losses(metrics_file: Path) -> list[float]:
    """The training losses of a metrics file, by step (a resumed run's rows replace the steps it
    repeats)."""
    by_step = losses_by_step(metrics_file)
    return [by_step[s] for s in sorted(by_step)]


def losses_by_step(metrics_file: Path) -> dict[int, float]:
    """step -> training loss; a later row of a step (a resumed run's) wins."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


_single: dict[tuple[str, ...], list[float]] = {}


def single_process(argv: list[str], metrics_file: Path, timeout: float = JOB_TIMEOUT_S) -> list[float]:
    """The losses of `argv` (train_gpt2.py and its flags) in one process on this host (run once per
    session and argv)."""
    if tuple(argv) in _single:
        return _single[tuple(argv)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, *argv, "--metrics-file", str(metrics_file)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _single[tuple(argv)] = losses(metrics_file)
    return _single[tuple(argv)]


def torchrun_c10d(cluster: netns.Cluster, nproc: int = 1, port: int = 29400, job_id: str = "job",
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The torchrun command a user types on every node: c10d rendezvous at the first node's address."""
    return ["torchrun", "--nnodes", str(len(cluster.nodes)), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{cluster.nodes[0].address}:{port}", "--rdzv-id", job_id, *extra]


def start_on_nodes(cluster: netns.Cluster, argv: list[str], env: dict[str, str] | None = None
                   ) -> list[subprocess.Popen]:
    """`argv` started on every node at once (in the repository), stdout and stderr together."""
    return [node.popen(argv, env=env, cwd=ROOT) for node in cluster.nodes]


def finish(procs: list[subprocess.Popen], timeout: float = JOB_TIMEOUT_S) -> list[tuple[int, str]]:
    """(exit code, output) of each process, waiting at most `timeout` seconds in all; a process
    still running then is killed and its exit code reads None."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((proc.returncode, out))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=30)
            results.append((None, out))
    return results


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll `condition()` every 0.1 s until true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def worker_pids(cluster: netns.Cluster, node: netns.Node) -> list[int]:
    """The training processes torchrun started on `node` (their environment has RANK)."""
    found = []
    for pid in cluster.pids(node):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ) and any(e.startswith(b"RANK=") for e in environ):
            found.append(pid)
    return found


def eth0_bytes(node: netns.Node) -> int:
    """Bytes received plus sent on the node's eth0 so far."""
    stats = Path("/proc/net/dev")  # per network namespace: read it inside the node
    out = node.run(["cat", str(stats)], timeout=30).stdout
    line = next(row for row in out.splitlines() if row.strip().startswith("eth0:"))
    fields = line.split(":", 1)[1].split()
    return int(fields[0]) + int(fields[8])
