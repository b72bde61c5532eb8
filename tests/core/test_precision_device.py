"""Precision, loss scaling and device resolution."""

import importlib.util
from pathlib import Path

import pytest
import torch

from gpt2forge.core.device import loader_workers, resolve_device
from gpt2forge.core.errors import UsageError
from gpt2forge.core.loss_scaler import LossScaler
from gpt2forge.core.precision import resolve_precision


def _params_with_grads(*values):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in values]
    for p, v in zip(params, values):
        p.grad = torch.full((2,), v)
    return params


def test_static_loss_scale_unscales_and_skips_overflow():
    scaler = LossScaler(enabled=True, init_scale=8.0, dynamic=False)
    params = _params_with_grads(16.0, 8.0)
    assert scaler.unscale_and_check(params)
    assert torch.equal(params[0].grad, torch.full((2,), 2.0)) and torch.equal(params[1].grad, torch.ones(2))
    scaler.update(True)
    assert not scaler.unscale_and_check(_params_with_grads(float("inf"), 1.0))
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.skipped == 1  # static: the scale never changes


def test_dynamic_loss_scale_halves_on_overflow_and_grows():
    scaler = LossScaler(enabled=True, init_scale=1024.0, dynamic=True, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 512.0
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 1024.0
    restored = LossScaler(enabled=True, init_scale=1.0, dynamic=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 1024.0 and restored.skipped == 1


def test_disabled_scaler_is_identity():
    scaler = LossScaler(enabled=False, init_scale=50000.0, dynamic=True)
    params = _params_with_grads(3.0)
    assert scaler.scale == 1.0 and scaler.unscale_and_check(params)
    assert torch.equal(params[0].grad, torch.full((2,), 3.0))


def test_loader_workers_are_at_most_the_cpus_with_one_notice(monkeypatch, capsys):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("gpt2forge.core.log._seen_notices", set())  # other tests may have printed it
    loader_workers.cache_clear()
    assert loader_workers(0) == 0 and loader_workers(2) == 2 and capsys.readouterr().err == ""
    assert loader_workers(4) == 2 and loader_workers(4) == 2
    assert capsys.readouterr().err.count("--num-workers 4: this process may use 2 CPUs") == 1
    loader_workers.cache_clear()


def test_device_and_precision_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    with pytest.raises(UsageError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--device cuda"):
            resolve_device("cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_training_runs_on_cpu(precision, tmp_path, capsys):
    import json

    from gpt2forge.cli import train_main
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 32,
                               "n_layer": 1, "n_head": 2}))
    args = ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--device-iterations", "1", "--epochs", "2", "--num-workers", "0", "--precision", precision,
            "--learning-rate", "1e-2", "--auto-loss-scaling", "--loss-scaling", "1024"]
    assert train_main(args) == 0
    losses = [float(line.split("loss: ")[1].split(",")[0]) for line in capsys.readouterr().out.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 8 and all(x == x and x < 10 for x in losses)  # finite, not NaN


@pytest.mark.slow
def test_host_allocator_setting_applies_once_and_yields_to_the_environment():
    import os
    import subprocess
    import sys

    code = "from gpt2forge.core.device import configure_host_allocator as c; print(c())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    applied = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = "True" if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") else "False"
    assert applied.stdout.strip() == expected
    env["MALLOC_MMAP_MAX_"] = "65536"  # the user's own setting wins
    kept = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert kept.stdout.strip() == "False"


def test_emulated_half_precision_on_cpu_is_announced(monkeypatch, capsys):
    from gpt2forge.core import log, precision

    assert precision.cpu_half_matmul_is_emulated("fp32") is False
    monkeypatch.setattr(log, "_seen_notices", set())  # notices print once per process
    monkeypatch.setattr(precision, "cpu_half_matmul_is_emulated", lambda precision: precision == "bf16")
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    assert "--precision bf16: this CPU has no bf16 matmul kernels" in capsys.readouterr().err
    assert resolve_precision("fp16", torch.device("cpu")) == "fp16"
    assert "notice" not in capsys.readouterr().err


def test_dynamic_loss_scale_follows_megatron_core_hysteresis_and_floor():
    """The same overflow pattern through Megatron-Core's DynamicGradScaler (its tensors live on
    'cuda': patched to the CPU here) and ours gives the same scale after every update."""
    spec = importlib.util.find_spec("megatron")
    path = spec and Path(spec.submodule_search_locations[0]) / "core" / "optimizer" / "grad_scaler.py"
    if path is None or not path.is_file():
        pytest.skip("megatron-core is not installed (make setup installs it)")
    # The file alone (it imports only torch): importing megatron.core pulls in triton and more.
    loader = importlib.util.spec_from_file_location("megatron_grad_scaler", path)
    grad_scaler = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(grad_scaler)
    real_tensor = torch.tensor

    def cpu_tensor(*args, **kwargs):
        kwargs.pop("device", None)
        return real_tensor(*args, **kwargs)

    pattern = [False, True, False, False, True, True, True, False, False, False, False, True, True, True, True]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grad_scaler.torch, "tensor", cpu_tensor)
        theirs = grad_scaler.DynamicGradScaler(initial_scale=64.0, min_scale=8.0, growth_factor=2.0,
                                               backoff_factor=0.5, growth_interval=3, hysteresis=2)
        ours = LossScaler(True, 64.0, dynamic=True, growth_interval=3, min_scale=8.0, hysteresis=2)
        for overflow in pattern:
            theirs.update(overflow)
            ours.update(not overflow)
            assert ours.scale == float(theirs.scale), (pattern, overflow)
    assert ours.skipped == sum(pattern) and ours.scale == 8.0  # the floor was reached and held


def test_only_a_dynamic_scale_above_its_floor_can_answer_an_overflow():
    # What decides whether a skipped fp16 update counts toward --max-nonfinite-updates (train.step).
    dynamic = LossScaler(True, 4.0, dynamic=True, min_scale=1.0, hysteresis=1)
    assert dynamic.can_lower
    dynamic.update(False)
    dynamic.update(False)
    assert dynamic.scale == 1.0 and not dynamic.can_lower
    assert not LossScaler(True, 4.0, dynamic=False).can_lower  # static: the scale never comes down
    assert not LossScaler(False, 4.0, dynamic=True).can_lower  # fp32/bf16
