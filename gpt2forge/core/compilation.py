"""Compilation: whether --torch-compile applies here (`compile_enabled`) and the module to call
(`maybe_compile`: torch.compile with the training graph passes of `graph_passes`), applied last, from
outside the model (the order is in `device`'s docstring)."""

from __future__ import annotations

import hashlib
import os

import torch

from gpt2forge.core.precision import cpu_identity


def machine_cache_dir(cache_dir: str) -> str:
    """The folder of `cache_dir` (--executable-cache-dir) that this machine's compilations go to.

    Inductor generates its CPU kernels for the vector ISA it picks (the CPU's, or ATEN_CPU_CAPABILITY's)
    and builds them with -march=native, yet keys neither in its cache: kernels cached on one CPU class
    and loaded on another, as from a cache on a shared file system or a copied checkout, index out of
    bounds, stop on an illegal instruction or compute wrong values. One folder per CPU (its model and
    flags, the threads torch uses, torch's version, the ISA-limiting variables set: `cpu_identity`)
    keeps each class's kernels apart."""
    return os.path.join(cache_dir, "cpu-" + hashlib.sha256(cpu_identity().encode()).hexdigest()[:12])


def use_machine_cache(cache_dir: str | None) -> None:
    """Points inductor at this machine's folder (`machine_cache_dir`) of its cache: `cache_dir`
    (--executable-cache-dir), else TORCHINDUCTOR_CACHE_DIR (a cache that machines share is often
    named that way), else inductor's default in /tmp (which a run held to an older instruction set
    by `ISA_LIMITS` shares with the machine's own runs). Inductor reads the variable when it first
    compiles; the flag wins over the environment; a folder already chosen is kept."""
    base = cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = default_cache_dir()
    if cache_dir or not os.path.basename(os.path.normpath(base)).startswith("cpu-"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = machine_cache_dir(base)


def compile_enabled(mode: str, device: torch.device, cache_dir: str | None) -> bool:
    """--torch-compile auto (on for CUDA) | true | false; points inductor at this machine's folder of
    its cache (`use_machine_cache`)."""
    use_machine_cache(cache_dir)
    return mode == "true" or (mode == "auto" and device.type == "cuda")


def maybe_compile(model: torch.nn.Module, mode: str, device: torch.device, cache_dir: str | None):
    """The module to call: `model` under torch.compile (with the training graph passes of
    `graph_passes`) when `compile_enabled`, else itself."""
    if not compile_enabled(mode, device, cache_dir):
        return model
    from gpt2forge.core.graph_passes import compile_options  # imports inductor: only when compiling

    return torch.compile(model, options=compile_options())
