"""One device, bigger models: `--offload none|optimizer|full` and one-process ZeRO-3 (FSDP2 over a
world of one with its CPU offload policy). On the CPU the offload moves nothing but runs FSDP2's
code path: its step lines equal a plain run's, it resumes exactly, and its checkpoint continues in a
plain run and in a 2-process ZeRO-2 run. Too little host memory for the offloaded state is one line,
exit code 2, before the model is built. The GPU check runs where a GPU is."""

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import run  # the torchrun harness (pytest puts tests/parallel on the path)

import gpt2forge.parallel.memory_plan as memory_plan
import gpt2forge.train.setup as setup
from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops.lm_head_loss import LossChunking
from gpt2forge.parallel.distributed import (
    DistEnv,
    full_tensor,
    init_single_process_group,
    requested_zero_stage,
    resolve_zero_stage,
    shard_model,
    shutdown,
)
from gpt2forge.parallel.topology import ParallelArgs

STEP = re.compile(r"^(step \d+ of epoch \d+, loss: \S+, acc: \S+, lr: \S+),.* grad norm: (\S+)$")


@pytest.fixture()
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def args(cfg: Path, *extra: str) -> list[str]:
    """6 host steps of 2 replicas x 2 micro-batches (one process: accumulation 4), AdamW with decay and clipping."""
    return ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--gradient-accumulation", "2", "--replication-factor", "2", "--device-iterations", "1",
            "--training-steps", "6", "--num-workers", "0", "--learning-rate", "3e-3", "--lr-schedule", "cosine",
            "--optimizer", "AdamW", "--weight-decay", "0.1", "--max-grad-norm", "1.0", *extra]


def train(capsys, argv: list[str]) -> tuple[list[str], list[float], str]:
    """(step lines up to the learning rate, logged gradient norms, whole output) of an in-process run."""
    capsys.readouterr()
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    matches = [m for line in out.splitlines() if (m := STEP.match(line))]
    return [m.group(1) for m in matches], [float(m.group(2)) for m in matches], out


@pytest.mark.parametrize("flags, mode", [
    ((), "none"),
    (("--optimizer-state-offchip", "true"), "optimizer"),
    (("--offload", "optimizer", "--optimizer-state-offchip", "true"), "optimizer"),
    (("--offload", "full"), "full"),
    (("--offload", "full", "--optimizer-state-offchip", "true"), "full"),
    (("--offload", "none", "--optimizer-state-offchip", "false"), "none"),
])
def test_offload_vocabulary(flags, mode):
    assert parse_args(["--dataset", "generated", *flags]).memory.offload_mode == mode


@pytest.mark.parametrize("flags", [
    ("--offload", "none", "--optimizer-state-offchip", "true"),
    ("--offload", "full", "--optimizer-state-offchip", "false"),
    ("--offload", "optimizer", "--optimizer-state-offchip", "false"),
])
def test_contradicting_offload_flags_are_one_line_naming_both(flags):
    with pytest.raises(UsageError, match=r"--offload \w+ contradicts --optimizer-state-offchip") as err:
        parse_args(["--dataset", "generated", *flags])
    assert "\n" not in str(err.value)


def test_zero_stage_follows_the_offload():
    one = DistEnv()
    assert requested_zero_stage(ParallelArgs(), "full") == 3
    assert resolve_zero_stage(ParallelArgs(), one, "full") == 3  # FSDP2 over a world of one
    assert resolve_zero_stage(ParallelArgs(zero_stage=2), one, "full") == 2
    # one process without full offload: nothing to shard
    assert resolve_zero_stage(ParallelArgs(zero_stage=3), one, "optimizer") == 0
    assert resolve_zero_stage(ParallelArgs(zero_stage=3), DistEnv(0, 0, 2), "none") == 3
    with pytest.raises(UsageError, match="--offload full .* needs --zero-stage 2 or 3, not --zero-stage 1"):
        requested_zero_stage(ParallelArgs(zero_stage=1), "full")


def test_full_offload_in_one_process_equals_a_plain_run_and_resumes_in_any_layout(tiny_config, tmp_path, capsys):
    plain, plain_norms, _ = train(capsys, args(tiny_config))
    assert len(plain) == 6
    ckpt = tmp_path / "full"
    full, full_norms, out = train(capsys, args(tiny_config, "--offload", "full", "--checkpoint-output-dir", str(ckpt),
                                               "--save-per-steps", "3"))
    assert "Distributed: one process (a world of one for FSDP2), backend gloo" in out
    assert not dist.is_initialized()  # the run's own process group is gone
    assert full == plain  # fp32: the same step lines (4 decimals), gradient norms within rounding
    assert full_norms == pytest.approx(plain_norms, rel=1e-5)
    resume = ["--checkpoint-input-dir", str(ckpt / "step_3"), "--resume-training-from-checkpoint", "true"]
    assert train(capsys, args(tiny_config, "--offload", "full", *resume))[0] == plain[3:]
    assert train(capsys, args(tiny_config, *resume))[0] == plain[3:]


