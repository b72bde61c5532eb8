"""Pipeline stages (`--layers-per-ipu`) in their own processes, on torch.distributed.pipelining.

Process grid: one device mesh ("dp", "pp", "tp") of replicas x stages x tensor-parallel ranks,
`tp` innermost: global rank = (replica * stages + stage) * tp + tp rank (without tensor
parallelism, replica * stages + stage), so a replica's stages are neighbouring ranks (groups of tp)
and each stage's replicas form a data-parallel group: after the schedule's backward their gradients
are averaged in one flat all-reduce per stage (DDP's reducer does not support GPipe's
all-forwards-then-all-backwards order under no_sync). A stage is the model with what it does not
own removed (`stage_model`), so it runs the model's own forward. Stage 0 holds the
embeddings and its blocks; the last stage holds `ln_f` and, as the LM head, a copy of the tied word
embedding. After each update's backward the two copies' gradients are summed between the first
and the last stage (Megatron's tied-embedding all-reduce), so both receive the same update and stay
equal. Gradients are exactly those of one process running the whole model.

Every rank builds the whole model (same seed, same weights) and keeps the blocks of its stage
(the others move to the meta device: no memory); rank 0 (stage 0 of replica 0) keeps a whole
model and gathers the other stages' weights into it before sampling, zero-shot evaluation or
saving, so those run unchanged on one whole model. Validation runs through the pipeline itself
(the schedule's forward-only pass).

Tensor parallelism inside the stages (`--tensor-model-parallel-size N`): each stage is split over
its N ranks (tensor_parallel.parallelize_stage; embedding and head copy by vocabulary rows), tp rank
t of stage s exchanges activations with tp rank t of stages s +- 1 (hidden states (B, T, C), or with
`--sequence-parallel` their sequence shard (B, T / N, C)), the tied sum pairs the same vocabulary
shards, and the whole-model views gather each stage's shards before sending them to rank 0.

ZeRO-2/3 inside the stages (`--zero-stage 2|3` with replicas): each stage is sharded with FSDP2
across its replicas (every block one unit, the stage the root), the schedule runs FSDP's
reduce-scatter once per update, and the tied-embedding sum and the gradient norm work on the local
shards (the first and last stage shard the embedding alike). Rank 0's stage is then a copy of its
part of the whole model, so the whole model stays plain for evaluation and saving.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from gpt2forge.core import log
from gpt2forge.model.gpt2 import GPT2LMHeadModel, head_loss
from gpt2forge.parallel.distributed import fsdp_options, full_tensor, local_tensor
from gpt2forge.parallel.optimizer_state import (
    load_named_state,
    merge_named,
    model_group_names,
    named_state,
    to_cpu,
    to_indexed,
    to_named,
)
from gpt2forge.parallel.tensor_parallel import (
    TensorParallelRNG,
    lay_out_gradients_as_parameters,
    loss_parallel,
    parallelize_stage,
    shard_like,
    whole_value,
)
from gpt2forge.parallel.topology import Layout

HEAD_COPY = "head.weight"
"""The last stage's copy of `transformer.wte.weight` (the tied LM head), named in the stage."""
WTE = "transformer.wte.weight"
WHOLE_HEAD = "lm_head.weight"
"""The whole model's LM head: its embedding (tied)."""


@dataclasses.dataclass(frozen=True)
class Grid:
    """This process's place in the (replicas x stages x tensor-parallel ranks) process grid."""

    stages: int
    replicas: int
    rank: int
    tensor_parallel: int = 1

    @property
    def stage(self) -> int:
        return self.rank // self.tensor_parallel % self.stages

    @property
    def replica(self) -> int:
        return self.rank // (self.tensor_parallel * self.stages)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel

    def rank_of(self, stage: int, replica: int = 0, tp_rank: int = 0) -> int:
        """The global rank of a place in the grid."""
        return (replica * self.stages + stage) * self.tensor_parallel + tp_rank

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def stage_model(model: GPT2LMHeadModel, blocks: list[int], first: bool, last: bool, copy: bool = False
                ) -> GPT2LMHeadModel:
    """The part of `model` one stage runs: the model itself with what the stage does not own removed
    (as torchtitan builds pipeline stages), so its forward is the model's forward. The first stage
    keeps the embeddings, every stage its `blocks` (keeping their indices and names:
    `transformer.h.5...`), the last stage `ln_f`; `lm_head` is None, so the forward returns hidden
    states. The last stage's LM head is the module `head` (a TiedHead, see StageLoss), whose weight is
    the first stage's embedding itself when one stage is both, else an equal copy.

    `copy`: the stage gets copies of the model's modules instead of sharing them.
    """
    take = copy_module.deepcopy if copy else (lambda m: m)
    t = model.transformer
    with torch.device("meta"):  # a shell: every part with weights is replaced or removed below
        stage = GPT2LMHeadModel(model.config)
    stage.fused_loss = model.fused_loss
    s = stage.transformer
    s.wte, s.wpe = (take(t.wte), take(t.wpe)) if first else (None, None)
    s.drop = t.drop
    s.h = nn.ModuleDict({str(i): take(t.h[str(i)]) for i in blocks})
    s.ln_f = take(t.ln_f) if last else None
    stage.lm_head = None
    if last:
        stage.head = TiedHead(s.wte.weight if first else nn.Parameter(t.wte.weight.detach().clone()))
    return stage


