"""Throughput and model FLOPs utilisation (MFU).

MFU = achieved training FLOP/s / peak FLOP/s of the device in the run's precision. GPU peaks come
from a table of dense tensor-core figures; a CPU's peak is measured once per machine (a large
matmul in that precision, cached under ~/.cache/gpt2forge) since CPU peaks are not published in a
form we can look up.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.precision import cpu_identity
from gpt2forge.core.runtime import PRECISION_DTYPES, cpu_half_matmul_is_emulated

# Dense peak FLOP/s by device-name substring and compute dtype (vendor data sheets, no sparsity).
# The first key found in the name wins: a longer name comes before its prefix (A100 before A10).
GPU_PEAKS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},  # SXM; fp32 = TF32 tensor cores
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 62.5e12},
    "V100": {"bf16": None, "fp16": 125e12, "fp32": 15.7e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12},
}


def gpu_peak(device: torch.device, precision: str) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks.get(precision)
    return None


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2forge" / "cpu_peak.json"


def measure_cpu_peak(precision: str, n: int = 1024, reps: int = 8) -> float:
    """FLOP/s of an n x n x n matmul in `precision` on this CPU, best of `reps`."""
    dtype = PRECISION_DTYPES[precision]
    gen = torch.Generator().manual_seed(0)  # never the global RNG: a resumed run's dropout depends on it
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, packing buffers
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _cpu_peak_key(precision: str) -> str:
    return f"{cpu_identity()}|{precision}"  # the CPU's model and flags, threads, torch


def _read_cache() -> dict:
    try:
        cache = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def remember_cpu_peak(precision: str, flops: float) -> float:
    """Merge a measured peak into the per-machine cache; returns the best this machine has shown."""
    key = _cpu_peak_key(precision)
    cache = _read_cache()
    best = max(float(cache.get(key, 0.0)), flops)
    if best != cache.get(key):
        cache[key] = best
        try:
            write_atomic(_cache_file(), json.dumps(cache, indent=1))
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return best


def cpu_peak(precision: str) -> float:
    """Measured once per (CPU, thread count, precision) and cached; re-measured each run where the
    precision has native kernels (cheap), the best kept."""
    cached = _read_cache().get(_cpu_peak_key(precision))
    # Keep the best seen, so one measurement taken while the machine was busy does not inflate
    # every later MFU (a bf16 peak read once under load gave a 127% MFU); an emulated precision's
    # read takes orders of magnitude longer and is kept as it was.
    if cached is None or not cpu_half_matmul_is_emulated(precision):
        return remember_cpu_peak(precision, measure_cpu_peak(precision))
    return float(cached)


def device_peak(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s for MFU, or None when unknown (printed as 'unknown')."""
    if device.type == "cuda":
        return gpu_peak(device, precision)
    if device.type == "cpu":
        # A CPU without native bf16/fp16 kernels may run a reduced-precision matmul slower than fp32
        # (emulated) while autocast training does much of its work in fp32: the peak is the faster one.
        return cpu_peak(precision) if precision == "fp32" else max(cpu_peak(precision), cpu_peak("fp32"))
    return None


class StepMeter:
    """Turns a host step's wall time into samples/s, tokens/s and MFU."""

    def __init__(self, samples_per_step: int, seq_len: int, flops_per_token: float, peak: float | None):
        self.samples_per_step = samples_per_step
        self.seq_len = seq_len
        self.flops_per_token = flops_per_token
        self.peak = peak

    def rates(self, seconds: float) -> tuple[float, float, str]:
        """(samples/s, tokens/s, MFU text as the step line prints it: "12.3%" or "unknown")."""
        samples = self.samples_per_step / seconds
        tokens = samples * self.seq_len
        mfu = self.mfu(tokens)
        return samples, tokens, "unknown" if mfu is None else f"{100.0 * mfu:.1f}%"

    def mfu(self, tokens_per_sec: float) -> float | None:
        """MFU as a fraction (0.123 = 12.3%), None when the device peak is unknown."""
        return tokens_per_sec * self.flops_per_token / self.peak if self.peak else None
