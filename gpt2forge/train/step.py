"""One optimizer update (`train_step`) and one evaluation pass (`evaluate`) over a built `Run`.

The loss of an update is the mean over every scored token of the global batch; gradients are
averaged across replicas (DDP, ZeRO, FSDP2 or the pipeline's own reduction), their global norm is
logged and clipped, and an update whose gradients are not finite is skipped (in every precision).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gpt2forge.core import log
from gpt2forge.data import IGNORE_INDEX, ShardedStream, collate, split_batch
from gpt2forge.parallel.distributed import DistEnv, all_reduce_sum
from gpt2forge.core.errors import RunError
from gpt2forge.parallel.health import Watchdog
from gpt2forge.model.gpt2 import GPT2LMHeadModel, LMLoss
from gpt2forge.parallel.pipeline import Pipeline, all_finite, clip_grad_norm
from gpt2forge.core.runtime import LossScaler, autocast
from gpt2forge.train.config import TrainConfig


@dataclasses.dataclass
class Run:
    """Everything a step needs, built once."""

    cfg: TrainConfig
    model: GPT2LMHeadModel  # the module owning the parameters (saved)
    forward: Any  # what is called: the model or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    device: torch.device
    precision: str
    accumulation: int  # micro-batches per update in this process
    quick_eval: Any = None  # evaluation.quick.QuickEval for --eval-wikitext/--eval-lambada, or None
    dist_env: DistEnv = DistEnv()  # this process in the whole job
    replica: DistEnv = DistEnv()  # this process's data-parallel replica among the replicas (data slicing)
    ddp: Any = None  # the DistributedDataParallel wrapper when running several processes
    pipeline: Pipeline | None = None  # this process's pipeline stage, when stages have their own processes
    fsdp: bool = False  # ZeRO-2/3: `model` is sharded with FSDP2 (collectives in every forward)
    watchdog: Watchdog | None = None  # several processes: exits with a stack dump when training stalls
    nonfinite_in_a_row: int = 0  # updates skipped for non-finite gradients since the last good one
    grad_norm: float = 0.0  # the last update's global gradient norm (before clipping)

    @property
    def stage_processes(self) -> int:
        """Processes per replica (each holds the replica's batches)."""
        return self.pipeline.grid.stages if self.pipeline is not None else 1


def _totals(out: LMLoss) -> torch.Tensor:
    """(3,) fp32: loss sum, correct tokens, scored tokens (detached, for metrics)."""
    return torch.stack([out.loss_sum.detach().float(), out.correct.float(), out.tokens.float()])


def train_step(run: Run, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    """One optimizer update over `micro_batches` ((B, max_len+1) each).

    The loss is the mean over every scored token of the update (micro-batches weighted by their
    token counts, so padding does not skew it). Returns a (3,) tensor: loss sum, correct, tokens.
    """
    pairs = [split_batch(b) for b in micro_batches]
    tokens = torch.stack([(y != IGNORE_INDEX).sum() for _, y in pairs]).sum().float()
    # Over all processes (a replica's pipeline stages hold the same batch); DDP averages gradients over
    # the replicas, so replicas / global tokens gives sum / global tokens.
    denom = (all_reduce_sum(tokens) / run.stage_processes).clamp(min=1)
    scale = run.scaler.scale * run.replica.world_size / denom
    if run.pipeline is not None:
        with autocast(run.device, run.precision):
            totals = run.pipeline.step(torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs]), scale)
        params = run.pipeline.parameters()
    else:
        totals = torch.zeros(3, device=run.device)
        for i, (x, y) in enumerate(pairs):
            if run.watchdog is not None:
                run.watchdog.kick()
            # Gradients are all-reduced once per update, during the last micro-batch's backward.
            sync = i == len(pairs) - 1
            if run.fsdp:  # ZeRO-2/3: reduce-scatter once, in the last micro-batch's backward
                run.model.set_requires_gradient_sync(sync)
            with autocast(run.device, run.precision), \
                    (contextlib.nullcontext() if sync or run.ddp is None else run.ddp.no_sync()):
                out = run.forward(x, y)
                (out.loss_sum * scale).backward()
            totals += _totals(out)
        params = [p for p in run.model.parameters() if p.requires_grad]  # the device copies, even when offloaded
    all_reduce_sum(totals)  # the loss lives on the last stage: others add zeros
    finite = run.scaler.unscale_and_check(params)
    # The global gradient norm (before clipping): logged, and it says whether the update is finite.
    if run.pipeline is not None:
        norm = clip_grad_norm(params, run.pipeline.norm_parameters(), run.cfg.max_grad_norm,
                              1 if run.pipeline.fsdp else run.replica.world_size)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        total = (torch.nn.utils.clip_grad_norm_(params, run.cfg.max_grad_norm, foreach=True)
                 if run.cfg.max_grad_norm is not None else torch.nn.utils.get_total_norm(grads, foreach=True))
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # FSDP2: all shards
    run.grad_norm = norm
    if not run.scaler.enabled:  # fp32/bf16: a non-finite gradient skips the update too
        finite = math.isfinite(norm)
    elif run.pipeline is not None:
        finite = all_finite(finite, run.device)  # fp16: each stage unscaled its own gradients
    if finite:
        run.optimizer.step()
        run.nonfinite_in_a_row = 0
    else:
        _skip_update(run)
    run.scaler.update(finite)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return totals


