"""The parallel layout the reference's IPU flags describe, validated and printed once.

`--layers-per-ipu 0 4 4 4` is data: stage 0 holds the embeddings (and, tied to them, the LM head),
entry i says how many blocks stage i holds. Launched with stages x k processes, each stage runs in
its own process (gpt2forge.parallel.pipeline) and k replicas run data-parallel; with fewer processes the
stages run co-located in one process (same math). Data-parallel replicas that have no process of
their own become extra gradient accumulation (same global batch, same math).
"""

from __future__ import annotations

import dataclasses

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    layers_per_stage: tuple[int, ...]
    """Blocks per pipeline stage (stage 0 also holds the embeddings and the tied LM head)."""
    replicas: int
    """Data-parallel replicas asked for."""
    world_size: int
    """Processes actually running."""

    @property
    def stages(self) -> int:
        return len(self.layers_per_stage)

    @property
    def pipelined(self) -> bool:
        """Each stage in its own process (else all stages co-located in every process)."""
        return is_pipelined(self.stages, self.world_size)

    @property
    def data_parallel(self) -> int:
        """Data-parallel processes per stage."""
        return self.world_size // self.stages if self.pipelined else self.world_size

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
        return lines


def is_pipelined(stages: int, world_size: int) -> bool:
    return stages > 1 and world_size >= stages and world_size % stages == 0


def stages_of(cfg: TrainConfig) -> int:
    return len(cfg.layers_per_ipu) if cfg.layers_per_ipu else 1


def build_layout(cfg: TrainConfig, n_layer: int, world_size: int = 1) -> Layout:
    """Validate the IPU layout flags against the model; UsageError names the flag and the fix."""
    if cfg.layers_per_ipu is None:
        return Layout((n_layer,), cfg.replication_factor, world_size)
    layers = tuple(cfg.layers_per_ipu)
    if sum(layers) != n_layer:
        raise UsageError(f"--layers-per-ipu {' '.join(map(str, layers))} places {sum(layers)} blocks but the model "
                         f"has n_layer={n_layer}; give entries that add up to {n_layer}")
    if len(layers) != cfg.ipus_per_replica:
        raise UsageError(f"--layers-per-ipu has {len(layers)} entries but --ipus-per-replica is "
                         f"{cfg.ipus_per_replica}; give one entry per stage")
    if is_pipelined(len(layers), world_size) and cfg.pipeline_schedule == "1F1B" \
            and cfg.gradient_accumulation < len(layers):
        raise UsageError(f"--pipeline-schedule 1F1B needs at least one micro-batch per stage: "
                         f"--gradient-accumulation {cfg.gradient_accumulation} < {len(layers)} stages; raise it "
                         "or use --pipeline-schedule GPipe")
    if cfg.matmul_proportion is not None and len(cfg.matmul_proportion) != cfg.ipus_per_replica:
        raise UsageError(f"--matmul-proportion has {len(cfg.matmul_proportion)} values but --ipus-per-replica "
                         f"is {cfg.ipus_per_replica}; give one per stage")
    return Layout(layers, cfg.replication_factor, world_size)


def report_layout(layout: Layout, cfg: TrainConfig) -> int:
    """Print the stage map and the notices for co-located stages / missing replicas / no-op flags.
    Returns the gradient accumulation this process must run to keep the global batch."""
    if layout.stages > 1:
        log.banner("Device Allocation")
        for line in layout.stage_map():
            log.info(line)
        if not layout.pipelined:
            log.notice(f"{layout.stages} pipeline stages run co-located in each of the {layout.world_size} "
                       f"process(es) (same math, no pipelining; launch {layout.stages} x replicas processes "
                       "to pipeline)")
    accumulation = cfg.gradient_accumulation
    if layout.replicas > layout.data_parallel:
        factor = layout.replicas // max(layout.data_parallel, 1)
        accumulation *= factor
        log.notice(f"--replication-factor {layout.replicas} with {layout.data_parallel} data-parallel process(es): "
                   f"gradient accumulation {cfg.gradient_accumulation} x {factor} = {accumulation} keeps the "
                   f"global batch of {cfg.samples_per_update} sequences")
    _ipu_only_notices(cfg, layout.world_size)
    return accumulation


def _ipu_only_notices(cfg: TrainConfig, world_size: int) -> None:
    """Flags that are accepted and do nothing on these devices (yet) say so once."""
    if cfg.matmul_proportion is not None:
        log.notice("--matmul-proportion is an IPU memory-planner knob with no equivalent; ignored")
    if cfg.replicated_tensor_sharding and world_size == 1:
        log.notice("--replicated-tensor-sharding: one replica process, nothing to shard (launch with torchrun)")
    if cfg.async_dataloader:
        log.notice("--async-dataloader: batches are prefetched by DataLoader workers (--num-workers)")
