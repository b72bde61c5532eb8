"""Tensor parallelism (Megatron's layout) on torch.distributed.tensor: `--tensor-model-parallel-size N`.

The N processes of a replica split each block as Megatron-LM does, with torch's parallel styles
(`parallelize_module`): `attn.c_attn` and `mlp.c_fc` column-parallel (each rank its heads and its
quarter of the MLP), `attn.c_proj` and `mlp.c_proj` row-parallel (one all-reduce after each). The
embedding and the tied LM head are split along the padded vocabulary: the embedding row-parallel
(ids outside a rank's rows give zeros, one all-reduce), the loss computed on vocabulary-sharded
logits by `loss_parallel` (no rank ever holds the full (B*T, V) logits). LayerNorms and the
position embedding are replicated DTensors. With `--sequence-parallel` the LayerNorm, dropout and
residual regions hold 1/N of the sequence (all-gather before each column-parallel matmul,
reduce-scatter after each row-parallel one), as torchtitan arranges it.

`c_attn` holds [q; k; v] (3C, C): its rows are reordered once, before sharding, so that rank r's
contiguous shard is [q, k, v of its heads] (`head_order`); every whole-model view (checkpoint,
optimizer state, sampling) undoes the order, so checkpoints do not depend on the layout. Each
attention then runs n_head / N heads.

Data parallelism: replicas x N processes on one 2-D mesh ("dp", "tp"), `tp` innermost (rank =
replica x N + tp rank); the replicas average their gradients with one flat all-reduce per update.
Dropout follows Megatron's model-parallel random-number tracker: see `TensorParallelRNG`.

Pipeline stages in their own processes compose with it (`--layers-per-ipu` with stages x N x
replicas processes): gpt2forge.parallel.pipeline_stages shards each stage over its tensor-parallel group
with `parallelize_stage` (the same plan, on the parts the stage holds; the last stage's LM-head
copy split by vocabulary rows and scored by `VocabParallelHead`); `TensorParallelStrategy`
here runs the layouts whose stages are co-located.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from gpt2forge.core import log
from gpt2forge.core.compilation import compile_enabled
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model.gpt2 import GPT2LMHeadModel, LMLoss
from gpt2forge.parallel.distributed import DistEnv, full_tensor
from gpt2forge.parallel.fsdp import whole_model_from
from gpt2forge.parallel.strategy import (
    MicroBatch,
    OptimizerPlacement,
    ParallelRequest,
    Strategy,
    as_micro_batch,
    loss_totals,
)
from gpt2forge.parallel.topology import check_tensor_parallel


class TensorParallelStrategy(Strategy):
    """This process's tensor-parallel share of one replica (`--tensor-model-parallel-size N > 1`)."""

    @classmethod
    def applies(cls, request: ParallelRequest) -> bool:
        return request.layout is not None and request.layout.tensor_parallel > 1 and not request.layout.pipelined

    def __init__(self, model: GPT2LMHeadModel, request: ParallelRequest):
        layout, env = request.layout, request.env
        tp, dp = layout.tensor_parallel, layout.data_parallel
        check_request(model, request)
        self.model, self.env, self.device, self.batch_size = model, env, request.device, request.batch_size
        mesh = init_device_mesh(request.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        self.tp_mesh = mesh["tp"]
        self.tp_rank = self.tp_mesh.get_local_rank()
        self.replica = DistEnv(mesh.get_local_rank("dp"), env.local_rank, dp)
        self.dp_group = mesh.get_group("dp") if dp > 1 else None
        self.rng = TensorParallelRNG(model, self.tp_mesh, request.device, layout.sequence_parallel)
        self.unorder = parallelize(model, self.tp_mesh, layout.sequence_parallel)

    @property
    def processes_per_replica(self) -> int:
        return self.tp_mesh.size()  # they hold the same batches

    @property
    def process_name(self) -> str:
        return f"rank {self.env.rank} (tensor-parallel rank {self.tp_rank})"

    def optimizer_placement(self) -> OptimizerPlacement:
        return OptimizerPlacement(self.model)  # every parameter a DTensor: the update runs on the local shards

    def _loss(self, batch: MicroBatch) -> tuple[DTensor, LMLoss]:
        """The model's own blocks, then the vocabulary-parallel head and loss (call under loss_parallel)."""
        hidden = self.model.transformer(batch.inputs, batch.position_ids, document_ids=batch.document_ids)
        return vocab_parallel_loss(hidden, self.model.lm_head.weight, batch.labels, self.model.config.vocab_size,
                                   self.tp_mesh)

    def forward_backward(self, micro_batches: list[MicroBatch], scale: torch.Tensor) -> torch.Tensor:
        totals = torch.zeros(3, device=self.device)
        for batch in map(as_micro_batch, micro_batches):
            if self.watchdog is not None:
                self.watchdog.kick()
            with loss_parallel():
                loss, out = self._loss(batch)
                (loss.to_local() * scale).backward()
            totals += loss_totals(out)
        self._average_over_replicas()
        # The tensor-parallel ranks of a replica hold the same loss: one of them reports it.
        return totals if self.tp_rank == 0 else torch.zeros_like(totals)

    def _average_over_replicas(self) -> None:
        """Mean of the local gradient shards over the data-parallel replicas, one flat all-reduce."""
        if self.dp_group is None:
            return
        grads = [p.grad.to_local() for p in self.trainable_parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.replica.world_size
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_grad_norm(self, max_norm: float | None) -> float:
        params = self.trainable_parameters()
        # DTensor norms: sharded gradients' squares summed over the tensor-parallel ranks, replicated once.
        total = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                                          foreach=True))
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return float(total)

    def evaluation_env(self) -> DistEnv:
        return self.replica  # a replica's tensor-parallel ranks score the same rows together

    def evaluate_batch(self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad(), loss_parallel():
            return loss_totals(self._loss(MicroBatch(x, y, position_ids, document_ids))[1])

    def sum_evaluation(self, totals: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:  # over the replicas only: a replica's ranks hold the same totals
            dist.all_reduce(totals, group=self.dp_group)
        return totals

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        if self.replica.rank != 0:  # replica 0's tensor-parallel group gathers (a collective of it only)
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        indexed = optimizer.state_dict()
        state = {i: {k: self._whole(params[i], v) for k, v in s.items()} for i, s in indexed["state"].items()}
        return {**indexed, "state": state} if self.env.is_main else None

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, indexed: dict) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {int(i): {k: self._shard(params[int(i)], v) for k, v in s.items()}
                 for i, s in indexed["state"].items()}
        optimizer.load_state_dict({**indexed, "state": state})

    def whole_model(self) -> GPT2LMHeadModel | None:
        if self.replica.rank != 0:
            return None
        params = dict(self.model.named_parameters())
        state = {name: self._whole(params.get(name), t) for name, t in self.model.state_dict().items()}
        return whole_model_from(state, self.model.config).to(self.device) if self.env.is_main else None

    def _whole(self, param: torch.Tensor | None, value):
        return whole_value(value, self.unorder.get(id(param)))

    def _shard(self, param: nn.Parameter, value):
        return shard_like(param, value, self.unorder.get(id(param)))


def check_request(model: GPT2LMHeadModel, request: ParallelRequest) -> None:
    """UsageError (one line) for a tensor-parallel layout this code does not run; notices for the
    features it replaces (compilation, the fused loss). Shared by co-located and pipelined stages."""
    tp = request.layout.tensor_parallel
    check_tensor_parallel(tp, model.config.n_head, model.config.padded_vocab_size, request.env.world_size)
    if request.zero or request.offload:
        raise UsageError(f"--tensor-model-parallel-size {tp} runs without ZeRO and offload for now; drop "
                         "--zero-stage / --replicated-tensor-sharding / --offload")
    if compile_enabled(request.compile_mode, request.device, request.compile_cache):
        log.notice("--torch-compile: tensor-parallel blocks run eager (not compiled yet)")
    if model.fused_loss is not None:
        log.notice("tensor parallelism: the vocabulary-parallel loss replaces the fused LM-head loss")


def whole_value(value, order: torch.Tensor | None = None):
    """`value` (a parameter or its optimizer state) gathered whole when it is a DTensor (a collective
    of its mesh), its rows put back in the model's own order by `order` (see `head_order`)."""
    if not isinstance(value, DTensor):
        return value
    whole = value.full_tensor()
    return whole if order is None else whole[order]


def shard_like(param: torch.Tensor, value, order: torch.Tensor | None = None):
    """A whole-model tensor shaped like `param` (its optimizer state) as this rank's shard of it,
    laid out as the DTensor `param` is (tensor-parallel or FSDP2), rows in rank order (`order` as in
    `whole_value`); anything else (a plain parameter's state, a step count) as it is."""
    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape):
        return value
    value = value if order is None else value[torch.argsort(order)]
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def lay_out_gradients_as_parameters(params: list[nn.Parameter]) -> None:
    """A DTensor gradient may leave backward laid out unlike its parameter (a pipeline stage's
    sharded embedding's comes out replicated): this rank's shard of it (a local slice), so that
    averages, the tied-embedding sum and the update pair the same shards."""
    for p in params:
        if p.grad is not None and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def vocab_parallel_loss(hidden: torch.Tensor, weight: DTensor, labels: torch.Tensor, vocab_size: int,
                        mesh: DeviceMesh) -> tuple[DTensor, LMLoss]:
    """The tied LM head and cross-entropy on vocabulary-sharded logits (call under loss_parallel).

    hidden (B, T, C): plain and replicated, or a DTensor (sequence parallel: gathered here);
    weight (V_pad, C) sharded by rows. Each rank computes its (B*T, V_pad / N) slice of the logits,
    padded columns at -inf. Returns (the loss sum as a replicated DTensor, for backward; the
    LMLoss of plain sums, the correct count from the ranks' local maxima)."""
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(mesh, [Replicate()])
    else:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Megatron's f: identity forward, the ranks' partial input gradients summed in backward.
    h = hidden.to_local(grad_placements=[Partial()]).flatten(0, 1)  # (B, T, C) -> (N, C)
    local = F.linear(h, weight.to_local())  # (N, V_pad / tp): this rank's vocabulary slice
    start = mesh.get_local_rank() * local.shape[1]
    if start + local.shape[1] > vocab_size:  # padded ids are never predicted
        local[:, max(vocab_size - start, 0):] = float("-inf")
    logits = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    labels = labels.flatten()
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    with torch.no_grad():
        mask = labels != IGNORE_INDEX
        correct = ((global_argmax(local, start, mesh) == labels) & mask).sum()
    return loss, LMLoss(loss.to_local().detach(), correct, mask.sum())


