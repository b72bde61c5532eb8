"""The CUDA-only branches of gpt2forge.parallel (process groups, device per rank, DDP, FSDP2's
offload policy, the tensor-parallel random streams, the memory plan's verdict), run on the CPU
under the fake CUDA runtime (tests/fake_cuda.py)."""

import re

import pytest
import torch

import gpt2forge.parallel.distributed as distributed
import gpt2forge.parallel.memory_plan as memory_plan
from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.parallel.distributed import (
    TIMEOUT,
    DistEnv,
    device_for,
    fsdp_options,
    init_process_group,
    init_single_process_group,
    wrap_data_parallel,
)
from gpt2forge.parallel.tensor_parallel import TensorParallelRNG

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
NCCL = "cpu:gloo,cuda:nccl"  # NCCL for CUDA tensors, gloo for the host ones (FSDP2's offloaded norm, objects)


@pytest.fixture()
def no_preflight(monkeypatch) -> list:
    """The devices preflight was called with (its all-reduce would put a tensor on the GPU)."""
    devices = []
    monkeypatch.setattr(distributed, "preflight", devices.append)
    return devices


@pytest.mark.parametrize(("local_rank", "device"), [(0, torch.device("cuda")), (1, CUDA1)])
def test_a_rank_joins_nccl_with_its_indexed_gpu(fake_cuda, no_preflight, local_rank, device):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    init_process_group(DistEnv(rank=local_rank, local_rank=local_rank, world_size=2), device)
    expected = torch.device("cuda", local_rank)
    assert fake_cuda.called("set_device") == [((expected,), {})]
    assert fake_cuda.called("init_process_group") == [((NCCL,), {"timeout": TIMEOUT, "device_id": expected})]
    assert no_preflight == [expected]


def test_one_process_joins_nothing(fake_cuda, no_preflight):
    init_process_group(DistEnv(), CUDA0)
    assert not fake_cuda.called("init_process_group") and not no_preflight


def test_a_world_of_one_for_fsdp2_names_its_gpu(fake_cuda):
    fake_cuda.real_group = True  # FSDP2 goes on to use it
    init_single_process_group(torch.device("cuda"))
    ((backend,), kwargs), = fake_cuda.called("init_process_group")
    assert backend == NCCL and kwargs["device_id"] == CUDA0
    assert (kwargs["rank"], kwargs["world_size"], kwargs["timeout"]) == (0, 1, TIMEOUT)
    init_single_process_group(torch.device("cuda"))  # the group exists: nothing more
    assert len(fake_cuda.called("init_process_group")) == 1


def test_each_local_rank_gets_its_own_gpu(fake_cuda):
    fake_cuda.names = ["NVIDIA A100-SXM4-80GB"] * 2
    assert device_for(DistEnv(rank=3, local_rank=1, world_size=4), CUDA0) == CUDA1
    assert device_for(DistEnv(), CUDA1) == CUDA1  # one process keeps --device cuda:N
    assert device_for(DistEnv(rank=1, local_rank=1, world_size=2), torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(UsageError, match="local rank 2 has no GPU of its own: this node has 2 CUDA device"):
        device_for(DistEnv(rank=2, local_rank=2, world_size=4), CUDA0)


def test_ddp_is_given_the_ranks_gpu(fake_cuda, monkeypatch):
    made = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda model, **kw: made.append(kw) or model)
    model = torch.nn.Linear(2, 2)
    assert wrap_data_parallel(model, DistEnv(rank=1, local_rank=1, world_size=2), CUDA1) is model
    wrap_data_parallel(model, DistEnv(rank=1, local_rank=1, world_size=2), torch.device("cpu"))
    assert made == [{"device_ids": [1], "gradient_as_bucket_view": True},
                    {"device_ids": None, "gradient_as_bucket_view": True}]


def test_fsdp2_offload_pins_host_memory_where_there_is_a_gpu(fake_cuda):
    assert fsdp_options(None, 3, offload=True, param_dtype=None)["offload_policy"].pin_memory
    assert "offload_policy" not in fsdp_options(None, 3, offload=False, param_dtype=None)


def test_fsdp2_offload_pins_nothing_without_a_gpu():
    assert not torch.cuda.is_available()  # conftest hides GPUs
    assert not fsdp_options(None, 3, offload=True, param_dtype=None)["offload_policy"].pin_memory


def test_a_sharded_region_seeds_its_own_gpus_stream_and_restores_it(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    rng = object.__new__(TensorParallelRNG)  # its __init__ broadcasts a seed tensor on the GPU
    rng.device, rng.rank, rng.saved = CUDA1, 1, []
    before = fake_cuda.rng_state(1).clone()
    torch.manual_seed(5)
    seed = int(torch.randint(1 << 62, (1,)))  # what _enter draws from the shared CPU stream
    torch.manual_seed(5)
    rng._enter()
    assert fake_cuda.called("get_rng_state") == [((CUDA1,), {})]
    assert fake_cuda.generators[1].initial_seed() == seed + 2718 + 1  # Megatron's offset plus the rank
    assert 0 not in fake_cuda.generators.made  # GPU 0's stream untouched
    fake_cuda.rng_states[1] = torch.zeros(16, dtype=torch.uint8)  # the region's dropout moved the stream
    rng._leave()
    assert fake_cuda.called("set_rng_state")[0][0][1] == CUDA1
    assert torch.equal(fake_cuda.rng_state(1), before) and not rng.saved


def test_plan_on_a_gpu_measures_there_and_judges_by_its_memory(fake_cuda, monkeypatch, capsys):
    measured = []

    def on_cpu(cfg, batch, seq_len, device, dtype, fake=None):  # the GPU measurement, on fake tensors
        measured.append(device)
        return block_activation_bytes(cfg, batch, seq_len, torch.device("cpu"), dtype, fake=True)

    block_activation_bytes = memory_plan.block_activation_bytes
    monkeypatch.setattr(memory_plan, "block_activation_bytes", on_cpu)
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: 2.0**40)
    argv = ["--plan", "--model", "gpt2", "--max-len", "128", "--device", "cuda"]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert measured and set(measured) == {CUDA0}
    assert fake_cuda.called("set_device") == [((CUDA0,), {})]
    assert re.search(r"Largest process: [\d.]+ GiB of NVIDIA H100 80GB HBM3 \(80.0 GiB\): fits \(with ~10% for "
                     "the CUDA context", out), out
    assert "One device: 80.0 GiB (NVIDIA H100 80GB HBM3 (80.0 GiB)), micro-batch 1 x 128, bfloat16" in out
    fake_cuda.total_memory = 2**20
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "(0.0 GiB): does not fit" in out and "To shrink it:" in out
    assert "Largest that fits: no offload: none, optimizer offload: none, full offload: none" in out
