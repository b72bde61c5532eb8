"""The CUDA-only branch of text_generate_gpt2.py's KV-cache size check, run on the CPU under the fake
CUDA runtime (tests/fake_cuda.py)."""

import types

import pytest
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.core.runtime import GiB
from gpt2forge.generate.cli import check_cache_fits

CUDA1 = torch.device("cuda", 1)


def loaded_model(n_layer: int = 2, n_embd: int = 32):
    """What check_cache_fits reads of a loaded model: its config and its parameters' element size (fp32)."""
    return types.SimpleNamespace(config=types.SimpleNamespace(n_layer=n_layer, n_embd=n_embd),
                                 parameters=lambda: iter([torch.zeros(1)]))


def test_the_kv_cache_must_fit_what_the_gpu_has_left(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    row = 2 * 2 * 64 * 32 * 4  # keys and values of 2 layers, 64 positions of 32 fp32 numbers
    # An 80 GiB GPU with 1 MiB free after the model (and other processes): its total would let 64 rows pass.
    fake_cuda.free_memory = 2**20
    check_cache_fits(loaded_model(), 2**20 // row, 64, CUDA1)  # exactly fits
    with pytest.raises(UsageError, match=r"--batch-size 33: the KV cache of 33 rows of 64 positions needs .* and "
                                         r"NVIDIA H100 80GB HBM3 \(0.0 of 80.0 GiB free\) has less"):
        check_cache_fits(loaded_model(), 2**20 // row + 1, 64, CUDA1)
    assert fake_cuda.called("mem_get_info")[-1] == ((CUDA1,), {})


def test_memory_the_allocator_holds_unused_counts_as_free(fake_cuda):
    # Casting the weights to fp16 after loading leaves their fp32 copies in the caching allocator.
    fake_cuda.free_memory, fake_cuda.reserved, fake_cuda.allocated = 1 * GiB, 4 * GiB, 1 * GiB
    check_cache_fits(loaded_model(n_layer=48, n_embd=1600), 4 * GiB // (2 * 48 * 1600 * 1024 * 4), 1024,
                     torch.device("cuda", 0))
