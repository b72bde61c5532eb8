"""The CUDA-only branches of gpt2forge.core (device, compilation, memory, precision, determinism,
loss_scaler), run on the CPU under the fake CUDA runtime (tests/fake_cuda.py): device names, matmul flags,
precision and its loss scaler, determinism, synchronisation, memory."""

import os

import pytest
import torch

from gpt2forge.core.compilation import compile_enabled
from gpt2forge.core.determinism import deterministic_algorithms
from gpt2forge.core.device import resolve_device, synchronize, with_index
from gpt2forge.core.errors import UsageError
from gpt2forge.core.loss_scaler import LossScaleArgs, build_loss_scaler
from gpt2forge.core.memory import GiB, available_device_memory, device_capacity
from gpt2forge.core.precision import configure_matmul, resolve_precision

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_a_bare_cuda_device_gets_the_current_index(fake_cuda, name):
    assert resolve_device(name) == CUDA0
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    fake_cuda.current = 1  # torch.cuda.set_device(1) ran before
    assert resolve_device(name) == CUDA1
    assert with_index(torch.device("cpu")) == torch.device("cpu")


def test_an_indexed_cuda_device_must_be_visible(fake_cuda):
    fake_cuda.names = ["NVIDIA A100-SXM4-80GB"] * 2
    assert resolve_device("cuda:1") == CUDA1
    with pytest.raises(UsageError, match=r"--device cuda:2: only 2 GPU\(s\) visible"):
        resolve_device("cuda:2")


def test_fp32_matmuls_use_tf32_and_half_partials_follow_the_flag(fake_cuda):
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    configure_matmul(CUDA0, "bf16", half_partials=False)
    assert matmul.allow_tf32 and cudnn.allow_tf32
    # torch's default allows them: the flag off must turn them off (fp32 partials)
    assert not matmul.allow_fp16_reduced_precision_reduction
    assert not matmul.allow_bf16_reduced_precision_reduction
    configure_matmul(CUDA0, "bf16", half_partials=True)
    assert matmul.allow_fp16_reduced_precision_reduction and matmul.allow_bf16_reduced_precision_reduction


def test_matmul_flags_are_left_alone_on_the_cpu(fake_cuda, capsys):
    configure_matmul(torch.device("cpu"), "fp32", half_partials=True)
    assert not [name for name, _, _ in fake_cuda.calls if name.startswith("backends.")]
    assert "--enable-half-partials has no equivalent on CPU" in capsys.readouterr().err


def test_precision_auto_is_bf16_where_the_gpu_has_it_natively(fake_cuda):
    assert resolve_precision("auto", CUDA0) == "bf16"
    assert resolve_precision("bf16", CUDA0) == "bf16"
    assert resolve_precision("fp16", CUDA0) == "fp16"
    fake_cuda.capability = (8, 0)  # an A100: the first with native bf16
    assert resolve_precision("auto", CUDA0) == "bf16"


@pytest.mark.parametrize("name, capability", [("Tesla V100-SXM2-16GB", (7, 0)), ("Tesla T4", (7, 5))])
def test_a_gpu_that_would_emulate_bf16_runs_fp16_and_refuses_bf16(fake_cuda, capsys, name, capability):
    fake_cuda.names, fake_cuda.capability = [name], capability
    assert torch.cuda.is_bf16_supported()  # torch's default counts emulation: what the old check asked
    assert resolve_precision("auto", CUDA0) == "fp16"
    assert (f"Precision: fp16 (--precision auto: {name}, compute capability {capability[0]}.{capability[1]}, has "
            "fp16 tensor cores and no native bf16; training scales the loss dynamically)") in capsys.readouterr().out
    assert resolve_precision("fp16", CUDA0) == "fp16"
    assert resolve_precision("fp32", CUDA0) == "fp32"
    with pytest.raises(UsageError) as refused:
        resolve_precision("bf16", CUDA0)
    assert str(refused.value) == (
        f"--precision bf16: {name} has no native bf16 (compute capability {capability[0]}.{capability[1]}, bf16 "
        "needs 8.0 or newer) and would emulate every bf16 matmul; use --precision fp16 (or auto: fp16 with dynamic "
        "loss scaling)")


def test_the_bf16_question_is_asked_of_the_current_gpu(fake_cuda):
    fake_cuda.names = ["Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB"]
    fake_cuda.capability = [(7, 0), (8, 0)]
    fake_cuda.current = 1  # the run's torch.cuda.set_device(cuda:1) ran first
    assert resolve_precision("auto", CUDA1) == "bf16"
    fake_cuda.current = 0
    assert resolve_precision("auto", CUDA0) == "fp16"


def test_fp16_chosen_by_auto_scales_its_loss_dynamically(fake_cuda):
    fake_cuda.capability = (7, 0)
    scaler = build_loss_scaler(LossScaleArgs(), resolve_precision("auto", CUDA0), "auto")
    assert scaler.enabled and scaler.dynamic and scaler.scale == 2.0**16
    # fp16 asked for keeps the flags' meaning: static at --loss-scaling unless --auto-loss-scaling
    asked = build_loss_scaler(LossScaleArgs(), "fp16", "fp16")
    assert asked.enabled and not asked.dynamic and asked.scale == 50000.0
    dynamic = build_loss_scaler(LossScaleArgs(auto_loss_scaling=True, initial_loss_scale=4.0), "fp16", "auto")
    assert dynamic.dynamic and dynamic.scale == 4.0
    assert not build_loss_scaler(LossScaleArgs(), "bf16", "auto").enabled


def test_deterministic_cuda_sets_the_cublas_workspace_and_only_warns(fake_cuda, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # restored (unset) after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    with deterministic_algorithms("auto", CUDA0) as on:  # auto: the CPU's only
        assert not on and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms("true", CUDA0) as on:
        assert on and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's setting wins
    with deterministic_algorithms("true", CUDA0):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_compile_is_on_by_default_on_cuda(fake_cuda):
    assert compile_enabled("auto", CUDA0, None) and not compile_enabled("auto", torch.device("cpu"), None)
    assert not compile_enabled("false", CUDA0, None)


def test_synchronize_waits_for_the_runs_gpu(fake_cuda):
    synchronize(CUDA0)
    synchronize(torch.device("cpu"))
    assert fake_cuda.called("synchronize") == [((CUDA0,), {})]


def test_device_capacity_is_the_gpus_total_memory(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    fake_cuda.total_memory = 141 * GiB
    assert device_capacity(CUDA1) == (141.0 * GiB, "NVIDIA H200 (141.0 GiB)")
    assert fake_cuda.called("get_device_properties") == [((CUDA1,), {})]


def test_available_device_memory_is_what_is_free_now(fake_cuda):
    fake_cuda.total_memory, fake_cuda.free_memory = 80 * GiB, 20 * GiB
    fake_cuda.reserved, fake_cuda.allocated = 7 * GiB, 5 * GiB  # 2 GiB cached by this process, reusable
    assert available_device_memory(CUDA0) == (22.0 * GiB, "NVIDIA H100 80GB HBM3 (22.0 of 80.0 GiB free)")
    assert fake_cuda.called("mem_get_info") == [((CUDA0,), {})]
