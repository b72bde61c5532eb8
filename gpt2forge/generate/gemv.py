"""Linear layers for decoding: the C++ `gpt2forge::gemv_linear` kernel when only a few rows go in.

A decode step multiplies 1 to 8 rows (one per sequence of the batch) by every weight matrix, so
its time is the time to read the weights (bf16 weights: half the bytes). `gemv_linear`
(custom_ops/gemv.cpp) streams each weight once, faster than BLAS reads them for these shapes on the
2-core AVX2 development machine (measured: docs/benchmarks.md, Design measurements;
benchmarks/generation_latency.py gives the whole-token figures). `gemv_threads(n)` sets how many
threads it uses, `gemv_streams(s)` how many read streams one row of x keeps in flight at batch 1
(4 or 8: the faster depends on the machine), `gemv_prefetch(hint)` which prefetch instruction asks
for W ahead of its reads and `gemv_lanes(n)` whether its loops are AVX2's (8 lanes) or AVX-512's
(16). Its
reference is F.linear: the fallback whenever the kernel does not apply (library not built, not CPU
fp32/bf16, more than GEMV_MAX_ROWS rows, gradients wanted) and the oracle of
tests/ops/test_custom_ops.py.
On a CPU without bf16 instructions, where ATen emulates bf16 matmuls (orders of magnitude slower
than fp32), bf16 prefill runs on the kernel too, at any row count.

`with_gemv_linears(model)` gives the inference code (gpt2forge.generate.kv_cache.CachedLM) a view of the
model whose nn.Linear layers use it, sharing every parameter: the model itself is unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpt2forge.core.precision import cpu_half_matmul_is_emulated
from gpt2forge.ops import library as custom_ops

GEMV_MAX_ROWS = 16
"""Above this many rows (prefill, training) BLAS's blocked matmul is faster: F.linear runs."""


def kernel_available() -> bool:
    """Whether the custom ops library is loaded and has `gpt2forge::gemv_linear` (one notice if not built)."""
    return custom_ops.has_op("gemv_linear")


def gemv_threads(n: int) -> contextlib.AbstractContextManager:
    """The kernel runs on n threads inside the block (0: torch's intra-op thread count, the
    default), restored after; nothing to set when the kernel is not available. Unlike an OpenMP
    region, a call never waits for a thread that has not started on it (see
    gpt2forge.generate.generator.Generator._decoding, which sets this)."""
    return _kernel_setting("gemv_set_threads", n)


STREAM_CHOICES = (4, 8)
"""The read-stream counts the kernel takes (gpt2forge.generate.generator measures which is faster)."""


def gemv_streams(n: int) -> contextlib.AbstractContextManager:
    """The kernel multiplies one row of x with n (4 or 8) rows of W at once inside the block, each
    from its own slice of the rows, so that n memory read streams are in flight; restored after.
    Nothing to set when the kernel is not available."""
    if n not in STREAM_CHOICES:
        raise ValueError(f"gemv read streams must be one of {STREAM_CHOICES}, got {n}")
    return _kernel_setting("gemv_set_streams", n)


PREFETCH_CHOICES = ("t2", "nta")
"""How the kernel prefetches W: "t2" (prefetcht2, into L2: the default) or "nta" (prefetchnta,
non-temporal). Which is faster depends on the CPU, by a wide margin: NTA cut a Xeon core's read
well below its rate with t2, where on an EPYC it kept the step's other data in cache (measured:
docs/benchmarks.md, Design measurements); gpt2forge.generate.generator measures both."""

_PREFETCH_CODES = {"nta": 0, "t2": 1}  # gpt2forge::gemv_set_prefetch's argument


@functools.cache
def lane_choices() -> tuple[int, ...]:
    """The vector lanes the kernel's loops can take here: 8 (AVX2), and 16 (AVX-512) where the CPU
    has it. With several rows of x the loops are bound by their instructions, not by memory, and
    wider ones may be faster (gpt2forge.generate.generator measures); results differ in the last bits
    between the two (each reduces a row in its own order). Not 16 where $GPT2FORGE_OPS_ISA holds the
    kernels below AVX-512."""
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512" and kernel_available()
    return (8, 16) if avx512 and custom_ops.ops_isa() in (None, "avx512") else (8,)


