"""--plan on a GPU that the plan's own measurement could fill (gpt2forge.parallel.memory_plan), run on
the CPU under the fake CUDA runtime (tests/fake_cuda.py): block activations come from fake tensors,
and a real block runs only where it fits PLAN_MARGIN of the free memory."""

import pytest
import torch

import gpt2forge.parallel.memory_plan as memory_plan
from gpt2forge.cli import train_main
from gpt2forge.core.memory import GiB
from gpt2forge.model.config import ModelConfig

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture()
def block_runs(monkeypatch) -> list:
    """Each measurement of a block as (n_embd, batch, seq_len, device, fake, bytes a real run would take).
    The CPU build cannot run kernels for a CUDA tensor, fake or not: both count on the CPU's fake tensors."""
    saved_block_bytes = memory_plan.saved_block_bytes
    runs = []

    def measure(cfg, batch, seq_len, device, dtype, fake):
        saved = saved_block_bytes(cfg, batch, seq_len, CPU, dtype, fake=True)
        runs.append((cfg.n_embd, batch, seq_len, device, fake,
                     memory_plan.block_run_bytes(cfg, batch, seq_len, dtype, saved)))
        return saved

    monkeypatch.setattr(memory_plan, "saved_block_bytes", measure)
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: 2.0**40)
    return runs


def test_a_real_block_runs_only_where_it_fits_the_margin_of_the_free_memory(fake_cuda, block_runs):
    cfg = ModelConfig.preset("gpt2-xl")
    fake_cuda.free_memory = 80 * GiB
    big = memory_plan.block_activation_bytes(cfg, 1, 256, CUDA0, torch.bfloat16)
    assert [(device, fake) for *_, device, fake, _ in block_runs] == [(CUDA0, True), (CUDA0, False)]
    need = block_runs[0][-1]
    assert fake_cuda.called("mem_get_info")[-1] == ((CUDA0,), {})
    block_runs.clear()
    fake_cuda.free_memory = int(need / memory_plan.PLAN_MARGIN) - 1  # one byte short of the margin
    assert memory_plan.block_activation_bytes(cfg, 1, 256, CUDA0, torch.bfloat16) == big
    assert [fake for *_, fake, _ in block_runs] == [True]
    block_runs.clear()  # the CPU measures fake tensors only, whatever its memory
    memory_plan.block_activation_bytes(cfg, 1, 256, CPU, torch.bfloat16)
    assert [(device, fake) for *_, device, fake, _ in block_runs] == [(CPU, True)]


def test_plan_on_a_small_gpu_runs_no_block_larger_than_the_margin(fake_cuda, block_runs, capsys):
    fake_cuda.names, fake_cuda.total_memory, fake_cuda.free_memory = ["Tesla T4"], 16 * GiB, GiB // 2
    argv = ["--plan", "--model", "gpt2", "--max-len", "1024", "--batch-size", "1", "--device", "cuda"]
    assert train_main(argv) == 0
    assert "Largest that fits:" in capsys.readouterr().out
    real = [run for run in block_runs if not run[4]]
    fakes = [run for run in block_runs if run[4]]
    # Every GPT-2 size is measured on fake tensors; the small ones also for real, gpt2-xl (whose block
    # with its input and activations takes more than a quarter GiB at T=1024) never.
    assert {n for n, *_ in fakes} == {768, 1024, 1280, 1600}
    assert real and all(need <= memory_plan.PLAN_MARGIN * fake_cuda.free_memory for *_, need in real)
    assert 1600 not in {n for n, *_ in real}
    assert all(device == CUDA0 for *_, device, _, _ in block_runs)


def test_a_device_whose_kernels_cannot_run_on_fake_tensors_is_planned_with_the_cpus_count(fake_cuda, block_runs,
                                                                                           monkeypatch):
    measure = memory_plan.saved_block_bytes

    def no_fake_kernel(cfg, batch, seq_len, device, dtype, fake):
        if device.type == "cuda" and fake:
            raise NotImplementedError("no fake kernel")
        return measure(cfg, batch, seq_len, device, dtype, fake)

    monkeypatch.setattr(memory_plan, "saved_block_bytes", no_fake_kernel)
    fake_cuda.free_memory = 2**20  # too little for a real block
    cfg = ModelConfig.preset("gpt2")
    assert memory_plan.block_activation_bytes(cfg, 1, 128, CUDA0, None) == block_runs[-1][-1] - (
        memory_plan.block_run_bytes(cfg, 1, 128, None, 0))
    assert [(device, fake) for *_, device, fake, _ in block_runs] == [(CPU, True)]
