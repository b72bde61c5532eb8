"""Fixtures of the namespaced-cluster tests (imported by each test module: a conftest.py here
would shadow tests/conftest.py, which other modules import as `conftest`): `cluster(n)` builds n
nodes (tests/cluster/netns.py) and tears them down after the test, whatever its outcome (each
test module imports `cluster_fixture`, registered under the name `cluster`). Every
test that asks for one skips, with the reason, where namespaces cannot be made (not root, no
iproute2, `ip netns add` refused: CI containers often).

`chaos` marks the longer fault cases: they run only under `make chaos` (GPT2FORGE_CHAOS=1);
`make test` runs the harness, the parity case and one fault case, to stay within CI's time.
"""

import json
import os
import sys
from pathlib import Path

import netns
import pytest
import scheduler_stand_ins as scheduler
from conftest import TINY_MODEL  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
_UNAVAILABLE: list[str | None] = []  # probed once per session


chaos = pytest.mark.skipif(os.environ.get("GPT2FORGE_CHAOS") != "1",
                           reason="a longer cluster case: `make chaos` runs it (GPT2FORGE_CHAOS=1)")


def _unavailable() -> str | None:
    if not _UNAVAILABLE:
        reason = netns.probe()
        if reason is None:
            netns.remove_leftovers()  # of earlier runs that crashed
        _UNAVAILABLE.append(reason)
    return _UNAVAILABLE[0]


def node_env(tmp_path: Path) -> dict[str, str]:
    """What every node's processes start with: this environment without a launcher's variables,
    one thread per process (2 cores host them all), the scheduler stand-ins and the venv first on
    PATH, CPU only."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "NPROC_PER_NODE", "MAX_RESTARTS", "RDZV_ID", "PBS_NODEFILE"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    bin_dir = tmp_path / "bin"
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


@pytest.fixture(scope="session", name="tiny_config")
def tiny_config_fixture(tmp_path_factory) -> Path:
    """The suite's 2-layer test model without dropout, one file for the session (so the one-process
    runs the jobs are compared with are run once: jobs.single_process keeps them)."""
    path = tmp_path_factory.mktemp("cluster_model") / "tiny.json"
    path.write_text(json.dumps({**TINY_MODEL, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                "attn_pdrop": 0.0}))
    return path


@pytest.fixture(name="cluster")
def cluster_fixture(tmp_path):
    """`cluster(n)`: n namespaced nodes (2 to 4), torn down after the test."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"no namespaced cluster on this machine: {reason}")
    made: list[netns.Cluster] = []

    def make(n: int) -> netns.Cluster:
        built = netns.Cluster(n, node_env(tmp_path))
        made.append(built)
        extra = scheduler.install(tmp_path / "bin", {node.name: node.namespace for node in built.nodes})
        for node in built.nodes:
            node.env.update(extra)
        return built

    yield make
    for built in made:
        built.close()
