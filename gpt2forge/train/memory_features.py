"""Memory features, applied to a model and optimizer from outside (the model knows nothing of them).

The reference's IPU memory flags and what they do here:
- `--embedding-serialization-factor F`, `--enable-sequence-serialized --serialized-seq-len S`,
  `--remap-logit`: the fused chunked LM head + loss (gpt2forge.ops.lm_head_loss), which never holds
  the (B*T, V) logits. It is the default (`--lm-loss fused`); `--lm-loss plain` is the classic
  full-logits cross-entropy.
- `--recompute-checkpoint-every-layer` / `--recompute-checkpoint-layers i j ...`: activation
  checkpointing per transformer block (torch.utils.checkpoint, non-reentrant, so it composes with
  torch.compile and with dropout: the RNG state is replayed in the recomputation).
- `--optimizer-state-offchip` (= `--offload optimizer`): the optimizer state lives in host memory
  and the update runs there (ZeRO-offload style, gpt2forge.train.optim.OffloadedOptimizer, or FSDP2's
  CPU offload policy under ZeRO-2/3), for CUDA runs; on CPU the state is already in host memory.
- `--offload full`: parameters, gradients and optimizer state in host memory, FSDP2 ZeRO-3 with its
  CPU offload policy, in one process too (docs/one_device.md). On the CPU the same FSDP2 path runs
  and moves nothing.

Order of application (run_training): loss implementation, then activation checkpointing, then
torch.compile, then the optimizer (offloaded or not).
"""

from __future__ import annotations

import resource
import sys
import types
from collections.abc import Iterable

import torch
from torch.utils.checkpoint import checkpoint

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops.lm_head_loss import LossChunking
from gpt2forge.parallel.memory_plan import MemoryArgs, resolved_lm_loss


def lm_loss_chunking(kind: str, remap_logit: bool, sequence_serialized: bool, serialized_seq_len: int,
                     embedding_serialization_factor: int) -> LossChunking | None:
    """The LossChunking the flags ask for, or None for the plain full-logits loss.

    Raises UsageError when `--lm-loss plain` is combined with a flag only the fused loss honours.
    """
    if kind == "plain":
        asked = [f for f, on in (("--remap-logit true", remap_logit),
                                 ("--enable-sequence-serialized true", sequence_serialized),
                                 ("--embedding-serialization-factor > 1", embedding_serialization_factor > 1)) if on]
        if asked:
            raise UsageError(f"--lm-loss plain contradicts {', '.join(asked)} (they chunk the fused loss); "
                             "drop one of them")
        return None
    return LossChunking(serialized_seq_len if sequence_serialized else None, embedding_serialization_factor)


def checkpointed_layers(n_layer: int, every_layer: bool, layers: list[int] | None) -> list[int]:
    """Block indices to recompute: the listed ones, else all with `every_layer`, else none.

    Raises UsageError for an index outside [0, n_layer).
    """
    if layers:
        bad = [i for i in layers if not 0 <= i < n_layer]
        if bad:
            raise UsageError(f"--recompute-checkpoint-layers {' '.join(map(str, bad))}: the model has blocks "
                             f"0..{n_layer - 1}")
        return sorted(set(layers))
    return list(range(n_layer)) if every_layer else []


def _checkpointed_forward(self, *args, **kwargs):
    # The class's forward, run under checkpoint: only the block input is saved, the rest recomputed.
    return checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: GPT2LMHeadModel, layers: Iterable[int]) -> None:
    """Recompute the activations of the given blocks in backward instead of storing them.

    The block's `forward` is replaced on the instance, so parameter names, state dicts and
    checkpoints are unchanged. Inference (no grad) pays nothing: checkpoint without grad is a call.
    """
    for i in layers:
        block = model.transformer.h[str(i)]
        block.forward = types.MethodType(_checkpointed_forward, block)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA max allocated since the last reset, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window where the device allows it (CUDA); the CPU's peak RSS only grows."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def apply_memory_features(model: GPT2LMHeadModel, cfg: MemoryArgs, device: torch.device) -> None:
    """Apply the loss implementation and activation checkpointing that `cfg` asks for (before
    torch.compile)."""
    model.fused_loss = lm_loss_chunking(resolved_lm_loss(cfg, device.type), cfg.remap_logit,
                                        cfg.enable_sequence_serialized, cfg.serialized_seq_len,
                                        cfg.embedding_serialization_factor)
    if model.fused_loss is not None:
        rows = model.fused_loss.rows(model.config.vocab_size, device.type)
        log.info(f"LM loss: fused, {rows} tokens x {model.fused_loss.vocab_chunks} vocabulary chunk(s) at a time")
        if device.type != "cpu":
            log.notice(f"fused LM loss on {device.type}: the chunked PyTorch implementation runs (the C++ kernel "
                       "is CPU-only); memory is still bounded")
    layers = checkpointed_layers(model.config.n_layer, cfg.recompute_checkpoint_every_layer,
                                 cfg.recompute_checkpoint_layers)
    apply_activation_checkpointing(model, layers)
    if layers:
        log.info(f"Activation checkpointing (recomputed in backward): blocks {', '.join(map(str, layers))}")


def offload_to_host(cfg: MemoryArgs, device: torch.device) -> bool:
    """Whether the run's state goes to host memory (ParallelRequest.offload): --offload optimizer on
    CUDA, --offload full on any device (FSDP2's CPU offload policy runs on the CPU too, moving
    nothing, so a CPU run takes the GPU's code path). A notice where nothing moves."""
    mode = cfg.offload_mode
    if mode != "none" and device.type != "cuda":
        log.notice(f"--offload {mode}: on the CPU the state is already in host memory; nothing moves"
                   + (" (FSDP2's CPU offload policy still runs, as on a GPU)" if mode == "full" else ""))
    return mode == "full" or (mode == "optimizer" and device.type == "cuda")
