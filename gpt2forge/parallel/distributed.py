"""torch.distributed for the trainer: process group, data-parallel wrapping, ZeRO-1, collectives.

Launch with torchrun where the reference used PopRun: each process is one data-parallel replica
(`--replication-factor`), NCCL on GPUs, gloo on CPUs. Without torchrun (no WORLD_SIZE in the
environment) everything here is a no-op and the run is single-process, except one-process ZeRO-3
with `--offload full`, whose FSDP2 runs over a world of one (`init_single_process_group`).

Same math as one process: every update averages the gradient over all scored tokens of the global
batch. Each replica scales its summed loss by world_size / (global scored tokens), and DDP's mean
all-reduce turns that into exactly sum / global tokens. Replicas that have no process of their own
become extra gradient accumulation (layout.report_layout), so the global batch never changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from gpt2forge.core import log
from gpt2forge.core.device import with_index
from gpt2forge.core.errors import UsageError
from gpt2forge.parallel.health import backend_failure_hint, first_words, preflight
from gpt2forge.parallel.topology import ParallelArgs

TIMEOUT = datetime.timedelta(minutes=float(os.environ.get("GPT2FORGE_DIST_TIMEOUT_MIN", "10")))
"""Collective timeout: a rank that died makes the others fail after this, never hang forever
(fractions of a minute are allowed: 0.25 is 15 s)."""


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's place in the job (torchrun's RANK, LOCAL_RANK, WORLD_SIZE)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_launcher() -> DistEnv:
    """Read torchrun's variables; a single process when they are absent."""
    try:
        return DistEnv(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                       int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as exc:
        raise UsageError(f"RANK / LOCAL_RANK / WORLD_SIZE must be integers (launch with torchrun): {exc}") from None


def check_world(env: DistEnv, replication_factor: int, stages: int = 1, tensor_parallel: int = 1) -> None:
    """A layout that does not fit the processes is refused before any process group work.
    `stages` pipeline stages run in their own processes when the world is a multiple of them;
    `tensor_parallel` processes split each replica's weights (the world is replicas x it)."""
    if not env.enabled:
        return
    if env.world_size % tensor_parallel:
        raise UsageError(f"--tensor-model-parallel-size {tensor_parallel} does not divide the {env.world_size} "
                         f"processes torchrun started; start a multiple of {tensor_parallel} processes")
    world = env.world_size // tensor_parallel  # processes per tensor-parallel rank
    if stages > 1 and world >= stages:
        if world % stages:
            raise UsageError(f"{env.world_size} processes cannot hold {stages} pipeline stages (--layers-per-ipu) "
                             f"x replicas; start a multiple of {stages} processes (or fewer than {stages} to "
                             "run the stages co-located)")
        replicas = world // stages
        if replication_factor % replicas:
            raise UsageError(f"--replication-factor {replication_factor} is not a multiple of the {replicas} "
                             f"replicas that {env.world_size} processes / {stages} stages make; start "
                             f"{stages} x a divisor of {replication_factor} processes")
        return
    if replication_factor % world:
        shown = f"{world} replicas that the {env.world_size} processes / --tensor-model-parallel-size " \
                f"{tensor_parallel} make" if tensor_parallel > 1 else f"{env.world_size} processes torchrun started"
        raise UsageError(f"--replication-factor {replication_factor} is not a multiple of the {shown}; start a "
                         "number of processes that divides it (missing replicas become gradient accumulation)")


def init_process_group(env: DistEnv, device: torch.device) -> None:
    """Join the process group (NCCL on CUDA, gloo otherwise) with a finite timeout, then `preflight` it;
    a backend that cannot connect is one line (UsageError) naming its words and the fix."""
    if not env.enabled or dist.is_initialized():
        return
    # On GPUs NCCL moves CUDA tensors and gloo the CPU ones (FSDP2's CPU-offloaded gradient norm,
    # object collectives of host state), so neither kind of tensor meets a backend it lacks.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    device = with_index(device)  # init_process_group refuses a device_id without an index
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device.type == "cuda" else None
    try:
        if (store := _store_of_this_attempt()) is not None:
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=TIMEOUT,
                                    device_id=device_id)
        else:
            dist.init_process_group(backend, timeout=TIMEOUT, device_id=device_id)
    except dist.DistBackendError as exc:  # NCCL connects its communicator here (device_id: eagerly)
        said = first_words(exc)
        raise UsageError(f"joining the process group over {backend} failed ({said}); "
                         f"{backend_failure_hint(said, backend)}") from None
    log.info(f"Distributed: {env.world_size} processes, backend {backend}")
    preflight(device)


