"""The CUDA-only branches of gpt2forge.train (fused AdamW, the offloaded optimizer's pinned copies and
synchronisation, GPU random states in checkpoints, peak memory, offload choice, pinned batches, the
run's current device), run on the CPU under the fake CUDA runtime (tests/fake_cuda.py)."""

import random
import types

import pytest
import torch

import gpt2forge.data.contract as contract
import gpt2forge.train.batches as batches
import gpt2forge.train.setup as setup
import gpt2forge.train.trainer as trainer
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.parallel.distributed import DistEnv
from gpt2forge.parallel.memory_plan import MemoryArgs
from gpt2forge.train.memory_features import offload_to_host, peak_memory_bytes, reset_peak_memory
from gpt2forge.train.optim import OffloadedOptimizer, build_optimizer
from gpt2forge.train.state import Progress, restore_rng_state, rng_state, set_rng_state

CUDA0, CUDA1, CUDA2 = (torch.device("cuda", i) for i in range(3))


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_adam_on_cuda_is_fused(name):
    model = torch.nn.Linear(4, 4)
    assert build_optimizer(model, name, 1e-3, 0.0, device_type="cuda").defaults.get("fused")
    assert build_optimizer(model, name, 1e-3, 0.0, device_type="mps").defaults.get("foreach")  # no fused kernel


class GpuParam:
    """A parameter as OffloadedOptimizer sees one on GPU `index` (values and gradient stay CPU tensors)."""

    def __init__(self, values: torch.Tensor, index: int):
        self.data, self.grad = values, None
        self.device, self.dtype, self.shape = torch.device("cuda", index), values.dtype, values.shape

    def detach(self) -> torch.Tensor:
        return self.data.detach()

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> "GpuParam":
        self.data.copy_(src)
        return self


class HostAdamW(torch.optim.AdamW):
    """A host optimizer that writes bf16/fp16 device copies (as gpt2forge.ops.host_optim's do)."""

    device_copies: dict

    def __init__(self, groups):
        super().__init__(groups, lr=0.1)
        self.device_copies = {}


def test_offloaded_optimizer_pins_its_host_copies_and_syncs_each_gpu_first(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    params = [GpuParam(torch.ones(3), 0), GpuParam(torch.ones(2, 2), 1),
              GpuParam(torch.ones(2, dtype=torch.bfloat16), 1)]
    opt = OffloadedOptimizer([{"params": params}], HostAdamW)
    pinned = [args[0] for args, _ in fake_cuda.called("Tensor.pin_memory")]
    # fp32 host copies of the three, then the bf16 staging buffer the host update writes
    assert [(t.shape, t.dtype) for t in pinned] == [((3,), torch.float32), ((2, 2), torch.float32),
                                                   ((2,), torch.float32), ((2,), torch.bfloat16)]
    assert [t.dtype for t in opt.inner.device_copies.values()] == [torch.bfloat16]
    for p in params:
        p.grad = torch.ones_like(p.data)
    step = opt.inner.step
    opt.inner.step = lambda: (fake_cuda.record("host step"), step())
    opt.step()
    names = [name for name, _, _ in fake_cuda.calls if name in ("synchronize", "host step")]
    assert names == ["synchronize", "synchronize", "host step"]  # every gradient copy has landed first
    assert {args[0] for args, _ in fake_cuda.called("synchronize")} == {CUDA0, CUDA1}
    assert params[0].data[0] < 1  # the update came back


def test_checkpoints_keep_the_runs_gpu_random_state(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 3
    state = rng_state(CUDA1)
    assert torch.equal(state["cuda"], fake_cuda.rng_state(1))
    assert fake_cuda.called("get_rng_state") == [((CUDA1,), {})]
    assert "cuda" not in rng_state(torch.device("cpu"))
    saved = state["cuda"]
    fake_cuda.rng_states[1] = torch.zeros(16, dtype=torch.uint8)  # the run went on
    restore_rng_state({"rng": state, "rng_ranks": [state]}, CUDA1, seed=0, step=3)
    assert fake_cuda.called("set_rng_state")[-1][0][1] == CUDA1
    assert torch.equal(fake_cuda.rng_state(1), saved)


def test_old_checkpoints_with_every_gpus_state_restore_the_runs_own(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 3
    states = [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(2)]
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": states}
    set_rng_state(old, CUDA1)
    assert fake_cuda.called("set_rng_state") == [((states[1], CUDA1), {})]
    set_rng_state(old, CUDA2)  # saved by a process that saw two GPUs: nothing for GPU 2
    set_rng_state(old, torch.device("cpu"))
    assert len(fake_cuda.called("set_rng_state")) == 1


def test_peak_memory_is_the_gpus_and_resets_per_window(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    assert peak_memory_bytes(CUDA1) == fake_cuda.peak
    reset_peak_memory(CUDA1)
    reset_peak_memory(torch.device("cpu"))
    assert fake_cuda.called("max_memory_allocated") == [((CUDA1,), {})]
    assert fake_cuda.called("reset_peak_memory_stats") == [((CUDA1,), {})]


@pytest.mark.parametrize(("mode", "on_gpu", "on_cpu"), [("none", False, False), ("optimizer", True, False),
                                                        ("full", True, True)])
def test_offload_moves_the_state_to_the_host_from_a_gpu(mode, on_gpu, on_cpu):
    memory = MemoryArgs(offload=mode)
    assert offload_to_host(memory, CUDA0) is on_gpu
    assert offload_to_host(memory, torch.device("cpu")) is on_cpu


class Batch:
    """A collated batch whose move to the device is recorded in `moves` instead of made."""

    def __init__(self, moves: list):
        self.moves = moves

    def to(self, device, non_blocking=False):
        self.moves.append((device, non_blocking))
        return torch.zeros(2, 5, dtype=torch.long)


def test_batches_come_pinned_and_move_without_blocking(fake_cuda, monkeypatch):
    loaders, moves = [], []

    def data_loader(dataset, **kwargs):
        loaders.append(kwargs)
        return [Batch(moves) for _ in kwargs["batch_sampler"]]

    monkeypatch.setattr(contract, "DataLoader", data_loader)
    cfg = types.SimpleNamespace(parallel=types.SimpleNamespace(batch_size=2, device_iterations=1),
                                data=types.SimpleNamespace(num_workers=0, seed=0))
    run = types.SimpleNamespace(cfg=cfg, accumulation=2, device=CUDA1, replica=DistEnv())
    dataset = torch.utils.data.TensorDataset(torch.zeros(8, 5, dtype=torch.long))
    updates = list(batches.epoch_updates(run, dataset, Progress(), steps_per_epoch=2, shuffle=False))
    assert len(updates) == 2 and all(len(u) == 2 for u in updates)
    assert [kw["pin_memory"] for kw in loaders] == [True]
    assert moves == [(CUDA1, True)] * 4


class Stop(Exception):
    """Ends run_training where the test has seen what it needs."""


@pytest.mark.parametrize(("flag", "device"), [("cuda", CUDA0), ("cuda:1", CUDA1), ("auto", CUDA0)])
def test_the_runs_gpu_becomes_the_current_device(fake_cuda, monkeypatch, flag, device):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2

    def stop(name, dev):
        raise Stop(dev)

    monkeypatch.setattr(setup, "resolve_precision", stop)
    with pytest.raises(Stop) as stopped:
        trainer.run_training(parse_args(["--dataset", "generated", "--device", flag]))
    assert stopped.value.args == (device,)
    assert fake_cuda.called("set_device") == [((device,), {})]
