"""Memory plan: what each process of a layout holds, per pipeline stage, before anything is trained.

`train_gpt2.py ... --plan` prints it for the layout the flags describe at full size (stages x
`--replication-factor` processes, one device each) and says whether a process fits this machine's
device; pipelined runs print the same table at start-up (stage balance).

Per process (bytes, P = the stage's parameters, R = replicas of the stage):
- weights: fp32 master copies, 4 P (ZeRO-3: 4 P / R plus the gathered root unit, which holds the
  embeddings and stays gathered through forward and backward, and two gathered blocks; ZeRO-2
  keeps the gathered parameters from forward to backward, so 4 P / R + P gathered; gathered copies
  are bf16/fp16 in such runs, 2 bytes a value);
- gradients: fp32, 4 P (ZeRO-2/3: / R);
- optimizer: two fp32 moments, 8 P (ZeRO-1/2/3: / R); with `--offload optimizer` (or
  `--optimizer-state-offchip`) they and an fp32 copy of the parameters (12 P) sit in host memory
  instead; under FSDP2 (ZeRO-2/3) any offload is FSDP2's CPU offload policy (`--offload full`): the
  fp32 shards, their gradients and the moments (16 P / R) live in host memory, and the device keeps
  only gathered copies (ZeRO-3: the root unit and two blocks) and one unit's unsharded gradient;
- activations: measured, not modelled: one block's forward runs at the run's micro-batch shape,
  precision and dropout, and the tensors autograd saves are counted; it runs on fake tensors of the
  device (no memory), and on a GPU for real only where it fits half the free memory (a plan is for
  GPUs too small for the run: it must not run out of their memory itself). With recomputation a
  block keeps only its input, plus one block's activations during its backward. Non-pipelined
  processes hold one micro-batch at a time; a pipeline stage holds every micro-batch in flight
  (GPipe: all of them; 1F1B: stages - stage);
- LM head and loss (last stage): the fp32 logits buffers — the whole (B T, V) logits, their
  log-softmax and gradient for `--lm-loss plain`, one row chunk and its gradient for the fused loss.
With `--tensor-model-parallel-size N` every process holds 1/N of the split weights (embedding, q/k/v,
projections, MLP) and all of the replicated ones (LayerNorms, row-parallel biases, position
embedding), so weights, gradients and moments shrink with them; the measured block activations
are split the same way except the LayerNorm inputs and outputs and the residual dropout masks
(about 4 residual-stream tensors, estimated, replicated unless `--sequence-parallel`), and the
head's logits are 1/N of the vocabulary wide.
In a pipeline, rank 0 also keeps the whole model's fp32 weights (validation, sampling, saving):
printed on its own line and counted in the verdict.
Not counted: transient buffers (a backward's activation gradients, optimizer temporaries), the
allocator's fragmentation and cache, the process itself (libraries, CUDA context: about 0.5-1 GiB).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError, collect
from gpt2forge.core.flags import opt, positive
from gpt2forge.core.memory import GiB, available_device_memory, available_host_memory, device_capacity
from gpt2forge.model.args import ModelArgs
from gpt2forge.model.build import resolve_model
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import Block
from gpt2forge.ops.lm_head_loss import LossChunking
from gpt2forge.parallel.topology import ParallelArgs, check_tensor_parallel, is_pipelined

OFFLOADS = ("none", "optimizer", "full")
"""--offload's vocabulary: nothing, the optimizer state and update, or parameters + gradients + optimizer."""


