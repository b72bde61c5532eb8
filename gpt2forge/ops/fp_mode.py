"""The CPU threads' floating-point modes: denormals flushed to zero (custom_ops/fp_mode.cpp).

On an Intel core every multiply that reads or makes a denormal (below 1.2e-38) takes a microcode
assist: a softmax whose logits lie more than 87 apart makes them, and GPT-2 small's training step
ran an order of magnitude slower on the 2-core AMX Xeon when its LM head's gradient carried them
(measured: docs/benchmarks.md, Design measurements). The trainer sets "flush to zero" and
"denormals are zero" on the CPU, as TensorFlow's CPU runtime does; values that small then read and
come out as zero.

    threads = flush_denormals()       # the calling thread and torch's intra-op threads; 0: not x86
    with denormals_flushed(device):   # on the CPU inside the block, the calling thread's mode restored after
        ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gpt2forge.ops import library as custom_ops


def flush_denormals(on: bool = True) -> int:
    """Flush denormals to zero (or stop, `on=False`) on the calling thread and every intra-op thread;
    returns how many threads were set (0: the CPU has no such mode). Without the custom ops library
    only the calling thread is set (`torch.set_flush_denormal`), which new threads inherit but
    torch's existing OpenMP threads do not."""
    if custom_ops.has_op("flush_denormals"):
        return torch.ops.gpt2forge.flush_denormals(on)
    return 1 if torch.set_flush_denormal(on) else 0


@contextlib.contextmanager
def denormals_flushed(device: torch.device) -> Iterator[None]:
    """Denormals flushed to zero on every CPU thread inside the block (nothing to do for another
    device); after it, every thread back to the mode the calling thread had (off, when the library
    that could tell is not built), so an in-process caller (a test, a notebook) keeps its own."""
    if device.type != "cpu":
        yield
        return
    before = custom_ops.has_op("denormals_flushed") and torch.ops.gpt2forge.denormals_flushed()
    flush_denormals(True)
    try:
        yield
    finally:
        flush_denormals(before)