def global_argmax(local: torch.Tensor, start: int, mesh: DeviceMesh) -> torch.Tensor:
    """argmax over the whole vocabulary of row-sharded logits (N, V / tp) -> (N,), the first maximum
    on ties as torch.argmax gives it, from each rank's local maximum (never the full logits)."""
    index = local.argmax(-1)
    best = torch.stack([local.gather(1, index[:, None])[:, 0].double(), (index + start).double()])  # (2, N)
    ranks = DTensor.from_local(best[None], mesh, [Shard(0)], run_check=False).full_tensor()  # (tp, 2, N)
    first = (ranks[:, 0] == ranks[:, 0].max(0).values).int().argmax(0)  # the first rank holding the maximum
    return ranks[:, 1].gather(0, first[None])[0].long()


def head_order(n_embd: int, tp: int) -> torch.Tensor:
    """c_attn's rows (3C) in rank order: rank 0's q, k, v heads, then rank 1's, ... (3C,) indices."""
    width = n_embd // tp
    return torch.cat([torch.arange(width) + part * n_embd + rank * width for rank in range(tp) for part in range(3)])


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the mesh (LayerNorms, the position embedding): plain inputs are
    taken as replicated, the output is returned local: with `sequence_sharded`, this rank's part of
    the sequence (the second-to-last dimension: (T, C) or (B, T, C))."""

    def __init__(self, sequence_sharded: bool = False):
        super().__init__()
        self.sequence_sharded = sequence_sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._replicated_inputs, output_fn=self._local_output)

    @staticmethod
    def _replicated_inputs(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

    def _local_output(self, module, output, mesh):
        if self.sequence_sharded:
            output = output.redistribute(mesh, [Shard(output.ndim - 2)])
        return output.to_local()


def parallelize(model: GPT2LMHeadModel, mesh: DeviceMesh, sequence_parallel: bool) -> dict[int, torch.Tensor]:
    """Shard `model` in place over the tensor-parallel `mesh` (see the module docstring); every
    parameter becomes a DTensor. Parts the model lacks (a pipeline stage's) are skipped. Returns
    {id(parameter): the row order that undoes `head_order`} for the reordered c_attn weights and
    biases."""
    tp, cfg, t = mesh.size(), model.config, model.transformer
    order = head_order(cfg.n_embd, tp)
    unorder = {}
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else ReplicateParallel()
    outer = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
             "wpe": ReplicateParallel(sequence_sharded=sequence_parallel), "ln_f": norm}
    parallelize_module(t, mesh, {name: style for name, style in outer.items() if getattr(t, name) is not None})
    for block in model.transformer.h.values():
        with torch.no_grad():
            for p in block.attn.c_attn.parameters():
                p.copy_(p[order])
        block.attn.n_head //= tp
        plan = {"ln_1": norm, "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=seq),
                "ln_2": norm, "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:  # gather the sequence before the column-parallel matmuls
            # Attention.forward's inputs: x, kv, last, documents, local_block (only x is a tensor to gather)
            plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                              desired_input_layouts=(Replicate(), None, None, None, None))
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, plan)
        unorder.update({id(p): torch.argsort(order) for p in block.attn.c_attn.parameters()})
    if model.lm_head is not None:
        model.lm_head.weight = model.transformer.wte.weight  # re-tied: the head is the embedding's shard
    return unorder


def parallelize_stage(stage: GPT2LMHeadModel, mesh: DeviceMesh, sequence_parallel: bool) -> dict[int, torch.Tensor]:
    """`parallelize` for a pipeline stage (gpt2forge.parallel.pipeline_stages.stage_model): its parts
    sharded as in the whole model; the last stage's LM head (`stage.head`) split by vocabulary rows
    like the embedding (its copy of it, or the embedding itself when the stage holds both) and
    scored by `VocabParallelHead`. Returns what `parallelize` returns."""
    unorder = parallelize(stage, mesh, sequence_parallel)
    if getattr(stage, "head", None) is not None:
        wte = stage.transformer.wte
        weight = wte.weight if wte is not None else \
            nn.Parameter(distribute_tensor(stage.head.weight.detach(), mesh, [Shard(0)]))
        stage.head = VocabParallelHead(weight, mesh)
    return unorder


class VocabParallelHead(nn.Module):
    """A pipeline's last-stage LM head and loss on vocabulary-sharded logits (the interface of
    pipeline.TiedHead; call under loss_parallel)."""

    def __init__(self, weight: nn.Parameter, mesh: DeviceMesh):
        super().__init__()
        self.weight, self.mesh = weight, mesh

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, vocab: int, chunking=None
                ) -> tuple[torch.Tensor, ...]:
        """hidden (B, T, C) (plain, or this rank's sequence shard as a DTensor), labels (B, T) ->
        (loss sum, for backward; correct; scored tokens); `chunking` is unused (no fused loss)."""
        loss, out = vocab_parallel_loss(hidden, self.weight, labels, vocab, self.mesh)
        return loss.to_local(), out.correct, out.tokens


class TensorParallelRNG:
    """Dropout masks as Megatron's model-parallel RNG tracker makes them: the ranks of a
    tensor-parallel group share one default random stream (the group's first rank's), so the
    replicated regions (embedding and residual dropouts) draw the same masks on every rank, while
    the sharded regions (attention dropout over a rank's heads; with sequence parallelism every
    dropout, each rank holding its part of the sequence) draw from a stream of their own.

    Unlike Megatron's tracker this stream keeps no state: on entering a sharded region one number
    is drawn from the shared default stream and the region's generator is seeded with it plus
    2718 + the tensor-parallel rank (Megatron's offset); on leaving, the default stream continues
    where it was. So activation recomputation (which replays the default stream) and resuming
    (which restores each rank's default stream) reproduce the same masks with nothing else saved.
    """

    def __init__(self, model: GPT2LMHeadModel, mesh: DeviceMesh, device: torch.device, sequence_parallel: bool):
        self.device, self.rank = device, mesh.get_local_rank()
        # The group's first rank's seed for everyone: the same default stream in every rank of the group.
        seed = torch.tensor([torch.initial_seed()], device=device)
        dist.broadcast(seed, group=mesh.get_group(), group_src=0)
        torch.manual_seed(int(seed))
        self.saved: list[torch.Tensor] = []
        if sequence_parallel:  # every dropout of the transformer is in a sharded region
            model.transformer.register_forward_pre_hook(self._enter)
            model.transformer.register_forward_hook(self._leave)
        else:  # between c_attn's output and c_proj's input: the attention dropout over this rank's heads
            for block in model.transformer.h.values():
                block.attn.c_attn.register_forward_hook(self._enter)
                block.attn.c_proj.register_forward_pre_hook(self._leave)

    def _state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _enter(self, *_) -> None:
        seed = int(torch.randint(1 << 62, (1,)))  # from the shared CPU stream: the same on every rank
        self.saved.append(self._state())
        generator = torch.cuda.default_generators[self.device.index or 0] if self.device.type == "cuda" \
            else torch.default_generator
        generator.manual_seed(seed + 2718 + self.rank)

    def _leave(self, *_) -> None:
        self._set_state(self.saved.pop())
