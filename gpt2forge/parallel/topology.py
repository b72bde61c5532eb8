"""The parallel layout the reference's IPU flags describe, validated and printed once.

`--layers-per-ipu 0 4 4 4` is data: stage 0 holds the embeddings (and, tied to them, the LM head),
entry i says how many blocks stage i holds. Launched with stages x k processes, each stage runs in
its own process (gpt2forge.parallel.pipeline_stages) and k replicas run data-parallel; with fewer processes the
stages run co-located in one process (same math). Data-parallel replicas that have no process of
their own become extra gradient accumulation (same global batch, same math).

`--tensor-model-parallel-size N` splits every replica's heads, MLP, embedding and LM head over N
processes (gpt2forge.parallel.tensor_parallel); the processes of the job are then data-parallel
replicas x N, with the N tensor-parallel ranks of a replica adjacent (rank = replica x N + tp rank).
With pipeline stages in their own processes too (stages x replicas x N processes), each stage is
split over N processes, `tp` still innermost: rank = (replica x stages + stage) x N + tp rank
(one mesh ("dp", "pp", "tp"), gpt2forge.parallel.pipeline_stages).
"""

from __future__ import annotations

import dataclasses

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError, collect
from gpt2forge.core.flags import opt, positive


@dataclasses.dataclass
class ParallelArgs:
    """Batch geometry and the parallel layout: the reference's IPU flags (section of TrainConfig)."""

    batch_size: int = opt(1)
    """Micro-batch size per replica."""
    gradient_accumulation: int = opt(1)
    """Micro-batches per optimizer update (gradients averaged)"""
    replication_factor: int = opt(1)
    """Data-parallel replicas (one process each; run alone, missing replicas become extra gradient accumulation)"""
    device_iterations: int = opt(4)
    """Optimizer updates per host (logged) step."""
    layers_per_ipu: list[int] | None = opt(None, kind="list_int")
    """Blocks per pipeline stage, e.g. 0 4 4 4 (stage 0 holds the embeddings); must add up to n_layer."""
    ipus_per_replica: int = opt(4)
    """Pipeline stages per model replica."""
    pipeline_schedule: str = opt("1F1B", choices=("GPipe", "1F1B"))
    """pipeline schedule over the --gradient-accumulation micro-batches when stages run in their own processes:
    GPipe | 1F1B."""
    zero_stage: int | None = opt(None, choices=(0, 1, 2, 3))
    """ZeRO sharding across replicas: 0 none | 1 optimizer state | 2 + gradients | 3 + parameters (2 and 3 with
    FSDP2); default 1 with --replicated-tensor-sharding, else 0."""
    replicated_tensor_sharding: bool = opt(False, kind="bool")
    """Shard optimizer state across replicas (ZeRO-1)"""
    tensor_model_parallel_size: int = opt(1)
    """tensor-parallel processes per model replica: attention heads, the MLP, the embedding and the LM head are
    split over them (DTensor); processes = data-parallel replicas x this."""
    sequence_parallel: bool = opt(False, kind="bool")
    """with --tensor-model-parallel-size > 1, also split the LayerNorm and dropout regions along the sequence."""
    matmul_proportion: list[float] | None = opt(None, kind="list_float")
    """IPU matmul memory proportion (no equivalent: ignored)"""

    def __post_init__(self) -> None:
        problems = positive(self, "batch_size", "gradient_accumulation", "ipus_per_replica", "replication_factor",
                            "device_iterations", "tensor_model_parallel_size")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            problems.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if self.layers_per_ipu is not None and any(n < 0 for n in self.layers_per_ipu):
            problems.append("--layers-per-ipu entries must be >= 0")
        collect(problems)

    @property
    def samples_per_update(self) -> int:
        """Global batch in sequences: micro-batch x accumulation x replicas."""
        return self.batch_size * self.gradient_accumulation * self.replication_factor

    @property
    def samples_per_step(self) -> int:
        """Sequences per host (logged) step: global batch x device iterations."""
        return self.samples_per_update * self.device_iterations


