"""The device a process runs on: `resolve_device` (--device -> a torch.device with its index),
`with_index`, `synchronize` (for step timing), the host allocator (`configure_host_allocator`) and
the data-loader workers the host's CPUs allow (`loader_workers`).

Order in which the trainer applies things to a model (documented once, here):
  1. build on CPU and initialise/load weights        (model.build)
  2. move to the device                              (resolve_device)
  3. loss implementation, activation checkpointing  (memory_features.apply_memory_features)
  4. data-parallel wrapper                           (parallel.distributed.wrap_data_parallel)
  5. torch.compile                                   (core.compilation.maybe_compile)
On CPU, configure_host_allocator keeps freed training buffers in the process instead of
returning them to the OS each step.
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


def synchronize(device: torch.device) -> float:
    """Wait for queued device work; return perf_counter() (for step timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
