"""Device, precision and compilation: everything the model is run *with*, applied from outside.

Order in which the trainer applies things to a model (documented once, here):
  1. build on CPU and initialise/load weights        (model.py, checkpoint.py)
  2. move to the device                              (resolve_device)
  3. loss implementation, activation checkpointing  (memory.apply_memory_features)
  4. data-parallel wrapper                           (distributed.wrap_data_parallel)
  5. torch.compile                                   (maybe_compile)
On CPU, configure_host_allocator keeps freed training buffers in the process instead of
returning them to the OS each step. What a process may allocate (`device_capacity`: in all;
`available_device_memory`, `available_host_memory`: now) is asked here too: the memory plan, the
trainer's and the generator's size checks share it.
Precision is not a model property: weights stay fp32 (master copy) and autocast runs the matmuls
in bf16/fp16; fp16 adds loss scaling (LossScaler).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
import time

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.core.precision import cpu_auto_precision

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)


def configure_host_allocator() -> bool:
    """Keep freed memory in the process (glibc): no mmap for large blocks, no trimming.

    A training step frees and re-allocates the same large activation buffers every step; by
    default glibc serves large blocks with mmap and returns them on free, so each step
    pays page faults to zero fresh pages again. This is what MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=<huge> do, applied from inside (the environment wins when set). The
    price: the resident set stays at its peak. Returns whether it was applied (glibc only).
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_MAX_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, ...)
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