def _skip_update(run: Run) -> None:
    """A non-finite gradient: no update, a notice, and the run stops after --max-nonfinite-updates in a row."""
    run.nonfinite_in_a_row += 1
    limit = run.cfg.max_nonfinite_updates
    update = run.scheduler.last_epoch
    log.notice(f"update {update}: non-finite gradients, update skipped ({run.nonfinite_in_a_row} in a row, "
               f"the run stops at {limit})")
    if run.nonfinite_in_a_row >= limit:
        raise RunError(f"{limit} updates in a row had non-finite gradients (the last was update {update}); the "
                       "run diverged: lower --learning-rate, clip with --max-grad-norm, or resume from an earlier "
                       "checkpoint")


@torch.no_grad()
def evaluate(run: Run, dataset: Dataset) -> tuple[float, float, int]:
    """Mean token loss, perplexity and token count over a dataset (dropout off), every replica
    scoring its share. Pipelined runs evaluate through the pipeline (forward only)."""
    # Sharded parameters are gathered in every forward: all ranks score the whole set in step.
    return _evaluate(run, dataset, DistEnv() if run.fsdp else run.replica)


def _evaluate(run: Run, dataset: Dataset, env: DistEnv) -> tuple[float, float, int]:
    run.model.eval()
    totals = torch.zeros(3, device=run.device)
    if isinstance(dataset, ShardedStream):  # a stream shards itself: by `env`, not by the process group
        dataset.shard(env.rank, env.world_size)
    elif env.enabled:  # each replica scores its share
        dataset = torch.utils.data.Subset(dataset, range(env.rank, len(dataset), env.world_size))
    pipe = run.pipeline
    rows = run.cfg.batch_size * (pipe.micro_batches if pipe is not None else 1)
    if pipe is not None:
        pipe.module.eval()
    for batch in DataLoader(dataset, batch_size=rows, collate_fn=collate):
        x, y = split_batch(batch.to(run.device))
        with autocast(run.device, run.precision):
            if pipe is not None:  # the schedule takes exactly its micro-batches: pad with unscored rows
                short = rows - x.shape[0]
                x = torch.cat([x, x.new_zeros(short, x.shape[1])])
                y = torch.cat([y, y.new_full((short, y.shape[1]), IGNORE_INDEX)])
                totals += pipe.evaluate(x, y)
            else:
                totals += _totals(run.model(x, y))  # eager: a compiled no-grad graph would cost a second compile
    run.model.train()
    if pipe is not None:
        pipe.module.train()
    if env.enabled or pipe is not None:  # replicas' shares; a pipeline's loss lives on its last stage
        all_reduce_sum(totals)
    loss = float(totals[0] / totals[2].clamp(min=1))
    return loss, math.exp(min(loss, 50.0)), int(totals[2])