class TiedHead(nn.Module):
    """The last stage's LM head and loss (the model's `head_loss`), a module of its own so that FSDP2
    can gather its weight when the schedule's loss function calls it (outside the stage's forward)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, vocab: int, chunking) -> tuple[torch.Tensor, ...]:
        return head_loss(hidden, self.weight, labels, vocab, chunking)


class StageLoss:
    """The pipeline's loss_fn on the last stage: the model's LM loss with the head copy, scaled by
    `scale` (loss scale x replicas / global tokens); records (loss sum, correct, tokens) per call."""

    def __init__(self, module: GPT2LMHeadModel):
        self.module, self.vocab, self.chunking = module, module.config.vocab_size, module.fused_loss
        self.scale = 1.0
        self.records: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, correct, tokens = self.module.head(hidden, labels, self.vocab, self.chunking)
        self.records.append(torch.stack([loss_sum.detach().float(), correct.float(), tokens.float()]))
        return loss_sum * self.scale


class Pipeline:
    """One stage of the pipelined model with its schedule; built on every rank of the grid."""

    def __init__(self, model: GPT2LMHeadModel, layout: Layout, grid: Grid, device: torch.device, schedule: str,
                 micro_batches: int, compiled: bool = False, zero: int = 0, offload: bool = False,
                 param_dtype: torch.dtype | None = None):
        """zero 2|3: FSDP2 inside each stage across its replicas (`offload`, `param_dtype`: see
        distributed.fsdp_options)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.grid, self.layout, self.model = grid, layout, model
        S, R, T = grid.stages, grid.replicas, grid.tensor_parallel
        self.mesh = init_device_mesh(device.type, (R, S, T), mesh_dim_names=("dp", "pp", "tp"))
        # Every rank creates every group, in the same order (a torch.distributed rule).
        tie_groups = [dist.new_group([grid.rank_of(0, r, t), grid.rank_of(S - 1, r, t)]) for r in range(R)
                      for t in range(T)]
        self.tie_group = tie_groups[grid.replica * T + grid.tp_rank]
        self.pp_group = self.mesh.get_group("pp")  # this replica's stages at this tp rank
        self.dp_group = self.mesh.get_group("dp") if R > 1 else None  # this stage's replicas at this tp rank
        self.stage_of_layer = layout.stage_of_layer()
        blocks = [i for i, s in enumerate(self.stage_of_layer) if s == grid.stage]
        self.fsdp = zero >= 2 and R > 1
        # Rank 0's whole model stays plain (unsharded, eager) for evaluation and saving: its stage is
        # a copy when sharded or compiled, and gather_weights copies the stage's weights back.
        self.copied = grid.rank == 0 and (self.fsdp or compiled or T > 1)
        self.module = stage_model(model, blocks, grid.first, grid.last, copy=self.copied).to(device)
        self.aliases = {HEAD_COPY: WTE} if grid.last and not grid.first else {}
        self.orders: dict[str, torch.Tensor] = {}
        """Whole-model name -> the row order that undoes tensor parallelism's c_attn order."""
        if T > 1:
            unorder = parallelize_stage(self.module, self.mesh["tp"], layout.sequence_parallel)
            self.orders = {self.aliases.get(n, n): unorder[id(p)] for n, p in self.module.named_parameters()
                           if id(p) in unorder}
            self.rng = TensorParallelRNG(self.module, self.mesh["tp"], device, layout.sequence_parallel)
        if compiled:
            # torch.compile per block, as torchtitan does for pipeline stages: the blocks share one
            # graph, and compiling in place keeps the module tree (names, state dicts) untouched.
            for block in self.module.transformer.h.values():
                block.compile()
        if self.fsdp:
            self._shard(device, zero, offload, param_dtype)
        if grid.rank != 0:  # after sharding: the whole model's head re-ties to the sharded embedding
            self._release_other_stages(blocks)
        self.loss = StageLoss(self.module)
        stage = PipelineStage(self.module, grid.stage, S, device, group=self.pp_group)
        cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
        # scale_grads=False: the loss is already divided by the global token count.
        self.schedule = cls(stage, micro_batches, loss_fn=self.loss, scale_grads=False)
        self.micro_batches = micro_batches

    def _release_other_stages(self, blocks: list[int]) -> None:
        """Free the weights this rank never uses (shapes stay, for the optimizer state's names)."""
        t = self.model.transformer
        unused = [b for i, b in t.h.items() if int(i) not in blocks]
        if not self.grid.first:
            unused += [t.wte, t.wpe]
        if not self.grid.last:
            unused.append(t.ln_f)
        for module in unused:
            module.to("meta")
        self.model.lm_head.weight = t.wte.weight  # re-tie: moving made a new parameter

    def _shard(self, device: torch.device, zero: int, offload: bool, param_dtype: torch.dtype | None) -> None:
        from torch.distributed.fsdp import fully_shard

        options = fsdp_options(self.mesh["dp"], zero, offload, param_dtype)
        for block in self.module.transformer.h.values():
            fully_shard(block, **options)
        if self.grid.last:
            fully_shard(self.module.head, **options)
        fully_shard(self.module, **options)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def norm_parameters(self) -> list[nn.Parameter]:
        """This stage's parameters counted in the global gradient norm (the head copy is stage 0's
        embedding, counted there)."""
        return [p for n, p in self.module.named_parameters() if p.requires_grad and n not in self.aliases]

    def step(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | float, **ids: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one update's micro-batches (x, y: (micro-batches * B, T), split
        along dim 0). `ids` (position_ids, document_ids: (micro-batches * B, T), packed documents)
        go to every stage's forward, split alike. Returns (3,) loss sum, correct, tokens (non-zero on
        the last stage only)."""
        totals = self._run(self.schedule.step, x, y, scale, ids)
        if self.grid.tensor_parallel > 1:
            lay_out_gradients_as_parameters(self.parameters())
        self._average_replicas()
        self._sum_tied_gradients()
        return totals

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, **ids: torch.Tensor) -> torch.Tensor:
        """Forward only, through the pipeline, of micro-batches * B rows (`ids` as in `step`);
        returns (3,) loss sum, correct, tokens (non-zero on the last stage only)."""
        return self._run(self.schedule.eval, x, y, 1.0, ids)

    def _run(self, schedule_call, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | float,
             ids: dict[str, torch.Tensor]) -> torch.Tensor:
        """One pass of the schedule (`step` or `eval`): stage 0 feeds x, the last stage scores y,
        every stage takes `ids` as keyword arguments (every rank holds the replica's whole batch)."""
        self.loss.scale = scale
        self.loss.records = []
        # Tensor parallelism: the last stage's cross-entropy on vocabulary-sharded logits, both ways.
        with loss_parallel() if self.grid.tensor_parallel > 1 else contextlib.nullcontext():
            if self.grid.first:
                schedule_call(x, **ids)
            elif self.grid.last:
                schedule_call(target=y, **ids)
            else:
                schedule_call(**ids)
        # The first step's shape inference also calls the loss (on placeholder data): keep the real calls.
        real = self.loss.records[-self.micro_batches:]
        if not real or self.grid.tp_rank != 0:  # a last stage's tp ranks hold the same loss: one reports it
            return torch.zeros(3, device=x.device)
        return torch.stack(real).sum(0)

    def _average_replicas(self) -> None:
        if self.grid.replicas == 1 or self.fsdp:  # FSDP2's reduce-scatter averaged them
            return
        grads = [local_tensor(p.grad) for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all of them
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.grid.replicas
        for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(avg.view_as(g))

    def _sum_tied_gradients(self) -> None:
        if self.grid.stages == 1:
            return
        # Under FSDP2 both copies are sharded alike across the replicas: the local shards pair up.
        if self.grid.first:
            dist.all_reduce(local_tensor(self.module.transformer.wte.weight.grad), group=self.tie_group)
        elif self.grid.last:
            dist.all_reduce(local_tensor(self.module.head.weight.grad), group=self.tie_group)

    def report_peak_memory(self, peak_memory_gib: float) -> None:
        """Print every stage's measured peak memory (of a step) on rank 0; a collective of all ranks."""
        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_memory_gib)
        log.info("Stage peak memory: " + ", ".join(f"stage {s} {peaks[self.grid.rank_of(s)]:.2f} GiB"
                                                   for s in range(self.grid.stages)))

    # -- whole-model views on rank 0 ---------------------------------------------------------------
    def owner(self, name: str) -> int:
        """The stage holding the whole model's state entry `name`."""
        if name.startswith("transformer.h."):
            return self.stage_of_layer[int(name.split(".")[2])]
        if name.startswith("transformer.ln_f."):
            return self.grid.stages - 1
        return 0

    def gather_weights(self) -> None:
        """Copy every stage's current weights of replica 0 into rank 0's whole model (a collective of
        replica 0's stages, and of every replica when the stages are sharded; tensor-parallel shards
        are gathered in their stage, whose tp rank 0 sends)."""
        if self.grid.replica != 0 and not self.fsdp:
            return
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                if name == WHOLE_HEAD:
                    continue  # the whole model's head is its embedding
                src = self.owner(name)
                if self.grid.stage == src:  # the stage's names are the model's
                    full = whole_value(self.module.get_parameter(name), self.orders.get(name))
                    if self.grid.replica == 0 and self.grid.tp_rank == 0 and src != 0:
                        dist.send(full.contiguous(), dst=0)
                    elif self.copied:
                        tensor.copy_(full)
                elif self.grid.rank == 0:
                    buf = torch.empty_like(tensor)
                    dist.recv(buf, src=self.grid.rank_of(src))
                    tensor.copy_(buf)
            self._check_tied_copies()

    def _check_tied_copies(self) -> None:
        """The last stage's head copy must equal stage 0's embedding (same gradients, same updates);
        a difference is a bug, never silently saved."""
        if self.grid.stages == 1:
            return
        if self.grid.last:
            head = full_tensor(self.module.head.weight.detach())
            if self.grid.replica == 0 and self.grid.tp_rank == 0:
                dist.send(head.contiguous(), dst=0)
        elif self.grid.rank == 0:
            wte = self.model.transformer.wte.weight.detach()
            head = torch.empty_like(wte)
            dist.recv(head, src=self.grid.rank_of(self.grid.stages - 1))
            if not torch.equal(head, wte):
                raise RuntimeError(f"pipeline: the last stage's LM head differs from stage 0's embedding "
                                   f"(max |diff| {float((head - wte).abs().max()):.3g}); the tied copies diverged")

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The whole model's indexed optimizer state on rank 0 (None elsewhere); a collective."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):  # each stage's shards to its replica 0
            optimizer.consolidate_state_dict(to=0)
        if self.fsdp:  # every replica joins the gathering of its stage's shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            named = get_optimizer_state_dict(self.module, optimizer, options=StateDictOptions(full_state_dict=True))
            part = to_cpu(_renamed(named, self.aliases))
        if self.grid.replica != 0:
            return None
        if not self.fsdp:  # tensor-parallel shards gathered whole in their stage (a collective of its tp ranks)
            named = named_state(optimizer, self.module, self.aliases)
            part = to_cpu({**named, "state": {n: {k: whole_value(v, self.orders.get(n)) for k, v in s.items()}
                                              for n, s in named["state"].items()}})
        if self.grid.tp_rank != 0:
            return None
        parts = [None] * self.grid.stages if self.grid.first else None
        dist.gather_object(part, parts, dst=0, group=self.pp_group)
        if not self.grid.first:
            return None
        return to_indexed(merge_named(parts), model_group_names(self.model))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, indexed: dict) -> None:
        """Load a whole-model indexed optimizer state (any layout's checkpoint) into this stage's optimizer."""
        named = to_named(indexed, model_group_names(self.model))
        if self.fsdp or self.grid.tensor_parallel > 1:  # every rank holds the whole state: it keeps its shards
            params = {self.aliases.get(n, n): p for n, p in self.module.named_parameters()}
            named = {**named, "state": {m: {k: shard_like(params[m], v, self.orders.get(m)) for k, v in entry.items()}
                                        if m in params else entry for m, entry in named["state"].items()}}
        load_named_state(optimizer, self.module, named, self.aliases)


def _renamed(named: dict, aliases: dict[str, str]) -> dict:
    """A named optimizer state with stage names replaced by the whole model's."""
    return {"state": {aliases.get(n, n): v for n, v in named["state"].items()},
            "param_groups": [{**g, "params": [aliases.get(n, n) for n in g["params"]]} for g in named["param_groups"]]}
