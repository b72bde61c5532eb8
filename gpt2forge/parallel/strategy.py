"""One interface between the training loop and the parallel layout: a `Strategy`.

The loop (gpt2forge.train.step, .state, .trainer) never asks which layout runs. It hands a
strategy one update's micro-batches with a loss scale, asks it for the global gradient norm, the
trainable parameters, an evaluation forward, the optimizer state in a layout-free form and the
whole model, and the strategy does what its layout needs (gradient all-reduce, reduce-scatter,
pipeline schedules, gathering shards or stages onto rank 0).

Implementations, one file each, picked from the layout by `select_strategy`:
- `data_parallel.DataParallelStrategy`: one process, or DDP replicas with ZeRO-0/1 (`--zero-stage 0|1`).
- `fsdp.ShardedStrategy`: FSDP2 replicas, ZeRO-2/3 (`--zero-stage 2|3`), also one process
  with `--offload full` (ZeRO-3 over a world of one, every state in host memory).
- `pipeline_strategy.PipelineStrategy`: pipeline stages in their own processes (`--layers-per-ipu` with stages x
  replicas processes), with ZeRO inside each stage across its replicas.

Adding a layout (tensor parallelism, say) is one new file plus its registration: write
`parallel/tensor_parallel.py` with a `Strategy` subclass whose `applies(request)` recognises the
layout (a `ParallelRequest` field such as a tensor-parallel degree) and whose constructor takes
`(model, request)`, then add its `"module:Class"` to `REGISTRY` ahead of the layouts it refines.
Nothing in the training loop changes.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from gpt2forge.core.errors import UsageError
from gpt2forge.model.gpt2 import GPT2LMHeadModel, LMLoss
from gpt2forge.parallel.distributed import DistEnv, all_reduce_sum
from gpt2forge.parallel.health import Watchdog
from gpt2forge.parallel.topology import Layout


@dataclasses.dataclass(frozen=True)
class ParallelRequest:
    """What the run asks of its layout; the registry picks the strategy from it."""

    device: torch.device
    """This process's device."""
    env: DistEnv = DistEnv()
    """This process in the whole job."""
    layout: Layout | None = None
    """Pipeline stages and replicas (None: the whole model in every process)."""
    zero: int = 0
    """Resolved ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    offload: bool = False
    """State in host memory (train.memory_features.offload_to_host): under FSDP2 its CPU offload policy
    (shards, gradients, update), otherwise the optimizer state and update (OffloadedOptimizer)."""
    param_dtype: torch.dtype | None = None
    """Autocast dtype of bf16/fp16 runs (FSDP2 gathers and computes in it), None for fp32."""
    compile_mode: str = "false"
    """--torch-compile: auto | true | false."""
    compile_cache: str | None = None
    """--executable-cache-dir (inductor's cache), or None."""
    schedule: str = "GPipe"
    """--pipeline-schedule (pipelined layouts)."""
    micro_batches: int = 1
    """Micro-batches per update in this process (the pipeline schedule's count)."""
    batch_size: int = 1
    """Rows per micro-batch (--batch-size)."""


@dataclasses.dataclass(frozen=True)
class OptimizerPlacement:
    """Where the optimizer goes: over which module's parameters, offloaded or ZeRO-1 sharded."""

    module: nn.Module
    """The module whose trainable parameters this process updates."""
    offload: bool = False
    """State and update in host memory (train.optim.OffloadedOptimizer)."""
    shard: bool = False
    """ZeRO-1: the state sharded across the replicas."""
    shard_group: dist.ProcessGroup | None = None
    """The replicas' process group for `shard` (None: all ranks)."""
    host_update: bool = False
    """The parameters this process updates live in host memory (FSDP2's CPU offload): the update runs
    there, with the host optimizer kernels (gpt2forge.ops.host_optim)."""


class MicroBatch(NamedTuple):
    """One micro-batch as the model takes it: a pair (inputs, labels) unpacks into one too."""

    inputs: torch.Tensor
    """(B, T) int64 token ids."""
    labels: torch.Tensor
    """(B, T) int64 next-token labels, IGNORE_INDEX where not scored."""
    position_ids: torch.Tensor | None = None
    """(B, T) positions restarting in each packed document (--reset-position-ids), or None: 0..T-1."""
    document_ids: torch.Tensor | None = None
    """(B, T) document index of each token (--reset-attention-mask), or None: one document per row."""

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments beyond (inputs, labels): the ids that are set."""
        return {name: t for name, t in (("position_ids", self.position_ids), ("document_ids", self.document_ids))
                if t is not None}


def as_micro_batch(batch: MicroBatch | tuple[torch.Tensor, ...]) -> MicroBatch:
    """A MicroBatch from a MicroBatch or a plain (inputs, labels[, position_ids, document_ids]) tuple."""
    return batch if isinstance(batch, MicroBatch) else MicroBatch(*batch)


def loss_totals(out: LMLoss) -> torch.Tensor:
    """(3,) fp32: loss sum, correct tokens, scored tokens (detached, for metrics)."""
    return torch.stack([out.loss_sum.detach().float(), out.correct.float(), out.tokens.float()])


class Strategy(abc.ABC):
    """How this process trains, evaluates and saves its part of the model under one layout."""

    model: GPT2LMHeadModel
    """The whole model this process built (its parameters may be sharded, or other stages' freed)."""
    env: DistEnv
    """This process in the whole job."""
    replica: DistEnv
    """This process's data-parallel replica among the replicas (data slicing)."""
    device: torch.device
    batch_size: int = 1
    """Rows per micro-batch."""
    watchdog: Watchdog | None = None
    """Kicked as forward passes progress (several processes), else None."""

    @classmethod
    @abc.abstractmethod
    def applies(cls, request: ParallelRequest) -> bool:
        """True when this strategy runs the layout `request` describes."""

    @property
    def processes_per_replica(self) -> int:
        """Processes that hold one replica's batches (pipeline stages); 1 otherwise."""
        return 1

    @property
    def whole_gradients(self) -> bool:
        """Every process holds the whole model's gradients, unsplit (what K-FAC's factors need): one
        process or DDP/ZeRO-1 replicas, not stages, tensor-parallel shards or FSDP2 shards."""
        return False

    @property
    def uniform_arguments(self) -> bool:
        """Whether every micro-batch of every update must carry the same model arguments (a pipeline
        schedule's stages do): then packed-document ids are passed even where no row needs them."""
        return False

    @property
    def process_name(self) -> str:
        """This process in words, for the hang watchdog's report."""
        return f"rank {self.env.rank}"

    def attach_watchdog(self, watchdog: Watchdog) -> None:
        """Kick `watchdog` as the forward passes progress inside an update."""
        self.watchdog = watchdog

    @abc.abstractmethod
    def optimizer_placement(self) -> OptimizerPlacement:
        """What the optimizer updates and how (built after the strategy, over its parameters)."""

    @abc.abstractmethod
    def forward_backward(self, micro_batches: list[MicroBatch], scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one update's micro-batches (MicroBatch, or (inputs, labels) pairs;
        (B, T) each), the summed loss multiplied by `scale` (loss scale x replicas / global scored
        tokens), gradients averaged over the replicas when it returns. Returns this process's (3,)
        totals: loss sum, correct, scored tokens (zeros where the process holds no loss, e.g. early
        pipeline stages)."""

    @abc.abstractmethod
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters this process computes gradients for (the device copies, even when the
        optimizer is offloaded): the loss scaler unscales and checks these."""

    @abc.abstractmethod
    def clip_grad_norm(self, max_norm: float | None) -> float:
        """The global gradient norm over the whole model (all shards, stages, counted once), before
        clipping; the gradients are clipped to `max_norm` unless it is None. A collective."""

    def all_finite(self, finite: bool) -> bool:
        """fp16: whether every process's gradients were finite (skip everywhere or nowhere); here
        every process unscaled the same gradients, so its own answer is everyone's."""
        return finite

    def evaluation_env(self) -> DistEnv:
        """Which share of an evaluation set this process scores (rank, world size of the shares)."""
        return self.replica

    @property
    def evaluation_rows(self) -> int:
        """Rows per evaluation forward (`evaluate_batch`'s batch)."""
        return self.batch_size

    @abc.abstractmethod
    def evaluate_batch(self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only (no grad, dropout off) of up to `evaluation_rows` rows (ids as in MicroBatch);
        (3,) totals."""

    def sum_evaluation(self, totals: torch.Tensor) -> torch.Tensor:
        """The job's evaluation totals from this process's (in place; a collective where the
        shares or the loss are split over processes)."""
        return all_reduce_sum(totals) if self.evaluation_env().enabled else totals

    def set_training(self, mode: bool) -> None:
        """Dropout on (`mode`) or off in every module this process runs."""
        self.model.train(mode)

    def report_peak_memory(self, peak_memory_gib: float) -> None:  # noqa: B027 (a hook, empty by default)
        """Print the first step's peak memory per process where it differs by process (a collective
        where it does); nothing otherwise."""

    @abc.abstractmethod
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The whole model's indexed optimizer state, as one process would hold it, on rank 0 (None
        or this rank's copy elsewhere); a collective where the state is sharded or staged."""

    @abc.abstractmethod
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, indexed: dict) -> None:
        """Load a whole-model indexed optimizer state (a checkpoint of any layout) on every rank."""

    @abc.abstractmethod
    def whole_model(self) -> GPT2LMHeadModel | None:
        """The current whole model on rank 0, on this process's device (None elsewhere), for
        evaluation and sampling; a collective where the model is sharded or staged."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> tuple[GPT2LMHeadModel | None, dict | None]:
        """(whole model, indexed optimizer state) to save, on rank 0; a collective of every rank."""
        return self.whole_model(), self.optimizer_state(optimizer)


REGISTRY: dict[str, str] = {
    "tensor_parallel": "gpt2forge.parallel.tensor_parallel:TensorParallelStrategy",
    "pipeline": "gpt2forge.parallel.pipeline_strategy:PipelineStrategy",
    "fsdp": "gpt2forge.parallel.fsdp:ShardedStrategy",
    "data_parallel": "gpt2forge.parallel.data_parallel:DataParallelStrategy",
}
"""Strategy name -> "module:Class", most specific first: the first that applies is taken."""


def strategy_class(name: str) -> type[Strategy]:
    """The registered class of `name` (imported on demand: the implementations import this module)."""
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def select_strategy(request: ParallelRequest) -> str:
    """The name of the registered strategy that runs `request`'s layout (the first that applies)."""
    for name in REGISTRY:
        if strategy_class(name).applies(request):
            return name
    raise ValueError(f"no parallel strategy runs this layout ({request}); registered: {', '.join(REGISTRY)}")


def build_strategy(model: GPT2LMHeadModel, request: ParallelRequest) -> Strategy:
    """The strategy for `request`'s layout, wrapped around `model` (which it shards, stages, wraps
    in DDP and compiles as the layout needs; memory features go on before).

    Raises UsageError for ZeRO-2/3 with fp16 (FSDP2 has no loss scaling here)."""
    if request.zero >= 2 and request.param_dtype == torch.float16:
        raise UsageError(f"--zero-stage {request.zero} with --precision fp16 is not supported; use bf16 or fp32")
    return strategy_class(select_strategy(request))(model, request)
