"""The device a process runs on (`resolve_device`, `with_index`, `synchronize`, the host allocator and
data-loader workers), compilation (`compile_enabled`, `maybe_compile`) and what a process may allocate
(`device_capacity`: in all; `available_device_memory`, `available_host_memory`: now;
`refuse_beyond_host`): everything the model is run *with* but its precision (gpt2forge.core.precision),
determinism (`determinism`) and loss scaling (`loss_scaler`), applied from outside.

Order in which the trainer applies things to a model (documented once, here):
  1. build on CPU and initialise/load weights        (model.build)
  2. move to the device                              (resolve_device)
  3. loss implementation, activation checkpointing  (memory_features.apply_memory_features)
  4. data-parallel wrapper                           (parallel.distributed.wrap_data_parallel)
  5. torch.compile                                   (maybe_compile)
On CPU, configure_host_allocator keeps freed training buffers in the process instead of
returning them to the OS each step. The memory queries are shared by the memory plan, the trainer's
and the generator's size checks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError

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


def compile_enabled(mode: str, device: torch.device, cache_dir: str | None) -> bool:
    """--torch-compile auto (on for CUDA) | true | false; points inductor at --executable-cache-dir."""
    if cache_dir:  # inductor reads it when it first compiles; the flag wins over the environment
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    return mode == "true" or (mode == "auto" and device.type == "cuda")


def maybe_compile(model: torch.nn.Module, mode: str, device: torch.device, cache_dir: str | None):
    """The module to call: `model` under torch.compile (with the training graph passes of
    `graph_passes`) when `compile_enabled`, else itself."""
    if not compile_enabled(mode, device, cache_dir):
        return model
    from gpt2forge.core.graph_passes import compile_options  # imports inductor: only when compiling

    return torch.compile(model, options=compile_options())


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
