"""Stand-ins for the schedulers' commands that job scripts call, run on a namespaced cluster
(tests/cluster/netns.py): `srun` and `scontrol show hostnames` (Slurm), `mpiexec --hostfile`
(PBS with Cray PALS or MPICH, as in seed 002's script). Each starts one task per node inside that
node's namespace, with the variables the real command sets, forwards SIGTERM/SIGUSR1/SIGINT to
the tasks, and exits with the first non-zero exit code of a task (0 when all succeed).

Submissions, for job arrays: `sbatch --wait [--array=LIST] SCRIPT ARGS...` (Slurm) and
`qsub -W block=true [-J X-Y[:Z]] [-v K=V,...] SCRIPT` (PBS Pro) run a batch script once, or once
per array index, each run on one whole node (one job per node at a time, the next queued job
takes the first node that frees up), with the variables the scheduler gives a job: Slurm's
SLURM_JOB_ID, SLURM_JOB_NODELIST (its node), SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID, _COUNT, _MIN,
_MAX, in the submission folder; PBS's PBS_JOBID (`<id>[<index>].<server>`), PBS_ARRAY_ID,
PBS_ARRAY_INDEX, PBS_NODEFILE, PBS_O_WORKDIR, in $HOME as PBS starts a job (so a script that does
not `cd "$PBS_O_WORKDIR"` fails as it would there). The submitter's environment is passed on
(Slurm's default; PBS's `qsub -V`). They return when every run has ended (the blocking forms:
the stand-ins have no queue to return to), with the first non-zero exit code, else 0.

`install(folder, nodes)` writes `srun`, `scontrol`, `mpiexec`, `sbatch` and `qsub` shims into
`folder` (put it first on PATH); they read the node map from $G2F_NODES (`node0=<namespace>,...`).

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
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
COMMANDS = ("srun", "scontrol", "mpiexec", "sbatch", "qsub")


def install(folder: Path, namespaces: dict[str, str]) -> dict[str, str]:
    """Write the shims into `folder`; returns the environment they need (G2F_NODES)."""
    folder.mkdir(parents=True, exist_ok=True)
    for command in COMMANDS:
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


def _on_node(host: str, argv: list[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen:
    namespace = _node_map()[host]
    return subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--uts", "--", "sh", "-c",
                             'hostname "$0" && exec "$@"', host, *argv], env=env, cwd=cwd)


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


def _run_on_free_nodes(jobs: list[Callable[[str], dict[str, str]]], argv: list[str], cwd: str) -> int:
    """`argv` once per job, each on a whole node (one at a time per node, in job order); a job is
    the function giving its environment on a host. The first non-zero exit code, else 0."""
    pending, running, codes = deque(jobs), {}, []
    while pending or running:
        for host in _node_map():
            if host not in running and pending:
                running[host] = _on_node(host, argv, pending.popleft()(host), cwd)
        time.sleep(0.05)
        for host, job in list(running.items()):
            if job.poll() is not None:
                codes.append(job.returncode)
                del running[host]
    return next((c for c in codes if c), 0)


def _indices(spec: str, pattern: str) -> list[int] | None:
    """The array indices of `spec` when each comma-separated item matches `pattern` (groups: first,
    last, step), else None."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(pattern, item)
        if not m:
            return None
        first, last, step = m.groups()
        out += range(int(first), int(last or first) + 1, int(step or 1))
    return out


def sbatch(argv: list[str]) -> int:
    """`sbatch --wait [--array=LIST] SCRIPT ARGS...`: LIST is indices and ranges (`0-3`, `1,3`,
    `0-6:2`); the script runs in the submission folder, once per index."""
    wait, indices = False, [None]
    while argv and argv[0].startswith("-"):
        flag = argv.pop(0)
        if flag == "--wait":
            wait = True
        elif flag.startswith("--array=") and (found := _indices(flag[8:], r"(\d+)(?:-(\d+)(?::(\d+))?)?")):
            indices = found
        else:
            print(f"sbatch stand-in: only --wait and --array=LIST (indices, ranges, steps), not {flag}",
                  file=sys.stderr)
            return 2
    if not wait or not argv:
        print("sbatch stand-in: `sbatch --wait [--array=LIST] SCRIPT ARGS...` (it runs the job to its end)",
              file=sys.stderr)
        return 2
    job = os.getpid()

    def env(position: int, index: int | None) -> Callable[[str], dict[str, str]]:
        array = {} if index is None else {
            "SLURM_ARRAY_JOB_ID": str(job), "SLURM_ARRAY_TASK_ID": str(index),
            "SLURM_ARRAY_TASK_COUNT": str(len(indices)), "SLURM_ARRAY_TASK_MIN": str(min(indices)),
            "SLURM_ARRAY_TASK_MAX": str(max(indices))}
        return lambda host: {**os.environ, **array, "SLURM_JOB_ID": str(job + position), "SLURM_JOB_NODELIST": host,
                             "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": os.getcwd()}
    return _run_on_free_nodes([env(p, i) for p, i in enumerate(indices)], ["bash", *argv], os.getcwd())


def qsub(argv: list[str]) -> int:
    """`qsub -W block=true [-J X-Y[:Z]] [-v K=V,...] SCRIPT` (PBS Pro): the script runs in $HOME,
    once per subjob, with `-v`'s variables."""
    block, indices, extra = False, [None], {}
    while argv and argv[0].startswith("-") and len(argv) > 1:
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "-W" and value == "block=true":
            block = True
        elif flag == "-J" and (found := _indices(value, r"(\d+)-(\d+)(?::(\d+))?")):
            indices = found
        elif flag == "-v":
            extra.update(item.split("=", 1) for item in value.split(","))
        else:
            print(f"qsub stand-in: only -W block=true, -J X-Y[:Z] and -v K=V,..., not {flag} {value}", file=sys.stderr)
            return 2
    if not block or len(argv) != 1:
        print("qsub stand-in: `qsub -W block=true [-J X-Y[:Z]] [-v K=V,...] SCRIPT` (it runs the job to its end)",
              file=sys.stderr)
        return 2
    job, script = os.getpid(), str(Path(argv[0]).resolve())
    with tempfile.TemporaryDirectory() as folder:
        def env(index: int | None) -> Callable[[str], dict[str, str]]:
            def on(host: str) -> dict[str, str]:
                nodefile = Path(folder) / f"nodefile.{index}"
                nodefile.write_text(host + "\n")
                array = {} if index is None else {"PBS_ARRAY_ID": f"{job}[].stand-in", "PBS_ARRAY_INDEX": str(index)}
                jobid = f"{job}.stand-in" if index is None else f"{job}[{index}].stand-in"
                return {**os.environ, **extra, **array, "PBS_JOBID": jobid, "PBS_NODEFILE": str(nodefile),
                        "PBS_O_WORKDIR": os.getcwd(), "PBS_ENVIRONMENT": "PBS_BATCH"}
            return on
        return _run_on_free_nodes([env(i) for i in indices], ["bash", script], os.environ.get("HOME", "/"))


if __name__ == "__main__":
    sys.exit({"srun": srun, "scontrol": scontrol, "mpiexec": mpiexec, "sbatch": sbatch,
              "qsub": qsub}[sys.argv[1]](sys.argv[2:]))
