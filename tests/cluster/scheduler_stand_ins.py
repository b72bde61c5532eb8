"""Stand-ins for the schedulers' commands that job scripts call, run on a namespaced cluster
(tests/cluster/netns.py): `srun` and `scontrol show hostnames` (Slurm), `mpiexec --hostfile`
(PBS with Cray PALS or MPICH, as in seed 002's script). Each starts one task per node inside that
node's namespace, with the variables the real command sets, forwards SIGTERM/SIGUSR1/SIGINT to
the tasks, and exits with the first non-zero exit code of a task (0 when all succeed).

`install(folder, nodes)` writes `srun`, `scontrol` and `mpiexec` shims into `folder` (put it first
on PATH); they read the node map from $G2F_NODES (`node0=<namespace>,node1=...`).

Only the options the project's scripts use are understood; anything else is an error, so a
script that starts relying on more is noticed.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def install(folder: Path, namespaces: dict[str, str]) -> dict[str, str]:
    """Write the shims into `folder`; returns the environment they need (G2F_NODES)."""
    folder.mkdir(parents=True, exist_ok=True)
    for command in ("srun", "scontrol", "mpiexec"):
        shim = folder / command
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {command} "$@"\n')
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {"G2F_NODES": ",".join(f"{host}={ns}" for host, ns in namespaces.items())}


def _node_map() -> dict[str, str]:
    return dict(item.split("=", 1) for item in os.environ["G2F_NODES"].split(","))


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list: `node[0-2,5],login1` -> node0 node1 node2 node5 login1."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def _on_node(host: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    namespace = _node_map()[host]
    return subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--uts", "--", "sh", "-c",
                             'hostname "$0" && exec "$@"', host, *argv], env=env)


def _wait_all(tasks: list[subprocess.Popen]) -> int:
    """Forward the scheduler's signals to every task; the first non-zero exit code, else 0."""
    def forward(signum, frame):
        for task in tasks:
            if task.poll() is None:
                task.send_signal(signum)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    codes = [task.wait() for task in tasks]
    return next((c for c in codes if c), 0)


def srun(argv: list[str]) -> int:
    """One task per node of the allocation ($SLURM_JOB_NODELIST), as `srun` in a batch script with
    --ntasks-per-node=1."""
    hosts = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
    tasks = []
    for i, host in enumerate(hosts):
        env = {**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURM_LOCALID": "0",
               "SLURM_NTASKS": str(len(hosts)), "SLURM_STEP_NUM_NODES": str(len(hosts)),
               "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"], "SLURMD_NODENAME": host,
               "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": f"1(x{len(hosts)})"}
        tasks.append(_on_node(host, argv, env))
    return _wait_all(tasks)


def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"] or len(argv) > 3:
        print(f"scontrol stand-in: only `show hostnames [LIST]`, not {argv}", file=sys.stderr)
        return 2
    print("\n".join(expand_hostlist(argv[2] if len(argv) == 3 else os.environ["SLURM_JOB_NODELIST"])))
    return 0


def mpiexec(argv: list[str]) -> int:
    """`mpiexec --hostfile F -np N [--env K=V]... [--cpu-bind X] CMD...`: ranks placed one per host
    in the host file's order (what -np N over an N-line PBS_NODEFILE does)."""
    env, hostfile, np_ = dict(os.environ), None, None
    while argv and argv[0].startswith("-"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag in ("--hostfile", "-hostfile", "-f"):
            hostfile = value
        elif flag in ("-np", "-n"):
            np_ = int(value)
        elif flag == "--env":
            key, _, val = value.partition("=")
            env[key] = val
        elif flag != "--cpu-bind":
            print(f"mpiexec stand-in: unknown option {flag}", file=sys.stderr)
            return 2
    hosts = [h.strip() for h in Path(hostfile).read_text().splitlines() if h.strip()]
    np_ = np_ or len(hosts)
    tasks = [_on_node(hosts[r % len(hosts)], argv, {**env, "PMI_RANK": str(r), "PMI_SIZE": str(np_)})
             for r in range(np_)]
    return _wait_all(tasks)


if __name__ == "__main__":
    sys.exit({"srun": srun, "scontrol": scontrol, "mpiexec": mpiexec}[sys.argv[1]](sys.argv[2:]))
