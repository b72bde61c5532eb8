"""Which device-dependent code path runs: decided for a device in one place, forced by tests.

A few paths of the model, the fused loss and the generator exist for CUDA only (FlexAttention's
block mask, a compiled cross-entropy pass, CUDA-graph decoding, attention dropout inside SDPA).
They ask `capabilities(device)` instead of testing `device.type` themselves, so that a CPU test
can run each of them on CPU inductor under `forced(...)`:

    with forced(flex_attention=True):
        model(ids, labels, position_ids, document_ids)  # the block mask, on the CPU

`capabilities` is plain Python that dynamo traces: a compiled forward guards on what was forced
and recompiles when it changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The device-dependent choices; each field's default is where it is True."""

    flex_attention: bool
    """Packed documents attend through a FlexAttention block mask (gpt2forge.model.documents) when
    there is no attention dropout, instead of SDPA with a dense (B, 1, T, T) mask. CUDA."""
    compiled_xent_rows: bool
    """The fused LM head's reference runs its one-vocabulary-chunk cross-entropy pass
    torch.compile'd (gpt2forge.ops.lm_head_loss.xent_rows), nested inside the custom op. CUDA."""
    graph_decode: bool
    """A compiled generator decodes with torch.compile(mode="reduce-overhead"), i.e. CUDA graphs,
    instead of the CPU's fused C++ step or captured inductor graph (gpt2forge.generate.generator). CUDA."""
    sdpa_dropout: bool
    """Attention dropout is SDPA's (`dropout_p`, inside CUDA's flash kernel), instead of the chunked
    CPU path (gpt2forge.model.dropout.causal_attention_dropout). Every device but the CPU."""


_forced: dict[str, bool] = {}
"""The choices `forced` overrides, by field name; empty outside it."""


def capabilities(device: torch.device) -> Capabilities:
    """The choices for tensors on `device`, with what `forced` overrides."""
    cuda = device.type == "cuda"
    return Capabilities(**{"flex_attention": cuda, "compiled_xent_rows": cuda, "graph_decode": cuda,
                           "sdpa_dropout": device.type != "cpu", **_forced})


@contextlib.contextmanager
def forced(**choices: bool) -> Iterator[None]:
    """Inside the block, `capabilities` answers `choices` (field names of Capabilities) on every
    device; for tests, which run the CUDA paths' logic on the CPU with it. Nests; not thread-local.

    Raises:
        TypeError: a name that is not a field of Capabilities.
    """
    global _forced
    unknown = set(choices) - {f.name for f in dataclasses.fields(Capabilities)}
    if unknown:
        raise TypeError(f"forced({', '.join(sorted(unknown))}): not a capability; "
                        f"choose from {', '.join(f.name for f in dataclasses.fields(Capabilities))}")
    before = _forced
    _forced = {**before, **choices}
    try:
        yield
    finally:
        _forced = before