def _store_of_this_attempt() -> dist.Store | None:
    """torchrun's store for its workers, with keys of their own per restart attempt; None where
    torch's env:// store is right. Under c10d rendezvous torchrun's workers share its rendezvous
    store (TORCHELASTIC_USE_AGENT_STORE), and torch reuses their keys across restarts: workers
    restarted by --max-restarts read the previous attempt's gloo/NCCL addresses and fail with
    "Connection refused" (pytorch/pytorch#135712). The attempt is TORCHELASTIC_RESTART_COUNT, which
    agrees across nodes when every node's torchrun saw its workers fail (the survivors of a lost
    process fail at once, on its closed connection); a node whose torchrun restarted for a membership
    change alone counts one fewer, and its ranks then fail after the collective timeout.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (run/launch.sh with MAX_RESTARTS) avoids the shared store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=TIMEOUT)
    return dist.PrefixStore(f"/gpt2forge/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def device_for(env: DistEnv, device: torch.device) -> torch.device:
    """One GPU per local rank on CUDA; CPU processes share the CPU."""
    if device.type == "cuda" and env.enabled:
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise UsageError(f"local rank {env.local_rank} has no GPU of its own: this node has {count} CUDA "
                             f"device(s); start at most {count} process(es) per node (NPROC_PER_NODE / "
                             "--nproc_per_node) or pass --device cpu")
        return torch.device("cuda", env.local_rank)
    return device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_data_parallel(model: torch.nn.Module, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """DDP around the model (gradient all-reduce overlapped with backward); the model itself otherwise."""
    if not env.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


def full_optimizer_state(optimizer: torch.optim.Optimizer, env: DistEnv) -> dict | None:
    """The optimizer's state dict as one process would hold it; on every rank a collective for ZeRO-1.
    Returns None on ranks other than 0 when the state is sharded."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if env.is_main else None
    return optimizer.state_dict()


def requested_zero_stage(cfg: ParallelArgs, offload: str = "none") -> int:
    """--zero-stage, defaulting to 3 with --offload full, else to 1 with --replicated-tensor-sharding,
    else 0. Raises UsageError for --offload full below ZeRO-2 (only FSDP2 streams parameters)."""
    zero_stage = cfg.zero_stage
    if zero_stage is None:
        return 3 if offload == "full" else (1 if cfg.replicated_tensor_sharding else 0)
    if offload == "full" and zero_stage < 2:
        raise UsageError(f"--offload full streams parameters through FSDP2 and needs --zero-stage 2 or 3, not "
                         f"--zero-stage {zero_stage}; drop --zero-stage (full offload implies 3) or use "
                         "--offload optimizer")
    return zero_stage


def resolve_zero_stage(cfg: ParallelArgs, env: DistEnv, offload: str = "none") -> int:
    """The ZeRO stage that runs (see `requested_zero_stage`). One process shards nothing: its stage is
    0 (with a notice), except with --offload full, where FSDP2 over a world of one streams every
    block's parameters between host and device."""
    stage = requested_zero_stage(cfg, offload)
    if stage and not env.enabled and offload != "full":
        log.notice(f"ZeRO stage {stage}: one process, nothing to shard (launch replicas with torchrun; "
                   "--offload full runs ZeRO-3 in one process with every state in host memory)")
        return 0
    return stage


def init_single_process_group(device: torch.device) -> None:
    """A process group of this process alone, when none exists: FSDP2 needs one even at world size
    1. An in-process store (no port, no rendezvous); `shutdown` destroys it at the end of the run."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # as init_process_group
    device = with_index(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    log.info(f"Distributed: one process (a world of one for FSDP2), backend {backend}")


def processes_on_this_host() -> int:
    """Processes of the job on this host (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as exc:
        raise UsageError(f"LOCAL_WORLD_SIZE must be an integer (launch with torchrun): {exc}") from None


def fsdp_options(mesh, stage: int, offload: bool, param_dtype: torch.dtype | None) -> dict:
    """fully_shard's arguments for ZeRO `stage` 2|3. Stage 2 keeps the gathered parameters from
    forward to backward (gradients and optimizer state sharded); stage 3 re-shards them after
    forward (parameters sharded too). `offload` keeps the shards, their gradients and the optimizer
    update in host memory (ZeRO-offload). `param_dtype` (bf16/fp16 runs) gathers and computes with
    half-precision copies of the fp32 shards and reduces gradients in fp32, as torchtitan does."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    options = {"reshard_after_forward": stage == 3, "mesh": mesh}
    if offload:  # pinned host memory where there is a GPU to copy to
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if param_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    return options


def shard_model(model: torch.nn.Module, stage: int, offload: bool, device: torch.device,
                param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 (ZeRO-2/3, see `fsdp_options`): every block one unit, the root holding the embeddings,
    ln_f and the tied head. With `offload`, every block explicitly prefetches the next one it will
    need (forward: the next block, backward: the one before), so the copy overlaps compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The mesh names the device: left out, FSDP2 takes the host's accelerator even for a CPU run.
    options = fsdp_options(init_device_mesh(device.type, (dist.get_world_size(),)), stage, offload, param_dtype)
    blocks = list(model.transformer.h.values())
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if offload:  # each block's host-to-device copy is issued while the block before (backward: after) computes
        for block, after in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([block])


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(whole model state dict, named optimizer state) of an FSDP2 model, on the CPU of rank 0
    (empty elsewhere); a collective of all ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def whole_model_state(model: torch.nn.Module) -> dict:
    """The whole model state dict of an FSDP2 model on the CPU of rank 0 (empty elsewhere); a
    collective of all ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_sharded_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, named: dict) -> None:
    """Load a whole-model named optimizer state (every rank holds it) into an FSDP2 model's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective of its mesh), else the tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns t (a no-op in one process)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
