"""Faults under a running 2-node job (torchrun, c10d rendezvous, one process per namespaced node,
gloo over the nodes' veths), each with the job's outcome:

- a node's processes killed (SIGKILL) mid-run: the survivor names the lost node and rank in one
  line, at once (its connection closes; no wait for the timeout), and the job ends;
- the same with --max-restarts and --auto-resume: torchrun restarts both nodes' workers, they
  continue from the latest checkpoint, and every step's loss equals one process's uninterrupted run;
- preemption, SIGTERM to every process of every node (the scheduler's signal to the job, and
  torchrun's forwarded copy): every rank stops after the same step, one checkpoint is saved, the
  ranks exit 0; the resubmitted job resumes there and its losses equal an uninterrupted run's;
- a link cut (both ends up, nothing gets through) during training: each side names the node(s) it
  lost and the collective timeout in one line, instead of hanging; a slow link and a brief outage
  under the timeout change nothing (the losses equal one process's);
- a save killed mid-write (the writing node's processes killed inside the write): `latest` still
  names the previous checkpoint, which loads, and the resubmitted job resumes from it.

Losses are compared with rel=1e-6 (test_launch_styles.py says why).
"""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster_fixtures import chaos, cluster_fixture, tiny_config_fixture  # noqa: F401  (fixtures)
from jobs import (
    ROOT,
    args,
    finish,
    losses,
    losses_by_step,
    set_flag,
    single_process,
    start_on_nodes,
    torchrun_c10d,
    wait_for,
    worker_pids,
)

from gpt2forge.model import checkpoint as ck
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.train.run_folder import latest_checkpoint

pytestmark = pytest.mark.slow
REL = 1e-6  # test_launch_styles.py says why
TIMEOUT_MIN = "0.2"  # GPT2FORGE_DIST_TIMEOUT_MIN for the jobs that wait for a timeout: 12 s
# Restarted ranks meet again within the collective timeout, and a restart's ranks start seconds apart
# (each node's torchrun notices the failure, stops and starts its worker on its own): the restart
# cases keep a minute.
RESTART_TIMEOUT_MIN = "1"
PROBE = ROOT / "tests" / "cluster" / "train_probe.py"


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1])


def _steps_logged(metrics: Path) -> int:
    return len(losses_by_step(metrics)) if metrics.is_file() else 0