@dataclasses.dataclass(frozen=True)
class Layout:
    layers_per_stage: tuple[int, ...]
    """Blocks per pipeline stage (stage 0 also holds the embeddings and the tied LM head)."""
    replicas: int
    """Data-parallel replicas asked for."""
    world_size: int
    """Processes actually running."""
    tensor_parallel: int = 1
    """Processes that split one replica's weights (--tensor-model-parallel-size)."""
    sequence_parallel: bool = False
    """LayerNorm and dropout regions split along the sequence too (--sequence-parallel)."""

    @property
    def stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def pipelined(self) -> bool:
        """Each stage in its own process (else all stages co-located in every process)."""
        return is_pipelined(self.stages, self.world_size // self.tensor_parallel)

    @property
    def data_parallel(self) -> int:
        """Data-parallel processes per stage (each a group of `tensor_parallel` processes)."""
        per_stage = self.world_size // self.stages if self.pipelined else self.world_size
        return max(per_stage // self.tensor_parallel, 1)

    def stage_of_layer(self) -> list[int]:
        """Block index -> stage index."""
        return [s for s, n in enumerate(self.layers_per_stage) for _ in range(n)]

    def stage_map(self) -> list[str]:
        lines = ["Embedding --> stage 0"]
        lines += [f"Layer {i:<2} --> stage {s}" for i, s in enumerate(self.stage_of_layer())]
        if self.pipelined:
            lines.append(f"LM_head --> stage {self.stages - 1} (a copy of the embedding; gradients summed "
                         "with stage 0)")
        else:
            lines.append("LM_head --> stage 0 (tied to the embedding)")
        if self.pipelined and self.tensor_parallel > 1:
            lines.append(f"Each stage split over {self.tensor_parallel} tensor-parallel processes: rank = (replica x "
                         f"{self.stages} + stage) x {self.tensor_parallel} + tensor-parallel rank")
        return lines


def is_pipelined(stages: int, world_size: int) -> bool:
    return stages > 1 and world_size >= stages and world_size % stages == 0


def stages_of(cfg: ParallelArgs) -> int:
    return len(cfg.layers_per_ipu) if cfg.layers_per_ipu else 1


def build_layout(cfg: ParallelArgs, n_layer: int, world_size: int = 1) -> Layout:
    """Validate the IPU layout flags against the model; UsageError names the flag and the fix."""
    tp = cfg.tensor_model_parallel_size
    if cfg.layers_per_ipu is None:
        return Layout((n_layer,), cfg.replication_factor, world_size, tp, cfg.sequence_parallel)
    layers = tuple(cfg.layers_per_ipu)
    if sum(layers) != n_layer:
        raise UsageError(f"--layers-per-ipu {' '.join(map(str, layers))} places {sum(layers)} blocks but the model "
                         f"has n_layer={n_layer}; give entries that add up to {n_layer}")
    if len(layers) != cfg.ipus_per_replica:
        raise UsageError(f"--layers-per-ipu has {len(layers)} entries but --ipus-per-replica is "
                         f"{cfg.ipus_per_replica}; give one entry per stage")
    if cfg.matmul_proportion is not None and len(cfg.matmul_proportion) != cfg.ipus_per_replica:
        raise UsageError(f"--matmul-proportion has {len(cfg.matmul_proportion)} values but --ipus-per-replica "
                         f"is {cfg.ipus_per_replica}; give one per stage")
    layout = Layout(layers, cfg.replication_factor, world_size, tp, cfg.sequence_parallel)
    # The schedule runs the micro-batches of this process: missing replicas folded in count too.
    micro_batches = folded_accumulation(layout, cfg)
    if layout.pipelined and cfg.pipeline_schedule == "1F1B" and micro_batches < layout.stages:
        folded = f" ({micro_batches} with the missing replicas folded in)" if micro_batches != \
            cfg.gradient_accumulation else ""
        raise UsageError(f"--pipeline-schedule 1F1B needs at least one micro-batch per stage: "
                         f"--gradient-accumulation {cfg.gradient_accumulation}{folded} < {layout.stages} stages; "
                         "raise it or use --pipeline-schedule GPipe")
    return layout


def folded_accumulation(layout: Layout, cfg: ParallelArgs) -> int:
    """Micro-batches per update in each process: --gradient-accumulation, times the replicas that have
    no process of their own (they become accumulation, so the global batch stays the same)."""
    return cfg.gradient_accumulation * max(layout.replicas // max(layout.data_parallel, 1), 1)


def check_tensor_parallel(tp: int, n_head: int, padded_vocab: int, world_size: int | None = None) -> None:
    """UsageError, one line with the numbers, when `tp` does not divide the heads, the padded
    vocabulary or (when given) the processes."""
    problems = [f"{what} {n}" for what, n in (("n_head", n_head), ("the padded vocabulary", padded_vocab),
                                               ("the world size", world_size)) if n is not None and n % tp]
    if problems:
        raise UsageError(f"--tensor-model-parallel-size {tp} must divide {', '.join(problems)}; pick a divisor "
                         "of each")


def report_layout(layout: Layout, cfg: ParallelArgs, accumulation: int) -> None:
    """Print the stage map and the notices for co-located stages / missing replicas folded into
    `accumulation` (folded_accumulation's) / no-op flags."""
    if layout.stages > 1:
        log.banner("Device Allocation")
        for line in layout.stage_map():
            log.info(line)
        if not layout.pipelined:
            log.notice(f"{layout.stages} pipeline stages run co-located in each of the {layout.world_size} "
                       f"process(es) (same math, no pipelining; launch {layout.stages} x replicas processes "
                       "to pipeline)")
    if layout.replicas > layout.data_parallel:
        factor = accumulation // cfg.gradient_accumulation
        log.notice(f"--replication-factor {layout.replicas} with {layout.data_parallel} data-parallel process(es): "
                   f"gradient accumulation {cfg.gradient_accumulation} x {factor} = {accumulation} keeps the "
                   f"global batch of {cfg.samples_per_update} sequences")
    _ipu_only_notices(cfg, layout.world_size)


def _ipu_only_notices(cfg: ParallelArgs, world_size: int) -> None:
    """Flags that are accepted and do nothing on these devices (yet) say so once."""
    if cfg.matmul_proportion is not None:
        log.notice("--matmul-proportion is an IPU memory-planner knob with no equivalent; ignored")
    if cfg.replicated_tensor_sharding and world_size == 1:
        log.notice("--replicated-tensor-sharding: one replica process, nothing to shard (launch with torchrun)")
