"""Users' multi-node launches on namespaced nodes, gloo over the nodes' own interfaces
(GLOO_SOCKET_IFNAME=eth0): plain torchrun with c10d rendezvous at the first node's address, seed
002's PBS script (a node file, one launcher per node through mpiexec, `--rdzv_endpoint=$PRIMARY_RANK`)
and run/slurm_pretraining_large.sbatch under srun. Each job logs one process's losses at the same
global batch.

Tolerance: the losses are compared with rel=1e-6. Data parallelism sums the replicas' gradients in
an all-reduce (in ring order over the nodes) where one process accumulates them micro-batch by
micro-batch: the same numbers added in another order, so results may differ in the last bits of
fp32. Measured over 12 steps of the torchrun job: at most 1.04e-7 relative, one fp32 ulp of a loss
of 4.57 (4.8e-7); 1e-6 allows a few ulps. A wrong batch, a missing replica or a stale gradient
moves the loss by 1e-3 or more.
"""

import re

import pytest
from cluster_fixtures import chaos, cluster_fixture, tiny_config_fixture  # noqa: F401  (fixtures)
from jobs import (
    ROOT,
    args,
    eth0_bytes,
    finish,
    losses,
    set_flag,
    single_process,
    start_on_nodes,
    torchrun_c10d,
)

pytestmark = pytest.mark.slow
REL = 1e-6  # see the module docstring
PBS_SCRIPT = ROOT / "tests" / "cluster" / "pbs_pretrain.sh"
SLURM_SCRIPT = ROOT / "run" / "slurm_pretraining_large.sbatch"


def test_torchrun_c10d_on_two_nodes_equals_one_process(cluster, tiny_config, tmp_path):
    """2 nodes x 1 process, data parallel with ZeRO-1: the losses of one process; the gradients
    crossed the nodes' veths (more bytes than 4 all-reduces of the weights moved through eth0)."""
    c = cluster(2)
    argv = args(tiny_config)
    single = single_process(argv, tmp_path / "single.jsonl")
    metrics = tmp_path / "job.jsonl"
    before = [eth0_bytes(n) for n in c.nodes]
    results = finish(start_on_nodes(c, [*torchrun_c10d(c), *argv, "--metrics-file", str(metrics)]))
    assert [code for code, _ in results] == [0, 0], "\n".join(out[-3000:] for _, out in results)
    assert len(single) == 4 and losses(metrics) == pytest.approx(single, rel=REL)
    weights_bytes = 4 * 30_000  # the tiny model's ~30k fp32 parameters
    assert all(eth0_bytes(n) - b > 4 * weights_bytes for n, b in zip(c.nodes, before))


@chaos
def test_seed_002_pbs_script_on_two_nodes_of_two_processes_equals_one_process(cluster, tiny_config, tmp_path):
    """The seed's script as a user adapts it: PBS_NODEFILE lists the nodes, mpiexec starts one
    torchrun per node, `--nproc_per_node=auto` is 2 processes per 2-core node (4 replicas of
    batch 2, global batch 8), c10d rendezvous at the node file's first host."""
    c = cluster(2)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{n.name}\n" for n in c.nodes))
    argv = set_flag(set_flag(args(tiny_config), "--replication-factor", "4"), "--gradient-accumulation", "1")
    single = single_process(argv, tmp_path / "single.jsonl")
    metrics = tmp_path / "job.jsonl"
    job = c.nodes[0].popen(["bash", str(PBS_SCRIPT), *argv[1:], "--metrics-file", str(metrics)], cwd=ROOT,
                           env={"PBS_NODEFILE": str(nodefile), "PBS_JOBID": "4242.polaris", "OMP_THREADS": "1"})
    [(code, out)] = finish([job])
    assert code == 0, out[-4000:]
    assert "--rdzv_backend=c10d --rdzv_endpoint=node0 train_gpt2.py" in out  # its "Training Command:" line
    assert out.count("Distributed: 4 processes, backend gloo") == 1  # rank 0's line
    assert losses(metrics) == pytest.approx(single, rel=REL)


@chaos
def test_slurm_batch_script_pipelines_across_two_nodes_and_equals_one_process(cluster, tiny_config, tmp_path):
    """run/slurm_pretraining_large.sbatch as sbatch runs it on the first node: srun starts
    run/pretraining_large_multinode.sh on each node with NODE_RANK=$SLURM_NODEID (static rendezvous
    at `scontrol show hostnames`' first node); the user's flags, after the script's, shrink
    gpt2-large to the tiny model and its 8 stages to 2, one per node: a pipeline across the
    network. Its losses are those of the same command in one process."""
    c = cluster(2)

    def user(out: str) -> list[str]:
        return ["--model-config", str(tiny_config), "--max-len", "16", "--layers-per-ipu", "1", "1",
                "--ipus-per-replica", "2", "--replication-factor", "1", "--gradient-accumulation", "4",
                "--batch-size", "2", "--training-steps", "4", "--embedding-serialization-factor", "1",
                "--num-workers", "0", "--checkpoint-output-dir", str(tmp_path / out), "--save-per-steps", "2",
                "--metrics-file", str(tmp_path / f"{out}.jsonl")]

    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
             "SLURM_GPUS_PER_NODE": "1", "SLURM_SUBMIT_DIR": str(ROOT)}
    [(code, out)] = finish([c.nodes[0].popen(["bash", str(SLURM_SCRIPT), *user("job")], cwd=ROOT, env=slurm)])
    assert code == 0, out[-4000:]
    assert re.search(r"Layer 1\s+--> stage 1", out), out[-4000:]  # the stage map: layer 1 on node 1
    # The same command in one process: the script on one node, one process (the stages co-located).
    [(code, one)] = finish([c.nodes[0].popen(["bash", "run/pretraining_large_multinode.sh", "--auto-resume", "true",
                                              "--keep-checkpoints", "3", *user("single")], cwd=ROOT,
                                             env={"NNODES": "1", "NPROC_PER_NODE": "1"})])
    assert code == 0, one[-3000:]
    assert losses(tmp_path / "job.jsonl") == pytest.approx(losses(tmp_path / "single.jsonl"), rel=REL)
    out_dir = tmp_path / "job"
    assert (out_dir / "latest").read_text().strip() == "step_4"