def gemv_lanes(n: int) -> contextlib.AbstractContextManager:
    """The kernel's loops take n (one of lane_choices()) lanes inside the block, restored after;
    nothing to set when the kernel is not available."""
    if n not in (8, 16):
        raise ValueError(f"gemv lanes must be 8 or 16, got {n}")
    return _kernel_setting("gemv_set_lanes", n)


def gemv_prefetch(hint: str) -> contextlib.AbstractContextManager:
    """The kernel prefetches W with `hint` (one of PREFETCH_CHOICES) inside the block, restored after;
    nothing to set when the kernel is not available."""
    if hint not in PREFETCH_CHOICES:
        raise ValueError(f"gemv prefetch must be one of {PREFETCH_CHOICES}, got {hint!r}")
    return _kernel_setting("gemv_set_prefetch", _PREFETCH_CODES[hint])


class KernelSettings(NamedTuple):
    """How the kernel runs a decode step's matmuls (gpt2forge.generate.generator measures the fastest)."""

    threads: int
    """Threads sharing a matmul (0: torch's intra-op count)."""
    streams: int = STREAM_CHOICES[0]
    """Read streams one row of x keeps in flight (batch 1 only)."""
    prefetch: str = PREFETCH_CHOICES[0]
    """The prefetch instruction that asks for W ahead of its reads."""
    lanes: int = 8
    """The loops' vector lanes: 8 (AVX2) or 16 (AVX-512, lane_choices())."""


def kernel_settings(settings: KernelSettings) -> contextlib.AbstractContextManager:
    """All four of `settings` inside the block, restored after (nothing to set without the kernel)."""
    stack = contextlib.ExitStack()
    stack.enter_context(gemv_threads(settings.threads))
    stack.enter_context(gemv_streams(settings.streams))
    stack.enter_context(gemv_prefetch(settings.prefetch))
    stack.enter_context(gemv_lanes(settings.lanes))
    return stack


@contextlib.contextmanager
def _kernel_setting(setter: str, value: int) -> Iterator[None]:
    """torch.ops.gpt2forge.<setter>(value) inside the block (the setter returns the previous
    setting, restored after); nothing to set when the library does not have it."""
    if not custom_ops.has_op(setter):
        yield
        return
    before = getattr(torch.ops.gpt2forge, setter)(value)
    try:
        yield
    finally:
        getattr(torch.ops.gpt2forge, setter)(before)


@functools.cache
def _bf16_emulated() -> bool:
    return cpu_half_matmul_is_emulated("bf16")


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., K), weight (N, K), without gradients: the kernel for up
    to GEMV_MAX_ROWS rows of CPU fp32 or bf16, and for any number of bf16 rows on a CPU whose bf16
    matmuls ATen would emulate; F.linear otherwise. Call `kernel_available()` first."""
    K = x.shape[-1]
    rows = x.numel() // max(K, 1)
    dtype = weight.dtype
    use = (x.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and x.dtype == dtype
           and (bias is None or bias.dtype == dtype)
           and 0 < rows and (rows <= GEMV_MAX_ROWS or (dtype == torch.bfloat16 and _bf16_emulated()))
           and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
    if not use:
        return F.linear(x, weight, bias)
    y = torch.ops.gpt2forge.gemv_linear(x.reshape(rows, K), weight, bias)  # (rows, N)
    return y.view(*x.shape[:-1], weight.shape[0])


class GemvLinear(nn.Module):
    """An nn.Linear's parameters (shared, not copied) applied with `gemv_linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv_linear(x, self.weight, self.bias)


def with_gemv_linears(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` whose nn.Linear submodules (at any depth) are GemvLinear, sharing
    all parameters and buffers with it; `module` itself is returned unchanged when the kernel
    cannot apply (library not built, or the weights are not CPU fp32/bf16)."""
    param = next(module.parameters(), None)
    if (param is None or param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16)
            or not kernel_available()):
        return module
    return _swap_linears(module)


def _swap_linears(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear):
        return GemvLinear(module)
    clone = copy.copy(module)  # shares _parameters and _buffers; only the children are replaced
    clone._modules = {name: _swap_linears(child) if child is not None else None
                      for name, child in module._modules.items()}
    return clone
