"""One optimizer update (`train_step`) and one evaluation pass (`evaluate`) over a built `Run`.

The loss of an update is the mean over every scored token of the global batch; gradients are
averaged across replicas (DDP, ZeRO, FSDP2 or the pipeline's own reduction), their global norm is
logged and clipped, and an update whose gradients are not finite is skipped (in every precision).
What a failure's line says of a run (`failures_named`: a GPU out of memory or gone, a lost node) is
composed here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from gpt2forge.core import log
from gpt2forge.core.errors import RunError, UsageError, naming_gpu_failures
from gpt2forge.core.loss_scaler import LossScaler
from gpt2forge.core.precision import autocast
from gpt2forge.data import IGNORE_INDEX, ShardedStream, collate, split_batch
from gpt2forge.evaluation.quick import QuickEval
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.documents import document_inputs
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.distributed import TIMEOUT, DistEnv, all_reduce_sum
from gpt2forge.parallel.health import Watchdog, collective_failure
from gpt2forge.parallel.memory_plan import resolved_lm_loss
from gpt2forge.parallel.strategy import MicroBatch, Strategy
from gpt2forge.text.tokenizer import load_tokenizer
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.kfac import KfacPreconditioner


@dataclasses.dataclass
class Run:
    """Everything a step needs, built once."""

    cfg: TrainConfig
    strategy: Strategy  # the parallel layout: forward/backward, clipping, state dicts, the whole model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    device: torch.device
    precision: str
    accumulation: int  # micro-batches per update in this process
    quick_eval: QuickEval | None = None  # --eval-wikitext/--eval-lambada, or None
    watchdog: Watchdog | None = None  # several processes: exits with a stack dump when training stalls
    nonfinite_in_a_row: int = 0  # updates skipped for non-finite gradients since the last good one
    skipped_updates: int = 0  # updates skipped for non-finite gradients in this process's run
    grad_norm: float = 0.0  # the last update's global gradient norm (before clipping)
    kfac: KfacPreconditioner | None = None  # --kfac: preconditions the gradients before clipping
    eod: int | None = dataclasses.field(default=None, init=False)
    """The end-of-document id when a packed-document flag is on (--reset-position-ids,
    --reset-attention-mask, --eod-mask-loss), else None."""

    def __post_init__(self) -> None:
        self.eod = document_eod(self.cfg, self.strategy.model.config)

    @property
    def model(self) -> GPT2LMHeadModel:
        """The whole model this process built (the module owning the parameters)."""
        return self.strategy.model

    @property
    def dist_env(self) -> DistEnv:
        """This process in the whole job."""
        return self.strategy.env

    @property
    def replica(self) -> DistEnv:
        """This process's data-parallel replica among the replicas (data slicing)."""
        return self.strategy.replica


def document_eod(cfg: TrainConfig, model_config: ModelConfig) -> int | None:
    """The end-of-document id the packed-document flags split on: the --tokenizer-name-or-path
    tokenizer's, else the model's `eos_token_id` (GPT-2: 50256); None when no such flag is on.

    Raises UsageError when the tokenizer has no end-of-document token."""
    if not cfg.documents.enabled:
        return None
    data = cfg.data
    flags = "--reset-position-ids/--reset-attention-mask/--eod-mask-loss"
    eod = model_config.eos_token_id
    if data.tokenizer_name_or_path:
        eod = load_tokenizer(data.tokenizer_name_or_path).eot_id
        if eod is None:
            raise UsageError(f"{flags}: the tokenizer at {data.tokenizer_name_or_path} has no end-of-document token "
                             "(<|endoftext|>, </s>, <eos>); use a tokenizer with one, or drop these flags")
    if not 0 <= eod < model_config.vocab_size:
        log.notice(f"{flags}: the end-of-document id {eod} is outside the vocabulary "
                   f"(0..{model_config.vocab_size - 1}): no sample will be split into documents (set eos_token_id "
                   "in the model config, or --tokenizer-name-or-path)")
    return eod


