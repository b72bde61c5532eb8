"""Precision: `--precision` resolved on this device (`resolve_precision`), the dtypes and the autocast
context a run computes in, and the matmul settings that go with them (`configure_matmul`). Precision
is not a model property: weights stay fp32 (master copy) and autocast runs the matmuls in bf16/fp16;
fp16 adds loss scaling (gpt2forge.core.loss_scaler).

`--precision auto` on a CPU: bf16 autocast or fp32, whichever trains faster here, measured.

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

import contextlib
import functools
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.device import with_index
from gpt2forge.core.errors import UsageError

MARGIN = 1.15
"""bf16 is chosen when its probe takes at most 1/MARGIN of fp32's: a tie keeps fp32's exact math."""
ENV = "GPT2FORGE_CPU_PRECISION"
"""Set to fp32 or bf16: `auto` takes it on the CPU without a probe (tests and pinned setups)."""


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "GPT2FORGE_OPS_ISA")
"""Variables that hold ATen, inductor, oneDNN, MKL or the custom ops to an older instruction set: a
measurement or a compilation made under one is another machine's."""


@functools.cache
def _cpu_model_and_flags() -> tuple[str, str]:
    """The CPU's model name and a digest of its flags, from /proc/cpuinfo (read once)."""
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
    return model, hashlib.sha256(flags.encode()).hexdigest()[:12]


def isa_limits() -> dict[str, str]:
    """The `ISA_LIMITS` variables set in this process, by name."""
    return {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}


def cpu_identity() -> str:
    """This CPU as a cache key: its model name and a digest of its flags (a VM's model name alone,
    "Intel Xeon Processor", covers CPUs with and without AMX), the threads torch uses now, torch's
    version, and the `ISA_LIMITS` set (none: the key of the CPU as it is)."""
    model, digest = _cpu_model_and_flags()
    limits = "".join(f"|{name}={value}" for name, value in isa_limits().items())
    return f"{model}|{digest}|{torch.get_num_threads()} threads|torch {torch.__version__}{limits}"


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


def cpu_half_matmul_is_emulated(precision: str) -> bool:
    """True when oneDNN has no bf16/fp16 matmul kernels for this CPU (bf16 needs AVX-512 or newer,
    fp16 AVX-512-FP16/AMX): autocast matmuls are then emulated, orders of magnitude slower than
    fp32 on an AVX2-only x86 (measured: docs/benchmarks.md, Design measurements)."""
    check = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}.get(precision)
    if check is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        return not getattr(torch.ops.mkldnn, check)()
    except (AttributeError, RuntimeError):
        return False  # a torch without the query: assume native


def gpu_has_native_bf16() -> bool:
    """Whether the current GPU computes in bf16 natively (compute capability 8.0 or newer).
    `torch.cuda.is_bf16_supported()` counts emulation by default: on a V100 or T4 (7.x), where a
    bf16 tensor can be made but every bf16 matmul is emulated, it says True."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_precision(name: str, device: torch.device) -> str:
    """--precision auto -> on a CUDA GPU bf16 where it is native, else fp16 (the trainer scales its loss
    dynamically: `build_loss_scaler`); on a CPU whichever of bf16 and fp32 a probe measured faster
    here (gpt2forge.core.precision); else fp32; the choice said in one line. Refuses bf16 on a GPU
    without native bf16, and warns (once, here) when a CPU would emulate bf16/fp16 matmuls."""
    if name != "auto":
        if name == "bf16" and device.type == "cuda" and not gpu_has_native_bf16():
            raise UsageError(f"--precision bf16: {_gpu_name(device)} has no native bf16 (compute capability "
                             f"{_capability(device)}, bf16 needs 8.0 or newer) and would emulate every bf16 "
                             "matmul; use --precision fp16 (or auto: fp16 with dynamic loss scaling)")
        if device.type == "cpu" and cpu_half_matmul_is_emulated(name):
            log.notice(f"--precision {name}: this CPU has no {name} matmul kernels, so its {name} matmuls are "
                       "emulated, far slower than fp32 (~100x on an AVX2-only CPU); --precision fp32 runs faster")
        return name
    if device.type == "cuda":
        if gpu_has_native_bf16():
            return "bf16"
        log.info(f"Precision: fp16 (--precision auto: {_gpu_name(device)}, compute capability {_capability(device)}, "
                 "has fp16 tensor cores and no native bf16; training scales the loss dynamically)")
        return "fp16"
    if device.type == "cpu":
        choice, why = cpu_auto_precision(cpu_half_matmul_is_emulated("bf16"))
        log.info(f"Precision: {choice} (--precision auto: {why})")
        return choice
    return "fp32"


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(with_index(device))


def _capability(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(with_index(device))
    return f"{major}.{minor}"


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--precision value -> torch dtype."""


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in for a precision (None: fp32, no autocast)."""
    return None if precision == "fp32" else PRECISION_DTYPES[precision]


def autocast(device: torch.device, precision: str):
    """Mixed-precision context for forward + loss; a no-op context for fp32."""
    dtype = autocast_dtype(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def configure_matmul(device: torch.device, precision: str, half_partials: bool) -> None:
    """TF32 for fp32 matmuls on CUDA; reduced-precision accumulation of fp16/bf16 matmuls on CUDA
    exactly when --enable-half-partials is on (fp32 partials otherwise, as the reference's default)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # Set both ways: torch allows reduced-precision (split-K) reductions by default, so only
        # setting them when the flag is on would leave fp16/bf16 partials on in every run.
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = half_partials
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = half_partials
    elif half_partials:
        log.notice("--enable-half-partials has no equivalent on CPU (matmuls accumulate in fp32); ignored")