def test_full_offload_composes_with_bf16_and_recomputation(tiny_config, capsys):
    """FSDP2 gathers bf16 copies and reduces in fp32, blocks recompute: one plain bf16 run's losses within 2e-3."""
    bf16 = ("--precision", "bf16", "--training-steps", "4")
    plain = [float(line.split("loss: ")[1].split(",")[0]) for line in train(capsys, args(tiny_config, *bf16))[0]]
    full = train(capsys, args(tiny_config, *bf16, "--offload", "full", "--recompute-checkpoint-every-layer", "true"))[0]
    assert [float(line.split("loss: ")[1].split(",")[0]) for line in full] == pytest.approx(plain, abs=2e-3)
    assert len(full) == 4


@pytest.mark.slow
def test_full_offload_checkpoint_continues_under_two_process_zero2(tiny_config, tmp_path, capsys):
    plain = train(capsys, args(tiny_config))[0]
    ckpt = tmp_path / "full"
    train(capsys, args(tiny_config, "--offload", "full", "--checkpoint-output-dir", str(ckpt), "--save-per-steps", "3"))
    resume = ["--checkpoint-input-dir", str(ckpt / "step_3"), "--resume-training-from-checkpoint", "true"]
    assert run(["train_gpt2.py", *args(tiny_config, "--zero-stage", "2", *resume)], nproc=2) == plain[3:]


def test_too_little_host_memory_is_one_line_before_the_model_is_built(make_tiny_config, monkeypatch, capsys):
    # GPT-3's shape: its offloaded state (16 bytes a parameter, ~2.8 TB) exceeds any host here.
    huge = make_tiny_config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, vocab_size=50257)
    monkeypatch.setattr(setup, "build_model", lambda *a: pytest.fail("the model was built"))
    assert train_main(["--model-config", str(huge), "--dataset", "generated", "--offload", "full"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1, err
    figures = re.search(r"^error: --offload full: the offloaded state needs ([\d.]+) GiB of host memory but "
                        r"([\d.]+) GiB is available; .*--offload none", err[0])
    assert figures and float(figures.group(1)) > float(figures.group(2)), err[0]
    assert float(figures.group(1)) == pytest.approx(16 * 174.6e9 / 2**30, rel=0.01)


def test_optimizer_offload_checks_the_host_too(tiny_config, monkeypatch, capsys):
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: 1000.0)
    monkeypatch.setattr(setup, "build_model", lambda *a: pytest.fail("the model was built"))
    assert train_main(args(tiny_config, "--optimizer-state-offchip", "true")) == 2
    assert "error: --offload optimizer: the offloaded state needs 0.0 GiB" in capsys.readouterr().err


def test_available_host_memory_is_a_figure():
    assert memory_plan.available_host_memory() > 2**20


@pytest.mark.cuda
@pytest.mark.slow
def test_full_offload_on_cuda_follows_the_device_run(make_tiny_config):
    """On a GPU the parameters, gradients and Adam state live in pinned host memory and stream to
    the device block by block: the losses follow a plain GPU run's (fp32)."""
    from test_cuda import GPUS, gpu_train  # the GPU child-process harness (tests/ is on the path, as for conftest)

    if GPUS == 0:
        pytest.skip("no CUDA GPU")
    cfg = make_tiny_config(n_positions=64, n_embd=64, n_head=4, vocab_size=512, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0)
    fp32 = ("--precision", "fp32", "--torch-compile", "false")
    plain = gpu_train(cfg, *fp32)
    full = gpu_train(cfg, *fp32, "--offload", "full")
    assert len(full) == len(plain) == 30
    assert [loss for loss, _ in full] == pytest.approx([loss for loss, _ in plain], abs=2e-3)
    bf16 = gpu_train(cfg, "--precision", "bf16", "--offload", "full", "--recompute-checkpoint-every-layer", "true")
    assert bf16[-1][0] < bf16[0][0]  # bf16 with recomputation trains


def test_full_offload_hands_fsdp2_no_view_and_the_gradients_of_a_plain_model(recwarn):
    """The root's output (the fused loss) is no view of another tensor: FSDP2 warned "returned a view
    tensor" once per forward (issue 46 item 8). Its gradients equal the unsharded model's."""
    warnings.simplefilter("always")
    plain = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    plain.init_weights(torch.Generator().manual_seed(0))
    plain.fused_loss = LossChunking()
    sharded = copy.deepcopy(plain)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    plain(ids, labels).loss_sum.backward()
    init_single_process_group(torch.device("cpu"))
    try:
        shard_model(sharded, 3, offload=True, device=torch.device("cpu"))
        sharded(ids, labels).loss_sum.backward()
        grads = {n: full_tensor(p.grad) for n, p in sharded.named_parameters()}
    finally:
        shutdown()
    assert not [w for w in recwarn if "returned a view tensor" in str(w.message)]
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
