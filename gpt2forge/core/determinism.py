"""`--deterministic`: torch's deterministic algorithms around a run, the previous setting restored after."""

from __future__ import annotations

import contextlib
import os

import torch


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
