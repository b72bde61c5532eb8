"""FSDP2 replicas, ZeRO-2/3: every block one unit, the root holding the embeddings, ln_f and the
tied head (distributed.shard_model).

Gradients are reduce-scattered once per update (in the last micro-batch's backward); the optimizer
updates this rank's shards (offloaded by FSDP2 itself with --offload optimizer|full, its CPU offload
policy: shards, gradients and the update in pinned host memory, each block copied to the device
ahead of use). Parameters are gathered in every forward, so every rank evaluates the whole set in
step; checkpoints gather the whole model and optimizer state onto rank 0's CPU.

One device: with `--offload full` a single process runs this strategy over a world of one (the
process group is made here when none exists), so a model whose weights, gradients and Adam state
exceed the device trains on it; on a CPU-only machine the same code path runs and moves nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.data_parallel import DataParallelStrategy
from gpt2forge.parallel.distributed import (
    DistEnv,
    init_single_process_group,
    load_sharded_optimizer_state,
    shard_model,
    sharded_state,
    whole_model_state,
)
from gpt2forge.parallel.optimizer_state import model_group_names, to_indexed, to_named
from gpt2forge.parallel.strategy import OptimizerPlacement, ParallelRequest


class ShardedStrategy(DataParallelStrategy):
    """One FSDP2 replica per process (`--zero-stage 2|3`; one process with `--offload full`)."""

    @classmethod
    def applies(cls, request: ParallelRequest) -> bool:
        pipelined = request.layout is not None and request.layout.pipelined
        return not pipelined and request.zero >= 2

    def _wrap(self, model: GPT2LMHeadModel, request: ParallelRequest) -> nn.Module:
        init_single_process_group(request.device)  # one process: FSDP2 over a world of one
        shard_model(model, request.zero, request.offload, request.device, request.param_dtype)
        return model

    def optimizer_placement(self) -> OptimizerPlacement:
        # With --offload FSDP2 keeps the shards on the host (CPUOffloadPolicy) and the update runs there.
        return OptimizerPlacement(self.model, host_update=self.offload)

    @property
    def whole_gradients(self) -> bool:
        return False  # each process holds its shards' gradients

    def _gradient_sync(self, sync: bool):
        self.model.set_requires_gradient_sync(sync)  # reduce-scatter once, in the last micro-batch's backward
        return contextlib.nullcontext()

    def evaluation_env(self) -> DistEnv:
        # Sharded parameters are gathered in every forward: all ranks score the whole set in step.
        return DistEnv()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        return self.checkpoint_state(optimizer)[1]

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, indexed: dict) -> None:
        load_sharded_optimizer_state(self.model, optimizer, to_named(indexed, model_group_names(self.model)))

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[GPT2LMHeadModel | None, dict | None]:
        model_state, named = sharded_state(self.model, optimizer)  # one gathering for both
        if not self.env.is_main:
            return None, None
        return whole_model_from(model_state, self.model.config), to_indexed(named, model_group_names(self.model))

    def whole_model(self) -> GPT2LMHeadModel | None:
        model_state = whole_model_state(self.model)
        return whole_model_from(model_state, self.model.config).to(self.device) if self.env.is_main else None


def whole_model_from(state: dict, config) -> GPT2LMHeadModel:
    """A plain model holding a whole-model state dict."""
    model = GPT2LMHeadModel(config)
    model.load_state_dict(state)
    return model
