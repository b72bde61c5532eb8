"""CUDA checks: the fused loss, generation with CUDA graphs, bf16 + compile training, optimizer
offload, and NCCL data parallelism. The rest of the suite hides GPUs (conftest.py); these run in
child processes that see the host's GPUs, and skip where there is none (CI never has one)."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import HOST_CUDA_VISIBLE_DEVICES

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^step \d+ of epoch \d+, loss: (\S+), acc: \S+, lr: \S+, .* MFU: (\S+),")


def _gpu_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE")}
    if HOST_CUDA_VISIBLE_DEVICES is not None:
        env["CUDA_VISIBLE_DEVICES"] = HOST_CUDA_VISIBLE_DEVICES
    return env


def _gpu_count() -> int:
    if not (Path("/dev/nvidiactl").exists() or Path("/dev/dxg").exists()):
        return 0  # no NVIDIA driver: skip without starting a process
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         env=_gpu_env(), capture_output=True, text=True)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


GPUS = _gpu_count()
# cuda: needs a GPU (the skip below); slow: every test starts a process that trains or compiles.
pytestmark = [pytest.mark.cuda, pytest.mark.slow, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]


def gpu_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=_gpu_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def gpu_train(cfg: Path, *extra: str, nproc: int = 1) -> list[tuple[float, str]]:
    """(loss, MFU text) per step line of a tiny training run on the GPU(s)."""
    argv = ["train_gpt2.py", "--model-config", str(cfg), "--dataset", "generated", "--max-len", "64",
            "--batch-size", "4", "--gradient-accumulation", "2", "--device-iterations", "1", "--training-steps",
            "30", "--num-workers", "0", "--learning-rate", "3e-3", "--device", "cuda", *extra]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    proc = subprocess.run([sys.executable, *launcher, *argv], cwd=ROOT, env=_gpu_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [(float(m.group(1)), m.group(2)) for line in proc.stdout.splitlines() if (m := STEP.match(line))]


@pytest.fixture()
def cfg(make_tiny_config) -> Path:
    return make_tiny_config(n_positions=64, n_embd=64, n_head=4, vocab_size=512, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)


def test_fused_loss_on_cuda_matches_plain_cross_entropy():
    gpu_python("""
        import torch, torch.nn.functional as F
        from gpt2forge.ops.lm_head_loss import LossChunking, fused_lm_head_loss
        g = torch.Generator().manual_seed(0)
        V, C, N = 1000, 64, 300
        cases = [(torch.float32, 1e-4, LossChunking()), (torch.bfloat16, 2e-2, LossChunking()),
                 (torch.bfloat16, 2e-2, LossChunking(128)), (torch.bfloat16, 2e-2, LossChunking(64, 3))]
        for dtype, tol, chunking in cases:  # one chunk; row chunks; rows and vocabulary chunks
            h = torch.randn(N, C, generator=g).cuda().requires_grad_()
            W = (torch.randn(1024, C, generator=g) * 0.1).cuda().requires_grad_()
            y = torch.randint(0, V, (N,), generator=g).cuda()
            y[::7] = -100
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = fused_lm_head_loss(h, W, y, V, -100, chunking)[0]
            loss.backward()
            got = (loss.detach(), h.grad.clone(), W.grad.clone())
            h.grad = W.grad = None
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                logits = (h @ W.T)[:, :V]
            ref = F.cross_entropy(logits.float(), y, reduction="sum", ignore_index=-100)
            ref.backward()
            for a, b in zip(got, (ref.detach(), h.grad, W.grad)):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, float(b.abs().max())))
    """)


def test_cuda_graph_generation_equals_eager_and_the_full_forward():
    gpu_python("""
        import torch
        from gpt2forge.model.config import ModelConfig
        from gpt2forge.generate.generator import Generator
        from gpt2forge.model.gpt2 import GPT2LMHeadModel
        from gpt2forge.generate.sampling import SamplingConfig
        torch.manual_seed(0)
        model = GPT2LMHeadModel(ModelConfig(vocab_size=101, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        model.init_weights(torch.Generator().manual_seed(0))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        model = model.cuda().eval()
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
        greedy = SamplingConfig(greedy=True)
        eager = Generator(model, 2, 40).generate(prompts, 20, greedy).tokens
        graphs = Generator(model, 2, 40, compile=True)
        graphs.warm_up()
        assert graphs.generate(prompts, 20, greedy).tokens == eager
        for p, new in zip(prompts, eager):  # each greedy token is the full forward's argmax
            seq = list(p)
            for t in new:
                assert int(model(torch.tensor([seq], device="cuda"))[0, -1, :101].argmax()) == t
                seq.append(t)
    """)


def test_bf16_compiled_training_learns_and_reports_mfu(cfg):
    steps = gpu_train(cfg, "--precision", "bf16", "--torch-compile", "true")
    assert len(steps) == 30 and steps[-1][0] < steps[0][0] - 0.5
    assert all(mfu.endswith("%") for _, mfu in steps)


def test_offloaded_optimizer_on_cuda_follows_the_device_optimizer(cfg):
    plain = gpu_train(cfg, "--precision", "fp32", "--torch-compile", "false")
    offload = gpu_train(cfg, "--precision", "fp32", "--torch-compile", "false", "--optimizer-state-offchip", "true")
    assert [loss for loss, _ in offload] == pytest.approx([loss for loss, _ in plain], abs=2e-3)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [
    ["--replication-factor", "2"],
    ["--replication-factor", "2", "--replicated-tensor-sharding", "true"],
    ["--replication-factor", "2", "--zero-stage", "3", "--optimizer-state-offchip", "true", "--max-grad-norm", "1.0"],
    ["--replication-factor", "1", "--layers-per-ipu", "1", "1", "--ipus-per-replica", "2"],
])
def test_nccl_layouts_follow_one_gpu(cfg, layout):
    flags = ["--precision", "fp32", "--torch-compile", "false", *layout]
    single = gpu_train(cfg, *flags)
    both = gpu_train(cfg, *flags, nproc=2)
    assert [loss for loss, _ in both] == pytest.approx([loss for loss, _ in single], abs=2e-3)
