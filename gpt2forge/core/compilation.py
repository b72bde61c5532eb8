"""Compilation: whether --torch-compile applies here (`compile_enabled`) and the module to call
(`maybe_compile`: torch.compile with the training graph passes of `graph_passes`), applied last, from
outside the model (the order is in `device`'s docstring)."""

from __future__ import annotations

import os

import torch


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