def micro_batch(run: Run, batch: torch.Tensor) -> MicroBatch:
    """A batch of items ((B, max_len+1), or (B, 2, max_len+1) with a loss mask) as the model takes it:
    inputs and labels, with the packed-document flags applied (positions and document ids from the
    EOD tokens, EOD inputs unscored)."""
    x, y = split_batch(batch)
    if run.eod is None:
        return MicroBatch(x, y)
    y, layout = document_inputs(run.cfg.documents, x, y, run.eod, always=run.strategy.uniform_arguments)
    return MicroBatch(x, y, *layout)


def train_step(run: Run, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    """One optimizer update over `micro_batches` ((B, max_len+1) each).

    The loss is the mean over every scored token of the update (micro-batches weighted by their
    token counts, so padding does not skew it). Returns a (3,) tensor: loss sum, correct, tokens.
    """
    pairs = [micro_batch(run, b) for b in micro_batches]
    tokens = torch.stack([(b.labels != IGNORE_INDEX).sum() for b in pairs]).sum().float()
    # Over all processes (a replica's pipeline stages hold the same batch); DDP averages gradients over
    # the replicas, so replicas / global tokens gives sum / global tokens.
    denom = (all_reduce_sum(tokens) / run.strategy.processes_per_replica).clamp(min=1)
    scale = run.scaler.scale * run.replica.world_size / denom
    capture = run.kfac.capturing(scale) if run.kfac is not None else contextlib.nullcontext()
    with autocast(run.device, run.precision), capture:
        totals = run.strategy.forward_backward(pairs, scale)
    all_reduce_sum(totals)  # the loss lives on the last stage: others add zeros
    finite = run.scaler.unscale_and_check(run.strategy.trainable_parameters())
    if run.kfac is not None:  # before clipping: --max-grad-norm bounds the preconditioned update
        run.kfac.step(run.optimizer.param_groups[0]["lr"])
    # The global gradient norm (before clipping): logged, and it says whether the update is finite.
    norm = run.strategy.clip_grad_norm(run.cfg.optim.max_grad_norm)
    run.grad_norm = norm
    if not run.scaler.enabled:  # fp32/bf16: a non-finite gradient skips the update too
        finite = math.isfinite(norm)
    else:
        finite = run.strategy.all_finite(finite)  # fp16: every process skips, or none
    if finite:
        run.optimizer.step()
        run.nonfinite_in_a_row = 0
        # Only an applied update advances the schedule: a skipped one holds the learning rate, as
        # Megatron-LM (`if update_successful: opt_param_scheduler.step(...)`) and accelerate do.
        run.scheduler.step()
    else:
        _skip_update(run)  # before the scaler's update: it judges the scale this update ran at
    run.scaler.update(finite)
    run.optimizer.zero_grad(set_to_none=True)
    return totals


def _skip_update(run: Run) -> None:
    """A non-finite gradient: no update and a notice. An fp16 overflow that dynamic loss scaling can
    still answer with a lower scale is the scaler's signal, not divergence (Megatron's initial scale
    2^32 overflows for the first ~20 updates): it is not counted. Every other one is, and the run
    stops after --max-nonfinite-updates of them in a row."""
    run.skipped_updates += 1
    if run.scaler.can_lower:
        log.notice("fp16: gradients overflowed at this loss scale; such updates are skipped (the learning rate "
                   "holds) while the dynamic scale comes down, as in Megatron-LM; they count toward "
                   "--max-nonfinite-updates only at --min-loss-scale")
        return
    run.nonfinite_in_a_row += 1
    limit = run.cfg.optim.max_nonfinite_updates
    applied = run.scheduler.last_epoch
    log.notice(f"after {applied} applied updates: non-finite gradients, update skipped ({run.nonfinite_in_a_row} "
               f"in a row, the run stops at {limit})")
    if run.nonfinite_in_a_row >= limit:
        raise RunError(f"{limit} updates in a row had non-finite gradients (after {applied} applied updates); the "
                       "run diverged: lower --learning-rate, clip with --max-grad-norm, or resume from an earlier "
                       "checkpoint")


def validation_subset(dataset: Dataset, cfg: TrainConfig) -> Dataset:
    """The first --eval-iters batches of one update's samples of `dataset` (all of it without the
    flag). The same windows every time, so evaluations compare across steps (Megatron draws the
    next batches of its validation stream instead)."""
    if cfg.eval.eval_iters is None or isinstance(dataset, ShardedStream):
        return dataset
    n = cfg.eval.eval_iters * cfg.samples_per_update
    return dataset if n >= len(dataset) else torch.utils.data.Subset(dataset, range(n))


@torch.no_grad()
def evaluate(run: Run, dataset: Dataset) -> tuple[float, float, int]:
    """Mean token loss, perplexity and token count over a dataset (dropout off), each process
    scoring the share its strategy gives it (forward only, through the strategy)."""
    env = run.strategy.evaluation_env()
    run.strategy.set_training(False)
    totals = torch.zeros(3, device=run.device)
    if isinstance(dataset, ShardedStream):  # a stream shards itself: by `env`, not by the process group
        dataset.shard(env.rank, env.world_size)
    elif env.enabled:  # each replica scores its share
        dataset = torch.utils.data.Subset(dataset, range(env.rank, len(dataset), env.world_size))
    for batch in DataLoader(dataset, batch_size=run.strategy.evaluation_rows, collate_fn=collate):
        x, y, position_ids, document_ids = micro_batch(run, batch.to(run.device))
        with autocast(run.device, run.precision):
            totals += run.strategy.evaluate_batch(x, y, position_ids, document_ids)
    run.strategy.set_training(True)
    run.strategy.sum_evaluation(totals)
    loss = float(totals[0] / totals[2].clamp(min=1))
    return loss, math.exp(min(loss, 50.0)), int(totals[2])


@contextlib.contextmanager
def failures_named(run: Run, step: Callable[[], int]) -> Iterator[None]:
    """Inside the block, a collective that fails (a node, its processes or its link lost) ends the run
    with one line naming the node(s) and the timeout (health.collective_failure), not gloo's traceback;
    so does a GPU out of memory or gone (errors.naming_gpu_failures: the step, the memory, the flags
    that help). `step()`: the host step under way, counted from 1."""
    try:
        with naming_gpu_failures(run.device, lambda: failure_context(run, step()), memory_fixes(run),
                                 what_is_kept(run.cfg)):
            yield
    except RuntimeError as exc:
        watchdog = run.watchdog
        line = collective_failure(exc, TIMEOUT, watchdog.what if watchdog is not None else "")
        if line is None:
            raise
        raise RunError(line) from None


def failure_context(run: Run, step: int) -> str:
    """What the run was doing, for a GPU failure's line: `host step 12 of gpt2-medium (354.8M parameters,
    bf16), micro-batches of 16 x 1,024 tokens` (`step` counted from 1; its validation or checkpoint included)."""
    cfg = run.cfg
    name = Path(cfg.arch.model_config).stem if cfg.arch.model_config else cfg.arch.model
    return (f"host step {step} of {name} ({run.model.config.num_params() / 1e6:.1f}M parameters, {run.precision}), "
            f"micro-batches of {cfg.parallel.batch_size} x {cfg.arch.max_len:,} tokens")


def memory_fixes(run: Run) -> str:
    """The flags that make this run need less device memory, those it does not use already."""
    cfg, mem = run.cfg, run.cfg.memory
    fixes = ["--plan (what each process needs, and whether it fits)"]
    if (b := cfg.parallel.batch_size) > 1:
        fixes.append(f"--batch-size {b // 2} with --gradient-accumulation {2 * cfg.parallel.gradient_accumulation} "
                     "(the same global batch)")
    if resolved_lm_loss(mem, run.device.type) == "plain":
        fixes.append("--lm-loss fused (never holds the whole logits)")
    if not mem.recompute:
        fixes.append("--recompute-checkpoint-every-layer (activations recomputed in backward)")
    if mem.offload_mode == "none":
        fixes.append("--offload optimizer or full (optimizer state in host memory)")
    elif mem.offload_mode == "optimizer":
        fixes.append("--offload full (parameters and gradients in host memory too)")
    return "try " + ", ".join(fixes)


def what_is_kept(cfg: TrainConfig) -> str:
    """What a run that stopped still has, and how to go on from it."""
    out = cfg.checkpoint.checkpoint_output_dir
    if not out:
        return "no checkpoint was being written (--checkpoint-output-dir keeps them)"
    return (f"the checkpoints already in {out} are complete (each is published whole); --auto-resume continues "
            "from the latest")