@dataclasses.dataclass
class MemoryArgs:
    """What trades compute for memory: the LM loss, recomputation, optimizer offload (section of TrainConfig)."""

    lm_loss: str = opt("auto", choices=("auto", "fused", "plain"))
    """fused: chunked LM head + loss that never holds the (B*T, V) logits (C++ op when built) | plain: full logits
    + cross-entropy | auto: fused on the CPU, plain on a GPU (faster there in a compiled step) unless a flag only fused
    honours is set."""
    enable_sequence_serialized: bool = opt(False, kind="bool")
    """Fused LM loss: chunks of --serialized-seq-len tokens (rows of the flattened batch) instead of the default ~128 MB
    of logits."""
    serialized_seq_len: int = opt(128)
    """Token chunk length for --enable-sequence-serialized."""
    embedding_serialization_factor: int = opt(1)
    """Fused LM loss: split the vocabulary into this many chunks (1/F the logits buffer for one extra head matmul)"""
    remap_logit: bool = opt(False, kind="bool")
    """Use the fused LM-head loss (--lm-loss auto's choice on the CPU; contradicts --lm-loss plain)"""
    recompute_checkpoint_every_layer: bool = opt(False, kind="bool")
    """Activation checkpointing of every block (recomputed in backward)"""
    recompute_checkpoint_layers: list[int] | None = opt(None, kind="list_int")
    """Checkpoint only these block indices."""
    optimizer_state_offchip: bool | None = opt(None, kind="bool")
    """Keep optimizer state in host memory and update there (CUDA; on CPU it is there already); the same as --offload
    optimizer."""
    offload: str | None = opt(None, choices=OFFLOADS)
    """what lives in pinned host memory: none | optimizer (optimizer state and update, as
    --optimizer-state-offchip) | full (parameters, gradients and optimizer state: FSDP2 ZeRO-3 with CPU offload, also in
    one process, each block streamed to the device ahead of use); default: optimizer with --optimizer-state-offchip
    true, else none."""
    device_memory_gib: float | None = opt(None)
    """--plan: the device memory to plan one device for, in GiB (default: this machine's device)"""

    def __post_init__(self) -> None:
        problems = positive(self, "embedding_serialization_factor", "serialized_seq_len")
        offchip = self.optimizer_state_offchip
        if self.offload is not None and offchip is not None and (self.offload != "none") != offchip:
            problems.append(f"--offload {self.offload} contradicts --optimizer-state-offchip {str(offchip).lower()}; "
                            "give --offload alone (optimizer is --optimizer-state-offchip true, full includes it)")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            problems.append(f"--device-memory-gib must be > 0 (got {self.device_memory_gib})")
        collect(problems)

    @property
    def offload_mode(self) -> str:
        """none | optimizer | full: --offload, else optimizer with --optimizer-state-offchip true."""
        if self.offload is not None:
            return self.offload
        return "optimizer" if self.optimizer_state_offchip else "none"

    @property
    def recompute(self) -> bool:
        """Whether any block recomputes its activations in backward."""
        return self.recompute_checkpoint_every_layer or bool(self.recompute_checkpoint_layers)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: int
    blocks: int
    params: int
    weights: float
    grads: float
    optimizer: float  # on the device
    activations: float
    head: float
    host: float  # optimizer state and fp32 parameter copies offloaded to host memory

    @property
    def device_total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.head


def resolved_lm_loss(memory: MemoryArgs, device_type: str) -> str:
    """--lm-loss as it runs on a `device_type` device: "fused" or "plain". auto is fused on the CPU (the
    C++ op: faster and smaller there) and where --remap-logit, --enable-sequence-serialized or
    --embedding-serialization-factor > 1 ask for its chunks; else plain: on an H200 (torch 2.11, GPT-2
    small, B=16, T=1,024, bf16, compiled, benchmarks/gpu_measure.sh) the plain loss trained faster
    than the fused one, at a somewhat higher peak memory (measured: docs/benchmarks.md, Design
    measurements)."""
    if memory.lm_loss != "auto":
        return memory.lm_loss
    chunked = memory.remap_logit or memory.enable_sequence_serialized or memory.embedding_serialization_factor > 1
    return "fused" if device_type == "cpu" or chunked else "plain"


PLAN_MARGIN = 0.5
"""--plan runs a real block on a GPU only when what it takes (block_run_bytes) is at most this share
of the memory free there: the plan exists for GPUs too small for the run, and must not fill them."""


