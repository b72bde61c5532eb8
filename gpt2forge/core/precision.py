"""`--precision auto` on a CPU: bf16 autocast or fp32, whichever trains faster here, measured.

A CPU's flags do not say whether bf16 pays. With AMX, bf16 matmuls run several times faster than
fp32 ones. With avx512_bf16 alone, one Xeon trained GPT-2 small slower in bf16 than in fp32.
Without either, oneDNN emulates bf16, orders of magnitude slower than fp32 (measured:
docs/benchmarks.md, Design measurements).

So `auto` times one training-shaped probe in both precisions and takes bf16 only where it is at
least `MARGIN` faster. The probe is a GPT-2 MLP block's forward and backward under autocast, best of
a few. Emulated bf16 is not timed.

The answer is cached per machine (the CPU's model and flags, the thread count, the torch version)
in ~/.cache/gpt2forge/precision.json. `$GPT2FORGE_CPU_PRECISION` (fp32 or bf16) answers without
probing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.errors import UsageError

MARGIN = 1.15
"""bf16 is chosen when its probe takes at most 1/MARGIN of fp32's: a tie keeps fp32's exact math."""
ENV = "GPT2FORGE_CPU_PRECISION"
"""Set to fp32 or bf16: `auto` takes it on the CPU without a probe (tests and pinned setups)."""


@functools.cache
def cpu_identity() -> str:
    """This CPU as a cache key: its model name and a digest of its flags (a VM's model name alone,
    "Intel Xeon Processor", covers CPUs with and without AMX), the threads torch uses, torch's version."""
    model, flags = "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{model}|{digest}|{torch.get_num_threads()} threads|torch {torch.__version__}"


def cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2forge" / "precision.json"


def probe_seconds(precision: str, rows: int = 512, width: int = 768, reps: int = 5) -> float:
    """Best time of a GPT-2 MLP block's forward and backward, (rows, width) -> 4 x width -> width,
    in `precision` ("fp32", or "bf16" under autocast with fp32 weights, as the trainer runs it)."""
    gen = torch.Generator().manual_seed(0)  # never the global RNG
    x = torch.randn(rows, width, generator=gen)
    w1 = (torch.randn(4 * width, width, generator=gen) * 0.02).requires_grad_()
    w2 = (torch.randn(width, 4 * width, generator=gen) * 0.02).requires_grad_()
    dtype = torch.bfloat16 if precision == "bf16" else None

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            y = torch.nn.functional.gelu(x @ w1.T) @ w2.T
        y.float().square().mean().backward()
        w1.grad = w2.grad = None

    step()  # warm-up: oneDNN's kernels and packing buffers
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_auto_precision(bf16_emulated: bool) -> tuple[str, str]:
    """(precision, why) for `--precision auto` on this CPU; measures once per machine (see module)."""
    pinned = os.environ.get(ENV)
    if pinned:
        if pinned not in ("fp32", "bf16"):
            raise UsageError(f"${ENV}={pinned!r}: use fp32 or bf16 (or unset it to measure)")
        return pinned, f"${ENV}"
    if bf16_emulated:
        return "fp32", "this CPU has no bf16 matmul kernels"
    key = cpu_identity()
    try:
        cache = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key) if isinstance(cache, dict) else None
    if not (isinstance(entry, dict) and all(isinstance(entry.get(k), float) for k in ("fp32_s", "bf16_s"))):
        entry = {"fp32_s": probe_seconds("fp32"), "bf16_s": probe_seconds("bf16")}
        cache = {**(cache if isinstance(cache, dict) else {}), key: entry}
        try:
            write_atomic(cache_file(), json.dumps(cache, indent=1))
        except OSError:
            pass  # a read-only home only costs the probe next time
        when = "measured now"
    else:
        when = f"measured before, cached in {cache_file()}"
    speedup = entry["fp32_s"] / entry["bf16_s"]
    choice = "bf16" if speedup >= MARGIN else "fp32"
    return choice, (f"bf16 autocast ran a GPT-2 MLP block's forward and backward {speedup:.2f}x as fast as fp32 "
                    f"on this CPU ({when}; bf16 needs {MARGIN}x)")
