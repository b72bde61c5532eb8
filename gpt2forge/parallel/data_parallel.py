"""The whole model in every process: one process, or DDP replicas with ZeRO-0/1.

Every replica holds every parameter; DDP all-reduces (averages) the gradients once per update,
during the last micro-batch's backward, overlapped with it. ZeRO-1 shards the optimizer state
across the replicas (train.optim builds a ZeroRedundancyOptimizer from `optimizer_placement`).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from gpt2forge.core.compilation import maybe_compile
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.distributed import full_optimizer_state, full_tensor, wrap_data_parallel
from gpt2forge.parallel.strategy import (
    MicroBatch,
    OptimizerPlacement,
    ParallelRequest,
    Strategy,
    as_micro_batch,
    loss_totals,
)


class DataParallelStrategy(Strategy):
    """One process (`env.world_size == 1`) or one DDP replica per process."""

    @classmethod
    def applies(cls, request: ParallelRequest) -> bool:
        pipelined = request.layout is not None and request.layout.pipelined
        return not pipelined and request.zero < 2

    def __init__(self, model: GPT2LMHeadModel, request: ParallelRequest):
        self.model, self.env, self.replica, self.device = model, request.env, request.env, request.device
        self.batch_size = request.batch_size
        self.offload, self.zero = request.offload, request.zero
        self.wrapped = self._wrap(model, request)
        # Order: memory features (before), then DDP/FSDP2, then torch.compile around what is called.
        self.forward = maybe_compile(self.wrapped, request.compile_mode, request.device, request.compile_cache)

    def _wrap(self, model: GPT2LMHeadModel, request: ParallelRequest) -> nn.Module:
        """The module the forward calls: DDP around the model with several processes."""
        return wrap_data_parallel(model, request.env, request.device)

    def optimizer_placement(self) -> OptimizerPlacement:
        return OptimizerPlacement(self.model, offload=self.offload,
                                  shard=self.zero == 1 and self.replica.world_size > 1)

    @property
    def whole_gradients(self) -> bool:
        return self.processes_per_replica == 1

    def _gradient_sync(self, sync: bool):
        """A context in which the backward all-reduces the gradients (`sync`) or only accumulates."""
        no_sync = not sync and self.wrapped is not self.model
        return self.wrapped.no_sync() if no_sync else contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[MicroBatch], scale: torch.Tensor) -> torch.Tensor:
        totals = torch.zeros(3, device=self.device)
        for i, batch in enumerate(map(as_micro_batch, micro_batches)):
            if self.watchdog is not None:
                self.watchdog.kick()
            # Gradients are all-reduced once per update, during the last micro-batch's backward.
            with self._gradient_sync(i == len(micro_batches) - 1):
                out = self.forward(batch.inputs, batch.labels, **batch.model_kwargs())
                (out.loss_sum * scale).backward()
            totals += loss_totals(out)
        return totals

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]  # the device copies, even when offloaded

    def clip_grad_norm(self, max_norm: float | None) -> float:
        params = self.trainable_parameters()
        grads = [p.grad for p in params if p.grad is not None]
        if grads and all(type(g) is torch.Tensor and g.device.type == "cpu" and g.dtype == torch.float32
                         and g.is_contiguous() for g in grads):
            return clip_host_grads(grads, max_norm)
        if max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        else:
            total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        return float(full_tensor(total))  # FSDP2: over all shards

    def evaluate_batch(self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Eager: a compiled no-grad graph would cost a second compile.
        return loss_totals(self.model(x, y, position_ids, document_ids))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        return full_optimizer_state(optimizer, self.env)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, indexed: dict) -> None:
        optimizer.load_state_dict(indexed)

    def whole_model(self) -> GPT2LMHeadModel | None:
        return self.model if self.env.is_main else None


HOST_NORM_CHUNK = 1 << 20
"""Values per BLAS dot in `host_grad_norm` (their squares summed in float64)."""


def host_grad_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm of contiguous fp32 CPU gradients: BLAS dots of HOST_NORM_CHUNK values, summed
    in float64. torch's foreach norm runs one linalg.vector_norm per tensor on the CPU; over GPT-2
    small's gradients it was the slower on the 2-core AMX Xeon (measured: docs/benchmarks.md, Design
    measurements), and was 8.7e-4 low (1.6e-7 here)."""
    total = 0.0
    for g in grads:
        flat = g.view(-1)
        for i in range(0, flat.numel(), HOST_NORM_CHUNK):
            part = flat[i:i + HOST_NORM_CHUNK]
            total += float(torch.dot(part, part))
    return math.sqrt(total)


def clip_host_grads(grads: list[torch.Tensor], max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule (scale by min(max_norm / (norm + 1e-6), 1)) on CPU
    gradients, with `host_grad_norm`; returns the norm before clipping. The norm is on the host
    already, so an update within the bound skips the scaling pass (torch's multiplies every gradient
    by 1.0, a measurable part of GPT-2 small's step: docs/benchmarks.md, Design measurements); a
    non-finite norm scales by NaN or 0 as torch's does."""
    total = host_grad_norm(grads)
    if max_norm is not None:
        coef = max_norm / (total + 1e-6)
        if not coef >= 1.0:  # also NaN
            torch._foreach_mul_(grads, coef)
    return total
