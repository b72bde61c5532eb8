"""Data parallelism over torch.distributed (gloo on CPU, launched with torchrun): the same losses as
one process with the same global batch, ZeRO-1, checkpoints that resume under another layout, the
launcher scripts, and layout errors before any process group work."""

import contextlib
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.parallel.distributed import DistEnv, check_world
from gpt2forge.parallel.topology import build_layout

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^(step \d+ of epoch \d+, loss: \S+, acc: \S+, lr: \S+),")


@pytest.fixture()
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def args(cfg: Path, *extra: str) -> list[str]:
    return ["train_gpt2.py", "--model-config", str(cfg), "--dataset", "generated", "--max-len", "16",
            "--batch-size", "2", "--gradient-accumulation", "2", "--device-iterations", "1", "--training-steps",
            "4", "--num-workers", "0", "--learning-rate", "3e-3", "--lr-schedule", "cosine", "--optimizer", "LAMB",
            "--max-grad-norm", "1.0", "--replication-factor", "2", "--replicated-tensor-sharding", "true", *extra]


def run(argv: list[str], nproc: int = 1, grad_norms: list[float] | None = None) -> list[str]:
    """The step lines up to the learning rate (the timing-free part); `grad_norms` collects the
    logged global gradient norms."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    proc = subprocess.run([sys.executable, *launcher, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if grad_norms is not None:
        grad_norms += [float(n) for n in re.findall(r"grad norm: (\S+)$", proc.stdout, re.M)]
    return [m.group(1) for line in proc.stdout.splitlines() if (m := STEP.match(line))]


@pytest.mark.slow
def test_two_replicas_with_zero1_equal_one_process_and_resume_in_another_layout(tiny_config, tmp_path):
    # One process: the 2 replicas become gradient accumulation 2 x 2 (same global batch of 8).
    single = run(args(tiny_config))
    assert len(single) == 4
    # Two processes (DDP + ZeRO-1 sharded LAMB state), checkpoint after step 2.
    ckpt = tmp_path / "dp"
    dp = run(args(tiny_config, "--checkpoint-output-dir", str(ckpt), "--save-per-steps", "2"), nproc=2)
    assert dp == single
    # Resume the 2-process run's checkpoint in one process: the same optimization continues.
    resumed = run(args(tiny_config, "--checkpoint-input-dir", str(ckpt / "step_2"),
                       "--resume-training-from-checkpoint", "true"))
    assert resumed == single[2:]


@pytest.mark.slow
def test_replicas_resume_with_their_own_dropout_streams(make_tiny_config, tmp_path):
    """With dropout, a 2-replica run resumed from its checkpoint continues exactly: every rank saves
    and restores its own random state (rank 0's for all would give both replicas the same masks)."""
    cfg = make_tiny_config(n_positions=32, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    ckpt = tmp_path / "dp"
    full = run(args(cfg, "--checkpoint-output-dir", str(ckpt), "--save-per-steps", "2"), nproc=2)
    resumed = run(args(cfg, "--checkpoint-input-dir", str(ckpt / "step_2"), "--resume-training-from-checkpoint",
                       "true"), nproc=2)
    assert len(full) == 4 and resumed == full[2:]


@pytest.mark.slow
def test_zero_2_and_3_equal_one_process_and_resume_across_stages(tiny_config, tmp_path):
    single = run(args(tiny_config, "--weight-decay", "0.1"))
    ckpt = tmp_path / "zero3"
    zero3 = run(args(tiny_config, "--weight-decay", "0.1", "--zero-stage", "3", "--checkpoint-output-dir", str(ckpt),
                     "--save-per-steps", "2"), nproc=2)
    assert zero3 == single
    resume = ["--checkpoint-input-dir", str(ckpt / "step_2"), "--resume-training-from-checkpoint", "true"]
    assert run(args(tiny_config, "--weight-decay", "0.1", "--zero-stage", "2", *resume), nproc=2) == single[2:]
    assert run(args(tiny_config, "--weight-decay", "0.1", *resume)) == single[2:]
    # bf16: FSDP2 gathers bf16 copies of the shards and reduces gradients in fp32 (MixedPrecisionPolicy).
    bf16 = ["--weight-decay", "0.1", "--precision", "bf16"]
    expected = [loss_of(line) for line in run(args(tiny_config, *bf16))]
    got = [loss_of(line) for line in run(args(tiny_config, *bf16, "--zero-stage", "3"), nproc=2)]
    assert got == pytest.approx(expected, abs=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,zero", [("AdamW", "1"), ("LAMB", "1"), ("AdamW", "3")])
def test_zero_with_offloaded_state_equals_plain_updates_and_resumes(optimizer, zero):
    """--optimizer-state-offchip with ZeRO-1 (each replica keeps its shard's state on the host) and
    ZeRO-3 (FSDP2 CPU offload): tests/parallel/_zero_offload_worker.py checks updates, checkpoint state, resume."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "parallel" / "_zero_offload_worker.py"), optimizer, zero], cwd=ROOT,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_preflight_names_a_rank_that_does_not_arrive():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(ROOT / "tests" / "parallel" / "_health_worker.py")]
    ok = subprocess.run([*torchrun, "0", "30"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "Preflight: 2 ranks passed a barrier and an all-reduce over gloo" in ok.stdout
    late = subprocess.run([*torchrun, "6", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert late.returncode != 0
    errors = [line for line in late.stderr.splitlines() if line.startswith("error: preflight on rank 0")]
    assert len(errors) == 1 and "Ranks 1 failed to pass monitoredBarrier" in errors[0], late.stderr[-2000:]


@pytest.mark.slow
def test_watchdog_dumps_stacks_and_exits_when_training_stalls():
    code = ("import time\nfrom gpt2forge.parallel.health import Watchdog\n"
            "w = Watchdog('rank 3 (pipeline stage 1)', timeout_s=0.5)\n"
            "w.kick('step 7 (update 7)')\n"
            "with w.paused():\n    time.sleep(1.5)\n"  # paused: no exit
            "def stuck_in_the_data_loader():\n    time.sleep(30)\n"
            "stuck_in_the_data_loader()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("error: rank 3 (pipeline stage 1): no progress for 0.5 s during step 7 (update 7)")
    assert any("stuck_in_the_data_loader" in line for line in lines[1:])


def _pid_of_rank(rank: int) -> int | None:
    """The torchrun worker process whose environment says RANK=rank."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in environ):
            return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the worker")
def test_a_rank_that_dies_ends_the_job_promptly_naming_it(tiny_config):
    argv = args(tiny_config)
    argv[argv.index("--training-steps") + 1] = "100000"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             *argv], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert any(line.startswith("step ") for line in proc.stdout), "training never started"
        pid = _pid_of_rank(1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)  # promptly: no hang in a collective
    finally:
        proc.kill()
    assert proc.returncode != 0
    # torchrun's summary lists rank 1's SIGKILL (as root cause, or among the failures when rank 0's own
    # exit fell in the same second), and rank 0's one line names rank 1 as the one lost.
    summary = err.split("FAILED", 1)[1]
    # torch 2.13 names the signal on the exitcode line, 2.11 on the traceback line below it.
    assert re.search(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : -9 ", summary) and "SIGKILL" in summary, summary
    assert re.search(r"^error: on \S+ during step \d+ .*: lost the connection to \S+ \([^:]+: rank 1\)", err, re.M)


@pytest.mark.slow
def test_a_restarted_job_continues_from_its_latest_checkpoint(tiny_config, tmp_path):
    """MAX_RESTARTS through run/launch.sh with --auto-resume: rank 1 is killed after a checkpoint,
    torchrun restarts both workers, they continue from the latest checkpoint and end where an
    uninterrupted run ends."""
    def launch(out: Path, kill_after: Path | None = None) -> tuple[int, str]:
        argv = args(tiny_config, "--checkpoint-output-dir", str(out), "--save-per-steps", "40", "--log-steps", "40",
                    "--auto-resume", "true", "--keep-checkpoints", "2", "--save-per-epochs", "1000")
        argv[argv.index("--training-steps") + 1] = "240"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NNODES")}
        env.update(MAX_RESTARTS="1", NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PYTHON=sys.executable)
        proc = subprocess.Popen(["bash", "-c", "source run/launch.sh; launch " + " ".join(argv)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if kill_after is not None:
            deadline = time.monotonic() + 300
            while not (kill_after / "config.json").is_file() and time.monotonic() < deadline:
                time.sleep(0.2)
            os.kill(_pid_of_rank(1), signal.SIGKILL)
        out_text, _ = proc.communicate(timeout=600)
        return proc.returncode, out_text

    code, uninterrupted = launch(tmp_path / "a")
    assert code == 0, uninterrupted[-3000:]
    code, restarted = launch(tmp_path / "b", kill_after=tmp_path / "b" / "step_80")
    assert code == 0, restarted[-3000:]
    assert "auto-resume: continuing from" in restarted
    after = [m.group(1) for line in restarted.split("auto-resume: continuing from", 1)[1].splitlines()
             if (m := STEP.match(line))]
    expected = [m.group(1) for line in uninterrupted.splitlines() if (m := STEP.match(line))]
    assert after and after == expected[-len(after):]
    assert sorted(d.name for d in (tmp_path / "b").iterdir() if d.is_dir()) == ["step_200", "step_240"]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_with_the_stacks_of_the_one_waiting(tiny_config):
    """Rank 1 (pipeline stage 1) is stopped mid-training: rank 0's watchdog sees no progress (it waits
    for stage 1's gradients) and exits with its stacks instead of hanging until the collective timeout."""
    argv = pipeline_args(tiny_config)
    argv[argv.index("--training-steps") + 1] = "100000"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", GPT2FORGE_HANG_TIMEOUT_MIN="0.05")  # 3 s
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        assert any(line.startswith("step ") for line in proc.stdout), "training never started"
        pid = _pid_of_rank(1)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(pid, signal.SIGCONT)  # let torchrun's SIGTERM end it
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert proc.returncode != 0
    fired = err.split("error: rank 0 (pipeline stage 0): no progress for 3 s during step ", 1)
    assert len(fired) == 2, err[-3000:]
    assert "in _loop" in fired[1] and "Root Cause" in err


def pipeline_args(cfg: Path, *extra: str) -> list[str]:
    """2 stages (one block each) x 2 replicas with ZeRO-1 across them, AdamW with weight decay and clipping."""
    argv = args(cfg, "--layers-per-ipu", "1", "1", "--ipus-per-replica", "2", *extra)
    argv[argv.index("--optimizer") + 1] = "AdamW"
    return argv + ["--weight-decay", "0.1"]


@pytest.mark.slow
def test_pipeline_schedules_equal_one_process_and_resume_in_other_layouts(tiny_config, tmp_path):
    # One process: both stages co-located, the 2 replicas as gradient accumulation (global batch 8).
    single_norms, pipelined_norms = [], []
    single = run(pipeline_args(tiny_config), grad_norms=single_norms)
    assert len(single) == 4 and len(single_norms) == 4
    # 2 stages x 2 replicas (ZeRO-1 within each stage), 1F1B, checkpoint after step 2. The losses equal
    # one process's only if the tied embedding gets the head's gradient (summed between the first and the
    # last stage); every save
    # also checks that the last stage's head copy equals stage 0's embedding (Pipeline._check_tied_copies).
    ckpt = tmp_path / "pp"
    one_f_one_b = run(pipeline_args(tiny_config, "--pipeline-schedule", "1F1B", "--checkpoint-output-dir", str(ckpt),
                                    "--save-per-steps", "2"), nproc=4, grad_norms=pipelined_norms)
    assert one_f_one_b == single
    # The logged norm is the whole model's: summed over stages, the tied embedding counted once.
    assert pipelined_norms == pytest.approx(single_norms, rel=1e-3)
    # 2 stages x 1 replica (the missing replica becomes accumulation), GPipe, resumed from that checkpoint.
    resume = ["--checkpoint-input-dir", str(ckpt / "step_2"), "--resume-training-from-checkpoint", "true"]
    assert run(pipeline_args(tiny_config, "--pipeline-schedule", "GPipe", *resume), nproc=2) == single[2:]
    # And in one process.
    assert run(pipeline_args(tiny_config, *resume)) == single[2:]
    # ZeRO-3 inside the stages (FSDP2 across each stage's 2 replicas), then resumed under ZeRO-2 and GPipe.
    zero = tmp_path / "pp_zero3"
    assert run(pipeline_args(tiny_config, "--zero-stage", "3", "--checkpoint-output-dir", str(zero),
                             "--save-per-steps", "2"), nproc=4) == single
    resume = ["--checkpoint-input-dir", str(zero / "step_2"), "--resume-training-from-checkpoint", "true"]
    assert run(pipeline_args(tiny_config, "--zero-stage", "2", "--pipeline-schedule", "GPipe", *resume),
               nproc=4) == single[2:]
    # Stages compiled (torch.compile per block): the same losses up to compiled rounding.
    compiled = run(pipeline_args(tiny_config, "--torch-compile", "true"), nproc=2)
    assert [loss_of(line) for line in compiled] == pytest.approx([loss_of(line) for line in single], abs=2e-3)


@pytest.mark.slow
def test_four_stages_by_two_replicas_resume_in_one_process_and_in_two_stages(tiny_config, tmp_path):
    """The issue's layout test: 8 processes (4 stages, two of them without blocks, x 2 replicas with
    ZeRO-1) equal one process, and their checkpoint continues the same optimization in one process
    (no stages) and in 2 stages."""
    def layout(*extra: str) -> list[str]:
        argv = pipeline_args(tiny_config, *extra)
        argv[argv.index("--gradient-accumulation") + 1] = "4"
        return argv

    four = ["--layers-per-ipu", "0", "1", "1", "0", "--ipus-per-replica", "4"]
    single = run(layout(*four))
    ckpt = tmp_path / "pp42"
    assert run(layout(*four, "--checkpoint-output-dir", str(ckpt), "--save-per-steps", "2"), nproc=8) == single
    resume = ["--checkpoint-input-dir", str(ckpt / "step_2"), "--resume-training-from-checkpoint", "true"]
    plain = layout(*resume)
    del plain[plain.index("--layers-per-ipu"):plain.index("--layers-per-ipu") + 5]  # pipeline_args' 2 stages
    assert run(plain) == single[2:]
    assert run(layout(*resume), nproc=2) == single[2:]


@pytest.mark.slow
def test_pipelined_validation_runs_through_the_pipeline_and_equals_one_process(tiny_config, tmp_path):
    """Validation of a 2-stage x 2-replica run goes through the schedule's forward-only pass (7
    held-out windows: the replicas' last micro-batches are padded with unscored rows)."""
    docs = tmp_path / "docs.pkl"
    docs.write_bytes(pickle.dumps([[(i * 7 + j) % 96 for j in range(40 + i)] for i in range(60)]))
    argv = pipeline_args(tiny_config, "--dataset", "pickle", "--input-files", str(docs), "--val-num", "7",
                         "--stride", "16", "--eval-every-steps", "2")
    out = []
    for nproc in (1, 4):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
        proc = subprocess.run([sys.executable, *launcher, *argv], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append([line for line in proc.stdout.splitlines() if line.startswith("validation after step")])
    assert len(out[0]) == 2 and out[1] == out[0]


def loss_of(step_line: str) -> float:
    return float(step_line.split("loss: ")[1].split(",")[0])


def test_pipeline_layout_errors_before_process_groups():
    check_world(DistEnv(0, 0, 4), 2, stages=2)  # 2 stages x 2 replicas
    check_world(DistEnv(0, 0, 1), 2, stages=4)  # fewer processes than stages: co-located
    with pytest.raises(UsageError, match="3 processes cannot hold 2 pipeline stages"):
        check_world(DistEnv(0, 0, 3), 2, stages=2)
    with pytest.raises(UsageError, match="--replication-factor 3 is not a multiple of the 2 replicas"):
        check_world(DistEnv(0, 0, 4), 3, stages=2)


def test_1f1b_needs_a_micro_batch_per_stage():
    cfg = parse_args(["--dataset", "generated", "--layers-per-ipu", "1", "1", "--ipus-per-replica", "2"]).parallel
    build_layout(cfg, 2, world_size=1)  # co-located stages: no schedule
    with pytest.raises(UsageError, match="--pipeline-schedule 1F1B needs at least one micro-batch per stage"):
        build_layout(cfg, 2, world_size=2)
    build_layout(parse_args(["--dataset", "generated", "--layers-per-ipu", "1", "1", "--ipus-per-replica", "2",
                             "--pipeline-schedule", "GPipe"]).parallel, 2, world_size=2)


def test_1f1b_counts_the_micro_batches_of_folded_in_replicas():
    """Issue 46 item 10: 2 stages in 2 processes of a 2-replica layout run the missing replica as a second
    micro-batch, which 1F1B needs; the check looked at --gradient-accumulation 1 alone and refused."""
    flags = ["--dataset", "generated", "--layers-per-ipu", "1", "1", "--ipus-per-replica", "2"]
    folded = parse_args([*flags, "--replication-factor", "2"]).parallel
    assert build_layout(folded, 2, world_size=2).pipelined
    with pytest.raises(UsageError, match=r"--gradient-accumulation 1 \(2 with the missing replicas folded in\) < 3"):
        build_layout(parse_args(["--dataset", "generated", "--layers-per-ipu", "0", "1", "1", "--ipus-per-replica",
                                 "3", "--replication-factor", "2"]).parallel, 2, world_size=3)
    with pytest.raises(UsageError, match=r"--gradient-accumulation 1 < 2 stages"):  # both replicas present
        build_layout(folded, 2, world_size=4)


@pytest.mark.slow
def test_1f1b_with_a_folded_in_replica_equals_one_process(tiny_config):
    """The smallest shape of that layout, run: 2 stages x 1 process of 2 replicas, 1F1B over the 2
    micro-batches, gives one process's step lines."""
    def layout(*extra: str) -> list[str]:
        argv = pipeline_args(tiny_config, "--pipeline-schedule", "1F1B", *extra)
        argv[argv.index("--gradient-accumulation") + 1] = "1"
        argv[argv.index("--training-steps") + 1] = "2"
        return argv

    single = run(layout())
    assert len(single) == 2 and run(layout(), nproc=2) == single


def test_layout_that_does_not_divide_the_world_is_refused_before_process_groups():
    check_world(DistEnv(0, 0, 1), 3)  # one process: replicas become accumulation
    check_world(DistEnv(1, 1, 2), 4)
    with pytest.raises(UsageError, match="--replication-factor 3 is not a multiple of the 2 processes"):
        check_world(DistEnv(0, 0, 2), 3)


@pytest.mark.slow
def test_bad_world_exits_2_with_one_line(tiny_config):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # nothing listens there: reaching process-group setup would hang or fail
    argv = args(tiny_config)
    argv[argv.index("--replication-factor") + 1] = "3"
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --replication-factor 3 is not a multiple")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("env,expected", [
    ({}, ["--standalone", "--nproc_per_node", "1"]),
    ({"NPROC_PER_NODE": "4"}, ["--standalone", "--nproc_per_node", "4"]),
    ({"NPROC_PER_NODE": "4", "MAX_RESTARTS": "3"}, ["--standalone", "--max_restarts", "3", "--nproc_per_node", "4"]),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "NPROC_PER_NODE": "8"},
     ["--nnodes", "2", "--node_rank", "1", "--master_addr", "node0", "--master_port", "29400",
      "--nproc_per_node", "8"]),
    ({"NNODES": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "NPROC_PER_NODE": "8"},
     ["--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "node0:29400",
      "--rdzv_id", "gpt2forge", "--nproc_per_node", "8"]),
])
def test_launcher_builds_a_torchrun_command_that_torchrun_parses(env, expected):
    clean = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MAX_RESTARTS")}
    out = subprocess.run(["bash", "-c", "source run/launch.sh; launch train_gpt2.py --model gpt2"], cwd=ROOT,
                         env={**clean, "PYTHON": "echo", **env}, capture_output=True, text=True, check=True).stdout
    argv = out.split()
    assert argv[:2] == ["-m", "torch.distributed.run"] and argv[2:-3] == expected
    parsed = get_args_parser().parse_args(argv[2:])
    assert parsed.training_script == "train_gpt2.py" and parsed.training_script_args == ["--model", "gpt2"]


@pytest.mark.slow
@pytest.mark.parametrize("node_ranks", [True, False])
def test_two_nodes_through_the_launcher_equal_one_process(tiny_config, node_ranks):
    """Two torchrun agents ("nodes", one process each) meet on this host, as run/launch.sh starts
    them on every node: with NODE_RANK in the static rendezvous (rank 0, the one that logs, on
    node 0), without it in c10d's. The job's step lines are one process's."""
    single = run(args(tiny_config))
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env.update(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=f"test{port}",
               NPROC_PER_NODE="1", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    command = "source run/launch.sh; launch " + " ".join(args(tiny_config))
    nodes = [subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**env, "NODE_RANK": str(n)} if node_ranks else env, text=True) for n in range(2)]
    outs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    steps = [[m.group(1) for line in out.splitlines() if (m := STEP.match(line))] for out, _ in outs]
    assert (steps if node_ranks else sorted(steps, key=len, reverse=True)) == [single, []]  # rank 0's node logs


def test_every_pretraining_script_uses_the_launcher():
    for script in sorted((ROOT / "run").glob("pretraining_*.sh")):
        text = script.read_text()
        if "\n# Stand-in:" in text:  # a reference name that only says where it went (tests/seeds)
            continue
        assert "source run/launch.sh" in text and "launch train_gpt2.py" in text, script.name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kfac_under_two_replicas_equals_one_process(tiny_config, method):
    """K-FAC's distributed path (factors all-reduced, each decomposition computed on one rank and
    broadcast) gives the step lines of one process with the same global batch. (It caught the
    eigenvectors arriving transposed: eigh's Q is column-major, a broadcast sends the storage.)"""
    kfac = ["--kfac", "true", "--kfac-factor-update-steps", "1", "--kfac-inv-update-steps", "2",
            "--kfac-compute-method", method, "--replicated-tensor-sharding", "false", "--optimizer", "AdamW"]
    single = run(args(tiny_config, *kfac))
    assert len(single) == 4
    assert run(args(tiny_config, *kfac), nproc=2) == single
