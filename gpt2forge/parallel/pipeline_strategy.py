"""Pipeline stages in their own processes (gpt2forge.parallel.pipeline_stages.Pipeline), replicas of
each stage data-parallel, with ZeRO-1 (optimizer state) or FSDP2 (ZeRO-2/3) inside each stage
across its replicas, or tensor parallelism inside each stage (`--tensor-model-parallel-size`,
without ZeRO: stages x replicas x tp processes, see pipeline's grid).

An update's micro-batches go through the schedule at once; the loss lives on the last stage (the
others' totals are zeros), the gradient norm and the fp16 finite check are agreed over all stages,
and rank 0 gathers the other stages' weights and optimizer state into its whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gpt2forge.core import log
from gpt2forge.core.compilation import compile_enabled
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.distributed import DistEnv, all_reduce_sum, full_tensor, local_tensor
from gpt2forge.parallel.health import Watchdog
from gpt2forge.parallel.pipeline_stages import Grid, Pipeline
from gpt2forge.parallel.strategy import MicroBatch, OptimizerPlacement, ParallelRequest, Strategy, as_micro_batch
from gpt2forge.parallel.tensor_parallel import check_request


class PipelineStrategy(Strategy):
    """This process's stage of one replica's pipeline."""

    @classmethod
    def applies(cls, request: ParallelRequest) -> bool:
        return request.layout is not None and request.layout.pipelined

    def __init__(self, model: GPT2LMHeadModel, request: ParallelRequest):
        layout, env = request.layout, request.env
        grid = Grid(layout.stages, layout.data_parallel, env.rank, layout.tensor_parallel)
        if grid.tensor_parallel > 1:
            check_request(model, request)  # refuses ZeRO and offload; tensor-parallel stages run eager
        compiled = grid.tensor_parallel == 1 and compile_enabled(request.compile_mode, request.device,
                                                                 request.compile_cache)
        self.pipeline = Pipeline(model, layout, grid, request.device, request.schedule, request.micro_batches,
                                 compiled, request.zero, request.offload, request.param_dtype)
        if request.zero >= 2 and not self.pipeline.fsdp:
            log.notice(f"--zero-stage {request.zero}: one replica per pipeline stage, nothing to shard")
        self.model, self.env, self.device = model, env, request.device
        self.replica = DistEnv(grid.replica, env.local_rank, grid.replicas)
        self.batch_size = request.batch_size
        # FSDP2 moves the shards and the update to the host itself.
        self.offload = request.offload and not self.pipeline.fsdp
        self.zero = request.zero

    @property
    def processes_per_replica(self) -> int:
        return self.pipeline.grid.stages * self.pipeline.grid.tensor_parallel  # they hold the same batches

    @property
    def uniform_arguments(self) -> bool:
        return True

    @property
    def process_name(self) -> str:
        grid = self.pipeline.grid
        tp = f", tensor-parallel rank {grid.tp_rank}" if grid.tensor_parallel > 1 else ""
        return f"rank {self.env.rank} (pipeline stage {grid.stage}{tp})"

    def attach_watchdog(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        # Progress = a micro-batch's forward through this stage.
        self.pipeline.module.register_forward_pre_hook(lambda *_: watchdog.kick())

    def optimizer_placement(self) -> OptimizerPlacement:
        # ZeRO-1 shards across the replicas of each stage.
        return OptimizerPlacement(self.pipeline.module, offload=self.offload,
                                  shard=self.zero == 1 and self.replica.world_size > 1,
                                  shard_group=self.pipeline.dp_group)

    def forward_backward(self, micro_batches: list[MicroBatch], scale: torch.Tensor) -> torch.Tensor:
        batches = [as_micro_batch(b) for b in micro_batches]
        ids = {name: torch.cat([b.model_kwargs()[name] for b in batches]) for name in batches[0].model_kwargs()}
        return self.pipeline.step(torch.cat([b.inputs for b in batches]), torch.cat([b.labels for b in batches]),
                                  scale, **ids)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.pipeline.parameters()

    def clip_grad_norm(self, max_norm: float | None) -> float:
        grid = self.pipeline.grid
        copies = 1 if self.pipeline.fsdp else self.replica.world_size * grid.tensor_parallel
        return clip_grad_norm(self.trainable_parameters(), self.pipeline.norm_parameters(), max_norm, copies,
                              tensor_parallel=grid.tensor_parallel > 1)

    def all_finite(self, finite: bool) -> bool:
        return all_finite(finite, self.device)  # fp16: each stage unscaled its own gradients

    @property
    def evaluation_rows(self) -> int:
        return self.batch_size * self.pipeline.micro_batches

    def evaluate_batch(self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        # The schedule takes exactly its micro-batches: pad with unscored rows (one document each).
        short = self.evaluation_rows - x.shape[0]
        x = torch.cat([x, x.new_zeros(short, x.shape[1])])
        y = torch.cat([y, y.new_full((short, y.shape[1]), IGNORE_INDEX)])
        ids = MicroBatch(x, y, position_ids, document_ids).model_kwargs()
        ids = {name: torch.cat([t, t.new_zeros(short, t.shape[1])]) for name, t in ids.items()}
        return self.pipeline.evaluate(x, y, **ids)

    def sum_evaluation(self, totals: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(totals)  # replicas' shares; the loss lives on the last stage

    def set_training(self, mode: bool) -> None:
        self.model.train(mode)
        self.pipeline.module.train(mode)

    def report_peak_memory(self, peak_memory_gib: float) -> None:
        self.pipeline.report_peak_memory(peak_memory_gib)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        return self.pipeline.optimizer_state(optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, indexed: dict) -> None:
        self.pipeline.load_optimizer_state(optimizer, indexed)

    def whole_model(self) -> GPT2LMHeadModel | None:
        self.pipeline.gather_weights()
        return self.model if self.env.is_main else None


def clip_grad_norm(params: list[nn.Parameter], norm_params: list[nn.Parameter], max_norm: float | None,
                   copies: int, tensor_parallel: bool = False) -> float:
    """The global gradient norm over all stages, clipped to `max_norm` unless it is None: each
    stage's squared norm summed over the world (replicas hold equal gradients after their
    all-reduce, so the sum counts each stage `copies` = replicas times; pass 1 when FSDP2 shards
    them). `tensor_parallel`: the gradients are DTensors over each stage's tensor-parallel ranks,
    whose norm (sharded squares summed, replicated ones once) every tp rank holds: pass
    `copies` = replicas x tp."""
    grads = [p.grad for p in norm_params if p.grad is not None]
    if tensor_parallel and grads:
        sq = full_tensor(torch.nn.utils.get_total_norm(grads, foreach=True)).float().pow(2)
    elif grads:
        sq = torch.stack([local_tensor(g).float().pow(2).sum() for g in grads]).sum()
    else:
        sq = torch.zeros((), device=local_tensor(params[0]).device)
    dist.all_reduce(sq)
    total = float((sq / copies).sqrt())
    coef = max_norm / (total + 1e-6) if max_norm is not None else 1.0
    if coef < 1.0:
        torch._foreach_mul_([local_tensor(p.grad) for p in params if p.grad is not None], coef)
    return total


def all_finite(finite: bool, device: torch.device) -> bool:
    """True when every rank's gradients were finite (fp16 loss scaling must skip everywhere or nowhere)."""
    flag = torch.tensor([0.0 if finite else 1.0], device=device)
    dist.all_reduce(flag)
    return bool(flag.item() == 0)
