"""The whole model in every process: one process, or DDP replicas with ZeRO-0/1.

Every replica holds every parameter; DDP all-reduces (averages) the gradients once per update,
during the last micro-batch's backward, overlapped with it. ZeRO-1 shards the optimizer state
across the replicas (train.optim builds a ZeroRedundancyOptimizer from `optimizer_placement`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gpt2forge.core.runtime import maybe_compile
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


class DataParallel(Strategy):
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