def saved_block_bytes(cfg: ModelConfig, batch: int, seq_len: int, device: torch.device,
                      dtype: torch.dtype | None, fake: bool) -> int:
    """Bytes autograd saves for one block's backward at (batch, seq_len): one block's forward runs
    under autocast to `dtype` (None: fp32), and the saved tensors that are neither parameters nor
    the block's input are counted once each. `fake`: on fake tensors of `device` (shapes only: the
    same kernels' graph and saved tensors, no memory and no arithmetic, so emulated bf16 costs
    nothing); else for real, on `device`."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private torch API: imported only where used

    block = Block(cfg, 0).train()  # host memory; the fake run never puts it on the device
    if not fake:
        block.to(device)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        params = {name: (torch.empty(p.shape, dtype=p.dtype, device=device).requires_grad_(p.requires_grad)
                         if fake else p) for name, p in block.named_parameters()}
        x = torch.randn(batch, seq_len, cfg.n_embd, device=device, requires_grad=True)
        skip = {t.untyped_storage()._cdata for t in (x, *params.values())}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in skip:
                saved[storage._cdata] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            torch.func.functional_call(block, params, (x,))
    return sum(saved.values())


def block_run_bytes(cfg: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype | None, activations: int) -> int:
    """Device bytes a real run of one block takes: its fp32 parameters (and their autocast copies),
    the fp32 input, and the `activations` it saves."""
    copies = 2 if dtype is not None else 0
    return (4 + copies) * cfg.block_params + 4 * batch * seq_len * cfg.n_embd + activations


def block_activation_bytes(cfg: ModelConfig, batch: int, seq_len: int, device: torch.device,
                           dtype: torch.dtype | None, fake: bool | None = None) -> int:
    """Bytes autograd saves for one block's backward at (batch, seq_len) on `device`
    (saved_block_bytes). `fake` None: measured on fake tensors of the device (of the CPU, an upper
    bound, where the device's kernels have no fake version); on a GPU the block
    then runs for real only when block_run_bytes fits PLAN_MARGIN of the memory free there
    (available_device_memory), and that count is returned; else the fake one, so that --plan never
    runs what may not fit. True / False: fake / real only."""
    if fake is not None:
        return saved_block_bytes(cfg, batch, seq_len, device, dtype, fake)
    try:
        estimate = saved_block_bytes(cfg, batch, seq_len, device, dtype, fake=True)
    except (RuntimeError, NotImplementedError):  # a kernel without a fake (meta) version for this device
        # The CPU's count: its attention (SDPA's math kernel) saves more than a GPU's fused ones.
        estimate = saved_block_bytes(cfg, batch, seq_len, torch.device("cpu"), dtype, fake=True)
    if device.type != "cuda":
        return estimate
    have, _ = available_device_memory(device)
    if block_run_bytes(cfg, batch, seq_len, dtype, estimate) > PLAN_MARGIN * have:
        return estimate
    return saved_block_bytes(cfg, batch, seq_len, device, dtype, fake=False)


def stage_params(cfg: ModelConfig, layers: tuple[int, ...]) -> list[int]:
    """Parameters per stage: stage 0 the embeddings, the last ln_f and (when it is not stage 0) a
    copy of the tied embedding as the LM head."""
    C = cfg.n_embd
    wte, wpe = cfg.padded_vocab_size * C, cfg.n_positions * C
    counts = [n * cfg.block_params for n in layers]
    counts[0] += wte + wpe
    counts[-1] += 2 * C + (wte if len(layers) > 1 else 0)
    return counts


def tensor_parallel_params(cfg: ModelConfig, blocks: int, P: int, tp: int) -> int:
    """Parameters one of `tp` tensor-parallel processes holds of a stage of `P` parameters and
    `blocks` blocks: the replicated ones (per block two LayerNorms and the row-parallel biases;
    the position embedding and ln_f, counted for any stage) whole, the rest / tp."""
    C = cfg.n_embd
    replicated = blocks * 6 * C + cfg.n_positions * C + 2 * C
    return min(P, replicated) + max(P - replicated, 0) // tp


def sharded_state_bytes(P: int, root: int, block: int, R: int, zero: int, gathered: int,
                        offload: bool) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer state on the device, host bytes) of a stage of `P` parameters,
    `root` of them outside its blocks (the root FSDP unit), `block` per block, over `R` replicas at
    ZeRO `zero`, gathered copies `gathered` bytes a value; `offload`: any host offload."""
    weights = 4 * P
    if zero == 3:  # the root unit stays gathered through forward and backward, blocks two at a time
        weights = 4 * P / R + gathered * (root + 2 * block)
    elif zero == 2:
        weights = 4 * P / R + gathered * P
    grads = 4 * P / (R if zero >= 2 else 1)
    moments = 8 * P / (R if zero >= 1 else 1)
    if not offload:
        return weights, grads, moments, 0.0
    if zero >= 2:  # FSDP2's CPU offload: the fp32 shards, their gradients and the update on the host
        # The device keeps the gathered copies and one unit's unsharded fp32 gradient at a time.
        return weights - 4 * P / R, 4 * max(root, block), 0.0, 4 * P / R + grads + moments
    return weights, grads, 0.0, moments + 4 * P / (R if zero >= 1 else 1)  # moments + an fp32 copy


def build_plan(cfg: ParallelArgs, memory: MemoryArgs, model_cfg: ModelConfig, seq_len: int, device: torch.device,
               dtype: torch.dtype | None, zero: int, activation_bytes: int | None = None,
               replicas: int | None = None, micro_batches: int | None = None) -> list[StagePlan]:
    """One StagePlan per stage (micro-batches of `seq_len` tokens), for the layout at full size unless
    `replicas` (processes per stage) and `micro_batches` (per update and process) say what runs;
    `activation_bytes` (one block, one micro-batch) is measured with `block_activation_bytes` when not given."""
    layers = tuple(cfg.layers_per_ipu) if cfg.layers_per_ipu else (model_cfg.n_layer,)
    S = len(layers)
    R = replicas or cfg.replication_factor
    M = micro_batches or cfg.gradient_accumulation
    B, T, C, V = cfg.batch_size, seq_len, model_cfg.n_embd, model_cfg.padded_vocab_size
    act = activation_bytes if activation_bytes is not None else \
        block_activation_bytes(model_cfg, B, T, device, dtype)
    gathered = 2 if dtype is not None else 4  # FSDP2 gathers half-precision copies in bf16/fp16 runs
    residual = B * T * C * 4  # the residual stream (a block's input) stays fp32 under autocast
    recompute = memory.recompute
    offload = memory.offload_mode != "none"
    N, sequence_parallel = cfg.tensor_model_parallel_size, cfg.sequence_parallel
    block = tensor_parallel_params(model_cfg, 1, model_cfg.block_params, N)
    if N > 1:  # the replicated LayerNorm inputs/outputs and residual dropout masks stay whole without SP
        whole_act = 0 if sequence_parallel else min(act, 4 * residual)
        act = whole_act + (act - whole_act) // N
        residual = residual // N if sequence_parallel else residual
    plans = []
    for s, (n, P) in enumerate(zip(layers, stage_params(model_cfg, layers))):
        P = tensor_parallel_params(model_cfg, n, P, N)
        weights, grads, moments, host = sharded_state_bytes(P, P - n * block, block if n else 0, R, zero, gathered,
                                                            offload)
        in_flight = 1 if S == 1 else (M if cfg.pipeline_schedule == "GPipe" else min(M, S - s))
        per_micro = n * (residual if recompute else act)
        if s == 0:
            per_micro += 2 * residual  # embedding sum and its dropout
        activations = in_flight * per_micro + (act if recompute and n else 0)
        head = 0.0
        if s == S - 1:
            plain = resolved_lm_loss(memory, device.type) == "plain"
            rows = B * T if plain else min(B * T, LossChunking(
                memory.serialized_seq_len if memory.enable_sequence_serialized else None,
                memory.embedding_serialization_factor).rows(model_cfg.vocab_size, device.type))
            chunks = memory.embedding_serialization_factor
            width = V if plain else -(-model_cfg.vocab_size // chunks)
            if N > 1:  # the vocabulary-parallel loss: plain cross-entropy on this rank's 1/N of the logits
                rows, width = B * T, V // N
            head = (3 if plain or N > 1 else 2) * 4 * rows * width
        plans.append(StagePlan(s, n, P, weights, grads, moments, activations, head, host))
    return plans


def stage_flops(cfg: ModelConfig, layers: tuple[int, ...], seq_len: int) -> list[float]:
    """Training FLOPs per token of each stage: its blocks (matmuls and attention) and, on the
    last stage, the LM head (2 V C forward, 3x with backward), which weighs as much as several blocks."""
    C, F = cfg.n_embd, cfg.inner_dim
    block = 6 * (4 * C * C + 2 * C * F) + 12 * C * seq_len
    head = 6 * cfg.vocab_size * C
    flops = [n * block for n in layers]
    flops[-1] += head
    return flops


def balanced_layers(cfg: ModelConfig, stages: int, seq_len: int) -> tuple[int, ...]:
    """The `--layers-per-ipu` split (blocks per stage, in order) whose slowest stage has the least
    compute, the LM head counted on the last stage."""
    L = cfg.n_layer
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}

    def solve(first_block: int, stage: int) -> tuple[float, tuple[int, ...]]:
        """(max stage FLOPs, split) for blocks first_block.. over stages stage.."""
        if (first_block, stage) in best:
            return best[(first_block, stage)]
        left = L - first_block
        if stage == stages - 1:
            result = (stage_flops(cfg, (0,) * stage + (left,), seq_len)[-1], (left,))
        else:
            result = min(((max(stage_flops(cfg, (n, 0), seq_len)[0], rest[0]), (n,) + rest[1])
                          for n in range(left + 1) for rest in [solve(first_block + n, stage + 1)]),
                         key=lambda r: r[0])
        best[(first_block, stage)] = result
        return result

    return solve(0, 0)[1]


def print_compute_balance(cfg: ModelConfig, layers: tuple[int, ...], seq_len: int) -> None:
    """Each stage's share of the compute, and the split that balances it when this one does not."""
    flops = stage_flops(cfg, layers, seq_len)
    log.info("Compute per stage (share of the step): " + ", ".join(
        f"stage {s} {100 * f / sum(flops):.0f}%" for s, f in enumerate(flops)))
    balanced = balanced_layers(cfg, len(layers), seq_len)
    if balanced != layers:
        even = stage_flops(cfg, balanced, seq_len)
        log.info(f"Balanced compute: --layers-per-ipu {' '.join(map(str, balanced))} (slowest stage "
                 f"{100 * max(even) / sum(even):.0f}% of the step instead of {100 * max(flops) / sum(flops):.0f}%)")


def check_offload_fits_host(cfg: ParallelArgs, memory: MemoryArgs, model_cfg: ModelConfig, zero: int,
                            world_size: int, local_world_size: int) -> None:
    """Before any allocation: with host offload, the offloaded state of this host's processes
    (`local_world_size` of `world_size`) must fit the available host memory; else UsageError with
    both figures and the fix."""
    mode = memory.offload_mode
    if mode == "none":
        return
    layers = tuple(cfg.layers_per_ipu) if cfg.layers_per_ipu else (model_cfg.n_layer,)
    replicas = world_size // len(layers) if is_pipelined(len(layers), world_size) else world_size
    plans = build_plan(cfg, memory, model_cfg, 1, torch.device("cpu"), None, zero, activation_bytes=0,
                       replicas=replicas, micro_batches=1)
    need = sum(p.host for p in plans) * replicas * local_world_size / world_size  # this host's share of the job
    have = available_host_memory()
    if need > have:
        raise UsageError(f"--offload {mode}: the offloaded state needs {need / GiB:.1f} GiB of host memory but "
                         f"{have / GiB:.1f} GiB is available; free host memory, spread the job over more hosts "
                         "(--zero-stage 3 shards it), use a smaller model, or --offload none (--plan shows what "
                         "fits)")


def print_plan(plans: list[StagePlan], title: str) -> None:
    log.info(title)
    log.info("  stage  blocks  params   weights   grads  optimizer  activations  LM head   device  (GiB; host)")
    for p in plans:
        log.info(f"  {p.stage:>5}  {p.blocks:>6}  {p.params / 1e6:>5.0f}M  {p.weights / GiB:>8.2f}  "
                 f"{p.grads / GiB:>6.2f}  {p.optimizer / GiB:>9.2f}  {p.activations / GiB:>11.2f}  "
                 f"{p.head / GiB:>7.2f}  "
                 f"{p.device_total / GiB:>7.2f}" + (f"  host {p.host / GiB:.2f}" if p.host else ""))


PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
"""The GPT-2 sizes the one-device plan always answers for."""


def one_device_rows(cfg: ParallelArgs, memory: MemoryArgs, models: dict[str, ModelConfig], seq_len: int,
                    device: torch.device, dtype: torch.dtype | None) -> list[tuple[str, int, bool, dict]]:
    """(name, parameters, recompute, {offload mode: (device bytes, host bytes)}) of each model in
    one process at the run's micro-batch, without and with recomputation; full offload is
    one-process ZeRO-3 with FSDP2's CPU offload."""
    one = dataclasses.replace(cfg, layers_per_ipu=None, replication_factor=1)
    rows = []
    for name, mcfg in models.items():
        act = block_activation_bytes(mcfg, cfg.batch_size, seq_len, device, dtype)
        for recompute in (False, True):
            cells = {}
            for mode in OFFLOADS:
                mem = dataclasses.replace(memory, offload=mode, optimizer_state_offchip=None,
                                          recompute_checkpoint_every_layer=recompute, recompute_checkpoint_layers=None)
                plan = build_plan(one, mem, mcfg, seq_len, device, dtype, 3 if mode == "full" else 0,
                                  activation_bytes=act, replicas=1)[0]
                cells[mode] = (plan.device_total, plan.host)
            rows.append((name, plan.params, recompute, cells))
    return rows


def print_one_device_plan(cfg: ParallelArgs, memory: MemoryArgs, model_cfg: ModelConfig, model_name: str,
                          seq_len: int, device: torch.device, dtype: torch.dtype | None) -> None:
    """Which GPT-2 sizes (and the run's model) fit one device of --device-memory-gib (else this
    machine's) with no, optimizer or full offload, with and without recomputation, and the host
    memory each needs. A CPU run without --device-memory-gib plans for one memory: device + host."""
    models = {name: resolve_model(ModelArgs(model=name, max_len=seq_len)).config for name in PRESETS}
    if model_name not in models:
        models[model_name] = model_cfg
    rows = one_device_rows(cfg, memory, models, seq_len, device, dtype)
    host = available_host_memory()
    shared = memory.device_memory_gib is None and device.type == "cpu"
    have, what = (memory.device_memory_gib * GiB, "--device-memory-gib") if memory.device_memory_gib else \
        device_capacity(device)

    def fits(dev: float, off: float) -> bool:  # ~10% of a GPU for the CUDA context and the allocator
        return dev + off < host if shared else dev < 0.9 * have and off < host

    def label(mode: str) -> str:
        return f"{'no' if mode == 'none' else mode} offload"

    precision = "fp32" if dtype is None else str(dtype).removeprefix("torch.")
    where = ("the CPU, whose memory is the host's (--device-memory-gib plans a GPU)" if shared else
             f"{have / GiB:.1f} GiB ({what})")
    log.info(f"One device: {where}, micro-batch {cfg.batch_size} x {seq_len}, {precision}; host memory "
             f"{host / GiB:.1f} GiB available")
    log.info(f"  {'model':<16}{'params':>7}  recompute  " + "".join(f"{label(m):<23}" for m in OFFLOADS)
             + "(device GiB / host GiB)")
    largest: dict[str, tuple[int, str]] = {}  # offload mode -> (parameters, model) of the largest that fits
    for name, params, recompute, cells in rows:
        log.info(f"  {name:<16}{params / 1e6:>6.1f}M  {'yes' if recompute else 'no':<9}  " + "".join(
            f"{d / GiB:7.2f} / {h / GiB:6.2f} {'fits' if fits(d, h) else 'no':<5}" for d, h in cells.values()))
        for mode, (d, h) in cells.items():
            if fits(d, h) and params > largest.get(mode, (0, ""))[0]:
                largest[mode] = (params, name + (" with recomputation" if recompute else ""))
    log.info("Largest that fits: " + ", ".join(f"{label(mode)}: {largest.get(mode, (0, 'none'))[1]}"
                                               for mode in OFFLOADS))


def run_plan(cfg: ParallelArgs, memory: MemoryArgs, model_cfg: ModelConfig, seq_len: int, device: torch.device,
             dtype: torch.dtype | None, zero: int, model_name: str = "") -> int:
    """--plan: print the plan and whether a process fits this machine's device, and for a
    one-process layout which model sizes fit one device (`model_name` names the run's model); exit
    code 0."""
    N = cfg.tensor_model_parallel_size
    check_tensor_parallel(N, model_cfg.n_head, model_cfg.padded_vocab_size)
    plans = build_plan(cfg, memory, model_cfg, seq_len, device, dtype, zero)
    S, R = len(plans), cfg.replication_factor
    split = f" x {N} tensor-parallel{' (sequence-parallel)' if cfg.sequence_parallel else ''}" if N > 1 else ""
    R *= N  # processes per stage
    print_plan(plans, f"Memory plan per process: {S} stage(s) x {R // N} replica(s){split} = {S * R} process(es), "
                      f"micro-batch "
                      f"{cfg.batch_size} x {seq_len}, {cfg.gradient_accumulation} micro-batches per update, "
                      f"ZeRO {zero}, activations measured on {device.type}")
    # Pipelined: rank 0 also keeps the whole model (fp32 weights) for sampling and checkpoints.
    whole = 4 * sum(stage_params(model_cfg, (model_cfg.n_layer,))) if S > 1 else 0
    need = max(max(p.device_total for p in plans), plans[0].device_total + whole)
    if S > 1:
        print_compute_balance(model_cfg, tuple(p.blocks for p in plans), seq_len)
        log.info(f"Rank 0 (stage 0 of replica 0) also keeps the whole model's weights for validation, sampling "
                 f"and checkpoints: +{whole / GiB:.2f} GiB, {(plans[0].device_total + whole) / GiB:.2f} GiB in all")
    have, what = device_capacity(device)
    if device.type == "cuda":
        verdict = "fits" if need < 0.9 * have else "does not fit"
        log.info(f"Largest process: {need / GiB:.2f} GiB of {what}: {verdict} (with ~10% for the CUDA context "
                 "and allocator)")
    else:
        total = sum(p.device_total + p.host for p in plans) * R + whole
        verdict = "fits" if total < have else "does not fit"
        log.info(f"All {S * R} process(es) on this host: {total / GiB:.2f} GiB of {what}: {verdict}")
    if verdict == "does not fit":
        log.info("To shrink it: --recompute-checkpoint-every-layer true, --zero-stage 3 (or "
                 "--replicated-tensor-sharding true), --offload optimizer|full, more stages "
                 "(--layers-per-ipu), or a smaller --batch-size with more --gradient-accumulation")
    if S * R == 1:
        print_one_device_plan(cfg, memory, model_cfg, model_name, seq_len, device, dtype)
    return 0
