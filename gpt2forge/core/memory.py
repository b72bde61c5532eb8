"""What a process may allocate: `device_capacity` (in all), `available_device_memory` and
`available_host_memory` (now), and `refuse_beyond_host` (a UsageError before an allocation the host
cannot hold). Shared by the memory plan and the trainer's, the model builder's and the generator's
size checks."""

from __future__ import annotations

import torch

from gpt2forge.core.errors import UsageError

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