def test_a_killed_node_is_named_by_the_survivor_at_once(cluster, tiny_config, tmp_path):
    c = cluster(2)
    metrics = tmp_path / "job.jsonl"
    argv = set_flag(args(tiny_config), "--training-steps", "100000")
    procs = start_on_nodes(c, [*torchrun_c10d(c), *argv, "--log-steps", "1", "--metrics-file", str(metrics)],
                           env={"GPT2FORGE_DIST_TIMEOUT_MIN": TIMEOUT_MIN})
    try:
        wait_for(lambda: _steps_logged(metrics) >= 2, 120, "two training steps")
        [victim] = worker_pids(c, c.nodes[1])
        lost_rank = _rank_of(victim)
        c.signal_node(c.nodes[1], signal.SIGKILL)  # the node's agent too: the machine is gone
        t0 = time.monotonic()
        (code0, out0), _ = finish(procs, timeout=60)
        ended_s = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert code0 not in (0, None), out0[-3000:]
    errors = [line for line in out0.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out0[-3000:]
    # gloo names the peer whose connection was reset (or, had it not, the check-in at the store would).
    assert re.fullmatch(rf"error: (rank \d: )?on node0 during step \d+ \(update \d+\): (lost the connection to|a "
                        rf"collective failed; not answering:) node1 \(10\.77\.0\.2: rank {lost_rank}\): .* \(.*; "
                        r"collective timeout 12 s, GPT2FORGE_DIST_TIMEOUT_MIN\)", errors[0]), errors[0]
    assert ended_s < 12, ended_s  # a closed connection is seen at once, before the collective timeout


@chaos
def test_a_restarted_job_continues_from_its_checkpoint_with_an_uninterrupted_runs_losses(cluster, tiny_config,
                                                                                          tmp_path):
    c = cluster(2)
    argv = set_flag(args(tiny_config), "--training-steps", "12")
    single = single_process(argv, tmp_path / "single.jsonl")
    out_dir, metrics = tmp_path / "ckpt", tmp_path / "job.jsonl"
    job = [*torchrun_c10d(c, extra=("--max-restarts", "1")), *argv, "--checkpoint-output-dir", str(out_dir),
           "--save-per-steps", "4", "--auto-resume", "true", "--log-steps", "1", "--metrics-file", str(metrics)]
    c.throttle(c.nodes[1], 2000)  # ~0.3 s a step: the kill lands between step 4's checkpoint and the end
    procs = start_on_nodes(c, job, env={"GPT2FORGE_DIST_TIMEOUT_MIN": RESTART_TIMEOUT_MIN})
    try:
        wait_for(lambda: latest_checkpoint(out_dir) is not None, 120, "the first checkpoint")
        killed_after = _steps_logged(metrics)
        for pid in worker_pids(c, c.nodes[1]):
            os.kill(pid, signal.SIGKILL)
        results = finish(procs)
    finally:
        for p in procs:
            p.kill()
    text = "\n".join(out for _, out in results)
    assert [code for code, _ in results] == [0, 0], text[-4000:]
    assert killed_after < 12 and f"auto-resume: continuing from {out_dir}" in text, text[-4000:]
    assert losses(metrics) == pytest.approx(single, rel=REL)


@chaos
def test_a_node_that_never_returns_leaves_the_job_going_on_one_node_with_the_same_losses(cluster, tiny_config,
                                                                                         tmp_path):
    """Elastic torchrun (--nnodes 1:2): node1 dies for good; node0's agent restarts its worker in a
    rendezvous of one node, which continues from the layout-free checkpoint with the 2 replicas as
    gradient accumulation. The data order is the step's, whatever the world: every step's loss
    equals one uninterrupted process's (a sample seen twice or skipped would change the batch of
    every later step)."""
    c = cluster(2)
    argv = set_flag(args(tiny_config), "--training-steps", "12")
    single = single_process(argv, tmp_path / "single.jsonl")
    out_dir, metrics = tmp_path / "ckpt", tmp_path / "job.jsonl"
    elastic = ["torchrun", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"{c.nodes[0].address}:29400", "--rdzv-id", "job", "--rdzv-conf",
               "last_call_timeout=3"]
    job = [*elastic, *argv, "--checkpoint-output-dir", str(out_dir), "--save-per-steps", "4", "--auto-resume",
           "true", "--log-steps", "1", "--metrics-file", str(metrics)]
    c.throttle(c.nodes[1], 2000)  # ~0.3 s a step: node1 dies between step 4's checkpoint and the end
    procs = start_on_nodes(c, job, env={"GPT2FORGE_DIST_TIMEOUT_MIN": RESTART_TIMEOUT_MIN})
    try:
        wait_for(lambda: latest_checkpoint(out_dir) is not None, 120, "the first checkpoint")
        lost_after = _steps_logged(metrics)
        assert worker_pids(c, c.nodes[1])  # node1 has a rank of the job
        c.signal_node(c.nodes[1], signal.SIGKILL)  # agent and worker: the node is gone
        [(code, text)] = finish(procs[:1])
    finally:
        for p in procs:
            p.kill()
    assert code == 0, text[-4000:]
    assert lost_after < 12 and f"auto-resume: continuing from {out_dir}" in text, text[-4000:]
    assert "Distributed:" not in text.split("auto-resume: continuing from")[1]  # one process alone now
    assert losses(metrics) == pytest.approx(single, rel=REL)


@chaos
def test_preemption_of_every_node_saves_once_exits_0_and_the_resubmitted_job_resumes_exactly(cluster, tiny_config,
                                                                                              tmp_path):
    c = cluster(2)
    argv = set_flag(args(tiny_config), "--training-steps", "12")
    single = single_process(argv, tmp_path / "single.jsonl")
    out_dir, metrics, exits = tmp_path / "ckpt", tmp_path / "job.jsonl", tmp_path / "exits"
    exits.mkdir()
    job = [*torchrun_c10d(c), str(PROBE), *argv[1:], "--checkpoint-output-dir", str(out_dir), "--save-per-steps",
           "1000", "--auto-resume", "true", "--log-steps", "1", "--metrics-file", str(metrics)]
    c.throttle(c.nodes[1], 2000)  # ~0.3 s a step: the signal lands mid-run
    procs = start_on_nodes(c, job, env={"G2F_EXIT_DIR": str(exits)})
    try:
        wait_for(lambda: _steps_logged(metrics) >= 2, 120, "two training steps")
        for node in c.nodes:  # as Slurm and PBS do: every process of the job, torchrun's agents included
            c.signal_node(node, signal.SIGTERM)
        results = finish(procs, timeout=90)
    finally:
        for p in procs:
            p.kill()
    text = "\n".join(out for _, out in results)
    assert None not in [code for code, _ in results]  # torchrun's agents end too (1: they were signalled)
    stopped = re.findall(rf"stopped by SIGTERM after step (\d+); saved checkpoint {re.escape(str(out_dir))}/step_(\d+)",
                         text)
    assert len(stopped) == 1 and stopped[0][0] == stopped[0][1], text[-4000:]
    n = int(stopped[0][0])
    assert n < 12 and len(re.findall(r"^saved checkpoint ", text, re.M)) == 1  # saved once
    assert sorted(p.name for p in out_dir.iterdir() if p.name.startswith(("step_", "."))) == [f"step_{n}"]
    assert {f.name: f.read_text() for f in exits.iterdir()} == {"rank0": "0", "rank1": "0"}, text[-4000:]
    # The resubmitted job (the same command) continues from step_N to the end.
    c.heal(c.nodes[1])
    results = finish(start_on_nodes(c, job))
    text = "\n".join(out for _, out in results)
    assert [code for code, _ in results] == [0, 0], text[-4000:]
    assert f"auto-resume: continuing from {out_dir / f'step_{n}'}" in text
    assert losses(metrics) == pytest.approx(single, rel=REL)


@chaos
def test_a_cut_link_is_named_with_the_timeout_on_both_sides_instead_of_a_hang(cluster, tiny_config, tmp_path):
    c = cluster(2)
    metrics = tmp_path / "job.jsonl"
    argv = set_flag(args(tiny_config), "--training-steps", "100000")
    procs = start_on_nodes(c, [*torchrun_c10d(c), *argv, "--log-steps", "1", "--metrics-file", str(metrics)],
                           env={"GPT2FORGE_DIST_TIMEOUT_MIN": TIMEOUT_MIN})
    try:
        wait_for(lambda: _steps_logged(metrics) >= 2, 120, "two training steps")
        c.cut(c.nodes[1])
        t0 = time.monotonic()
        [(code0, out0)] = finish(procs[:1], timeout=60)
        ended_s = time.monotonic() - t0
        # The cut-off node's worker gives up too; its torchrun agent then waits for the rendezvous
        # store it can no longer reach (torchrun's own timeouts), so the test ends it.
        wait_for(lambda: not worker_pids(c, c.nodes[1]), 60, "the cut-off node's worker to exit")
        procs[1].kill()
        [(_, out1)] = finish(procs[1:], timeout=30)
    finally:
        for p in procs:
            p.kill()
    assert code0 not in (0, None), out0[-3000:]
    assert 12 <= ended_s < 12 + 5 + 10, ended_s  # the timeout, the check-in at the store, torchrun's exit
    [error0] = [line for line in out0.splitlines() if line.startswith("error: ")]
    assert re.fullmatch(r"error: (rank \d: )?on node0 during step \d+ \(update \d+\): a collective failed; not "
                        r"answering: node1 \(10\.77\.0\.2: rank \d\): .* \(Timed out waiting 12000ms for \w+ operation "
                        r"to complete; collective timeout 12 s, GPT2FORGE_DIST_TIMEOUT_MIN\)", error0), error0
    [error1] = [line for line in out1.splitlines() if line.startswith("error: ")]
    assert re.fullmatch(r"error: (rank \d: )?on node1 during step \d+ \(update \d+\): a collective failed and the "
                        r"job's store at node0:\d+ does not answer either: this node lost its network, .* \(Timed out "
                        r"waiting 12000ms for \w+ operation to complete; collective timeout 12 s, "
                        r"GPT2FORGE_DIST_TIMEOUT_MIN\)", error1), error1


@chaos
def test_a_slow_link_and_a_brief_outage_under_the_timeout_change_nothing(cluster, tiny_config, tmp_path):
    c = cluster(2)
    argv = set_flag(args(tiny_config), "--training-steps", "12")
    single = single_process(argv, tmp_path / "single.jsonl")
    metrics = tmp_path / "job.jsonl"
    c.throttle(c.nodes[1], 2000)
    procs = start_on_nodes(c, [*torchrun_c10d(c), *argv, "--log-steps", "1", "--metrics-file", str(metrics)],
                           env={"GPT2FORGE_DIST_TIMEOUT_MIN": TIMEOUT_MIN})
    try:
        wait_for(lambda: _steps_logged(metrics) >= 3, 120, "three training steps")
        c.cut(c.nodes[1])
        time.sleep(3)  # nothing gets through for 3 s: TCP retransmits, the collective waits (12 s allowed)
        c.heal(c.nodes[1])
        results = finish(procs)
    finally:
        for p in procs:
            p.kill()
    assert [code for code, _ in results] == [0, 0], "\n".join(out[-3000:] for _, out in results)
    assert losses(metrics) == pytest.approx(single, rel=REL)


@chaos
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_as_latest(cluster, tiny_config, tmp_path):
    c = cluster(2)
    argv = set_flag(args(tiny_config), "--training-steps", "6")
    single = single_process(argv, tmp_path / "single.jsonl")
    out_dir, metrics, marker = tmp_path / "ckpt", tmp_path / "job.jsonl", tmp_path / "hanging"
    job = [*torchrun_c10d(c), str(PROBE), *argv[1:], "--checkpoint-output-dir", str(out_dir), "--save-per-steps",
           "2", "--auto-resume", "true", "--metrics-file", str(metrics)]
    procs = start_on_nodes(c, job, env={"G2F_HANG_IN_SAVE": "step_4", "G2F_HANG_MARKER": str(marker)})
    try:
        wait_for(marker.is_file, 120, "the save of step_4 to be under way")
        [writer] = [n for n in c.nodes if any(_rank_of(p) == 0 for p in worker_pids(c, n))]
        c.signal_node(writer, signal.SIGKILL)  # rank 0's node dies inside the write
        results = finish(procs, timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert None not in [code for code, _ in results]  # the other node's job ended too
    [survivor] = [out for node, (_, out) in zip(c.nodes, results) if node is not writer]
    assert re.search(rf"^error: (rank \d: )?on node\d during .*: (lost the connection to|a collective failed; not "
                     rf"answering:) {writer.name} \({re.escape(writer.address)}: rank 0\)", survivor, re.M), \
        survivor[-3000:]
    half_written = Path(marker.read_text())
    assert half_written.is_dir() and (half_written / "model.safetensors").is_file()  # it was killed mid-save
    assert (out_dir / "latest").read_text().strip() == "step_2" and not (out_dir / "step_4").exists()
    latest = latest_checkpoint(out_dir)
    assert latest == out_dir / "step_2"
    ck.load_weights(GPT2LMHeadModel(ck.load_model_config(latest)), latest)
    # The resubmitted job continues from step_2; the dead save's temporary folder is removed.
    launcher = torchrun_c10d(c)
    results = finish(start_on_nodes(c, [*launcher, "train_gpt2.py", *job[len(launcher) + 1:]]))
    text = "\n".join(out for _, out in results)
    assert [code for code, _ in results] == [0, 0], text[-4000:]
    assert f"auto-resume: continuing from {out_dir / 'step_2'}" in text
    assert not half_written.exists() and (out_dir / "latest").read_text().strip() == "step_6"
    assert losses(metrics) == pytest.approx(single, rel=REL)


@chaos
def test_a_full_shared_disk_stops_the_job_with_one_line_per_rank_and_the_previous_checkpoint_intact(
        cluster, tiny_config, tmp_path):
    """The nodes' checkpoint folder is a 1800 KiB tmpfs (a shared file system that fills up): a save
    asks for 1.53 MB free (400 KB of tensors and files plus a 1 MiB margin for headers), so step_2 is
    written and step_4 finds too little. The save is refused before it writes, every rank stops with
    one line (rank 0's names the bytes needed and free and the last complete checkpoint; exit code 2,
    torchrun's agents 1), and step_2 stays `latest`, whole."""
    c = cluster(2)
    shared = tmp_path / "shared"
    shared.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1800k", "tmpfs", str(shared)], check=True, timeout=30)
    try:
        out_dir = shared / "ckpt"
        argv = set_flag(args(tiny_config), "--training-steps", "6")
        results = finish(start_on_nodes(c, [*torchrun_c10d(c), *argv, "--checkpoint-output-dir", str(out_dir),
                                            "--save-per-steps", "2", "--metrics-file", str(tmp_path / "job.jsonl")]))
        errors = [line for _, out in results for line in out.splitlines() if line.startswith("error: ")]
        assert [code for code, _ in results] == [1, 1] and len(errors) == 2, "\n".join(o[-3000:] for _, o in results)
        [rank0] = [e for e in errors if not e.startswith("error: rank ")]
        assert f"{out_dir / 'step_4'}" in rank0 and "not enough free space" in rank0 and "step_2" in rank0, rank0
        assert "error: rank 1: rank 0 could not save the checkpoint; its error says why" in errors
        assert (out_dir / "latest").read_text().strip() == "step_2"
        assert sorted(p.name for p in out_dir.iterdir() if p.name.startswith(("step_", "."))) == ["step_2"]
        ck.load_weights(GPT2LMHeadModel(ck.load_model_config(out_dir / "step_2")), out_dir / "step_2")
    finally:
        subprocess.run(["umount", str(shared)], timeout=30)