@functools.cache
def loader_workers(requested: int) -> int:
    """--num-workers, at most the CPUs this process may run on (the default 4 on a 2-core machine
    would oversubscribe it, and the DataLoader warns); one notice when it is lowered."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested <= cpus:
        return requested
    log.notice(f"--num-workers {requested}: this process may use {cpus} CPUs; {cpus} data-loader workers run")
    return cpus


def resolve_device(name: str) -> torch.device:
    """--device auto|cpu|cuda|cuda:N -> a torch.device that exists here. A CUDA device always
    carries its index (`cuda` is the current device, normally `cuda:0`): NCCL's
    `init_process_group(device_id=...)`, `torch.cuda.set_device` and the memory queries need one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA GPU is visible (this torch build: {torch.__version__}); "
                             "use --device cpu or install a CUDA build of torch (TORCH_SPEC in the Makefile)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
        dev = with_index(dev)
    elif dev.type != "cpu":
        raise UsageError(f"--device {name} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def with_index(device: torch.device) -> torch.device:
    """`device` with its index: a bare `cuda` becomes the current CUDA device (`cuda:0` unless
    `torch.cuda.set_device` chose another); other devices are returned as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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


def compile_enabled(mode: str, device: torch.device, cache_dir: str | None) -> bool:
    """--torch-compile auto (on for CUDA) | true | false; points inductor at --executable-cache-dir."""
    if cache_dir:  # inductor reads it when it first compiles; the flag wins over the environment
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    return mode == "true" or (mode == "auto" and device.type == "cuda")


@contextlib.contextmanager
def deterministic_algorithms(mode: str, device: torch.device):
    """--deterministic auto (on the CPU) | true | false: torch's deterministic algorithms inside the
    block, torch's previous setting restored after. Eager CPU runs repeat bit for bit without it;
    compiled ones did not: inductor's CPU scatter-add (the embedding's gradient) adds with atomics
    in whatever order the threads reach a row. In deterministic mode it calls ATen's ordered kernel
    instead, at no measurable cost to GPT-2 small's compiled CPU step (measured: docs/benchmarks.md,
    Design measurements), and `make train`'s model repeats to the bit. Uninitialised memory is not
    filled (the trainer reads none). On CUDA, "true" sets CUBLAS_WORKSPACE_CONFIG (when unset,
    before cuBLAS starts) and only warns where an operator has no deterministic kernel."""
    on = mode == "true" or (mode == "auto" and device.type == "cpu")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    if on:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
        torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield on
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


def maybe_compile(model: torch.nn.Module, mode: str, device: torch.device, cache_dir: str | None):
    """The module to call: `model` under torch.compile (with the training graph passes of
    `graph_passes`) when `compile_enabled`, else itself."""
    if not compile_enabled(mode, device, cache_dir):
        return model
    from gpt2forge.core.graph_passes import compile_options  # imports inductor: only when compiling

    return torch.compile(model, options=compile_options())


class LossScaler:
    """fp16 loss scaling: static (--loss-scaling S) or dynamic (--auto-loss-scaling): Megatron-Core's
    DynamicGradScaler rule, halve after `hysteresis` overflowing updates (never below `min_scale`),
    double after `growth_interval` clean updates in a row (which also restores the hysteresis count).
    Overflowing updates are skipped. For fp32/bf16 it is disabled: scale 1, nothing skipped."""

    def __init__(self, enabled: bool, init_scale: float, dynamic: bool, growth_interval: int = 2000,
                 min_scale: float = 1.0, hysteresis: int = 1):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.dynamic = dynamic and enabled
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.hysteresis_left = hysteresis
        self.good_steps = 0
        self.skipped = 0

    @property
    def can_lower(self) -> bool:
        """Whether an overflow is the scaler's own signal: dynamic scaling above `min_scale` still has a
        lower scale to try (Megatron turns its NaN check off then: the NaNs are the scaler's input)."""
        return self.dynamic and self.scale > self.min_scale

    def unscale_and_check(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale; return True when all are finite (the update may proceed)."""
        if not self.enabled:
            return True
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = torch.zeros(1, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        return not bool(found_inf.item())

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.dynamic and self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.growth_interval == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
        self.hysteresis_left = state.get("hysteresis_left", self.hysteresis)  # absent before it existed


AUTO_FP16_INITIAL_SCALE = 2.0**16
"""The first loss scale where --precision auto chose fp16: torch.amp.GradScaler's (the reference's
--auto-loss-scaling starts at 1.0, which leaves small fp16 gradients to underflow for the thousands
of updates the scale takes to grow)."""


def build_loss_scaler(rt, precision: str) -> LossScaler:
    """The run's LossScaler from its RuntimeArgs `rt` (gpt2forge.train.config) and resolved `precision`:
    enabled for fp16 only; dynamic from --initial-loss-scale with --auto-loss-scaling, else static at
    --loss-scaling, except where --precision auto chose fp16 (a GPU without native bf16), which is
    dynamic from AUTO_FP16_INITIAL_SCALE: a run that did not ask for fp16 gets a scale that follows
    its gradients."""
    auto_fp16 = precision == "fp16" and rt.precision == "auto"
    if rt.auto_loss_scaling:
        init = rt.initial_loss_scale
    else:
        init = AUTO_FP16_INITIAL_SCALE if auto_fp16 else rt.loss_scaling
    return LossScaler(precision == "fp16", init, rt.auto_loss_scaling or auto_fp16, rt.loss_scale_window,
                      rt.min_loss_scale, rt.loss_scale_hysteresis)


def synchronize(device: torch.device) -> float:
    """Wait for queued device work; return perf_counter() (for step timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


GiB = 2**30


def device_capacity(device: torch.device) -> tuple[float, str]:
    """(bytes, description) of what one process may use: the GPU's memory, or the host's available memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{props.name} ({props.total_memory / GiB:.1f} GiB)"
    have = available_host_memory()
    return have, f"host memory ({have / GiB:.1f} GiB available)"


def available_device_memory(device: torch.device) -> tuple[float, str]:
    """(bytes, description) a new allocation may take now: on a GPU what is free (cudaMemGetInfo)
    plus what this process's caching allocator holds unused, so unlike `device_capacity` the
    memory already taken (the model's weights, other processes) is not counted; on the CPU the
    host's available memory."""
    if device.type != "cuda":
        return device_capacity(device)
    free, total = torch.cuda.mem_get_info(device)
    have = float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return have, f"{torch.cuda.get_device_name(device)} ({have / GiB:.1f} of {total / GiB:.1f} GiB free)"


def available_host_memory() -> float:
    """Bytes of host memory available to a new allocation: psutil's figure when it is installed,
    else MemAvailable of /proc/meminfo (Linux)."""
    try:
        import psutil  # optional: not a dependency
    except ImportError:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return float(info.get("MemAvailable", 0))
    return float(psutil.virtual_memory().available)


def refuse_beyond_host(need: float, what: str, fix: str) -> None:
    """UsageError naming `what` (its `need` bytes) and the fix when it exceeds the host's available memory."""
    have = available_host_memory()
    if need > have:
        raise UsageError(f"{what} need {need / GiB:,.1f} GiB and this host has {have / GiB:,.1f} GiB available; {fix}")
