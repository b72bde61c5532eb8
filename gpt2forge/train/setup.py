"""What a training run resolves before its first step, in order: the process, its device and precision
(`start_process`), `--plan`'s memory plan instead of a run (`plan_memory`), the ZeRO stage, host checks,
model, layout and process group (`set_up` -> `Setup`), and the step's parts, the data, the schedule,
the meter and the monitor (`build_loop` -> `Loop`, what the loop in gpt2forge.train.trainer advances).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.determinism import deterministic_algorithms
from gpt2forge.core.device import configure_host_allocator, resolve_device, synchronize
from gpt2forge.core.errors import UsageError
from gpt2forge.core.loss_scaler import LossScaler, build_loss_scaler
from gpt2forge.core.memory import refuse_beyond_host
from gpt2forge.core.precision import autocast_dtype, configure_matmul, resolve_precision
from gpt2forge.data import DatasetSplit
from gpt2forge.data.args import notice_ignored_flags
from gpt2forge.evaluation.quick import QuickEval
from gpt2forge.model.build import build_model
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops.fp_mode import denormals_flushed
from gpt2forge.parallel.distributed import (
    DistEnv,
    check_world,
    device_for,
    env_from_launcher,
    init_process_group,
    processes_on_this_host,
    requested_zero_stage,
    resolve_zero_stage,
)
from gpt2forge.parallel.health import Watchdog
from gpt2forge.parallel.memory_plan import (
    build_plan,
    check_offload_fits_host,
    print_compute_balance,
    print_plan,
    run_plan,
)
from gpt2forge.parallel.strategy import ParallelRequest, Strategy, build_strategy
from gpt2forge.parallel.topology import Layout, build_layout, folded_accumulation, report_layout, stages_of
from gpt2forge.train.batches import load_data
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.kfac import build_preconditioner
from gpt2forge.train.memory_features import apply_memory_features, offload_to_host
from gpt2forge.train.metrics.monitor import RunMonitor
from gpt2forge.train.metrics.peak_flops import StepMeter, device_peak_flops, in_run_peak_flops, peak_flops_reader
from gpt2forge.train.optim import build_lr_schedule, build_optimizer
from gpt2forge.train.schedule import build_run_schedule
from gpt2forge.train.signals import exit_signals
from gpt2forge.train.state import Progress, apply_auto_resume, resume
from gpt2forge.train.step import Run, train_step


@dataclasses.dataclass(frozen=True)
class Setup:
    """What `set_up` resolved before training: the process, its device, precision, model and layout."""

    cfg: TrainConfig
    env: DistEnv
    device: torch.device
    precision: str
    model: GPT2LMHeadModel
    ckpt_dir: Path | None
    """The checkpoint the weights came from (resumed from with --resume-training-from-checkpoint), or None."""
    layout: Layout
    accumulation: int
    """Micro-batches per update in this process (replicas folded in included)."""
    zero: int
    """The ZeRO stage this process runs."""


@dataclasses.dataclass
class Loop:
    """The training loop's state: what its functions read and advance."""

    run: Run
    data: DatasetSplit
    progress: Progress
    total_steps: int
    steps_per_epoch: int
    meter: StepMeter
    monitor: RunMonitor
    last_val: tuple[float, float, int] | None = None
    """(loss, perplexity, tokens) of the last validation, None before one."""

    @property
    def cfg(self) -> TrainConfig:
        return self.run.cfg


def start_process(cfg: TrainConfig) -> tuple[TrainConfig, DistEnv, torch.device, str]:
    """This process of the job, checked against the layout; `cfg` with --auto-resume applied; the
    seeds; its device (made the current one) and precision. Returns (cfg, env, device, precision)."""
    env = env_from_launcher()
    check_world(env, cfg.parallel.replication_factor, stages_of(cfg.parallel),  # before any process group work
                cfg.parallel.tensor_model_parallel_size)
    cfg = apply_auto_resume(cfg)
    torch.manual_seed(cfg.data.seed)
    random.seed(cfg.data.seed)
    device = device_for(env, resolve_device(cfg.runtime.device))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the current device is the run's (synchronize, streams, compile)
    if device.type == "cpu":
        configure_host_allocator()
    return cfg, env, device, resolve_precision(cfg.runtime.precision, device)


def plan_memory(cfg: TrainConfig, device: torch.device, precision: str) -> int:
    """--plan: the memory plan of the run, without building the model."""
    model_cfg = cfg.model_source().config
    build_layout(cfg.parallel, model_cfg.n_layer)  # the layout flags must describe this model
    parallel = cfg.parallel
    zero = requested_zero_stage(parallel, cfg.memory.offload_mode)
    name = Path(cfg.arch.model_config).stem if cfg.arch.model_config else cfg.arch.model
    return run_plan(parallel, cfg.memory, model_cfg, cfg.arch.max_len, device, autocast_dtype(precision), zero, name)


def check_step_fits_host(cfg: TrainConfig) -> None:
    """One host step's token ids (int64 inputs and labels, samples per step x --max-len) are held in
    host memory at once: refuse a batch that cannot be (a mistyped --batch-size or
    --gradient-accumulation), before the data order is drawn for it."""
    p = cfg.parallel
    refuse_beyond_host(16.0 * cfg.samples_per_step * cfg.arch.max_len,
                       f"one step's token ids, {cfg.samples_per_step:,} sequences of {cfg.arch.max_len} tokens "
                       f"(--batch-size {p.batch_size} x --gradient-accumulation {p.gradient_accumulation} x "
                       f"--replication-factor {p.replication_factor} x --device-iterations {p.device_iterations}),",
                       "choose a smaller batch")


def set_up(cfg: TrainConfig, env: DistEnv, device: torch.device, precision: str) -> Setup:
    """The ZeRO stage, the host checks, the model and the layout; then the process group is joined."""
    zero = resolve_zero_stage(cfg.parallel, env, cfg.memory.offload_mode)
    source = cfg.model_source()  # once: the host check and the model both need it
    check_step_fits_host(cfg)
    if cfg.memory.offload_mode != "none":  # before any allocation
        check_offload_fits_host(cfg.parallel, cfg.memory, source.config, zero, env.world_size,
                                processes_on_this_host())
    configure_matmul(device, precision, cfg.runtime.enable_half_partials)
    model = build_model(source, device)
    layout = build_layout(cfg.parallel, model.config.n_layer, env.world_size)
    accumulation = folded_accumulation(layout, cfg.parallel)  # replicas without a process fold into accumulation
    report_layout(layout, cfg.parallel, accumulation)
    notice_ignored_flags(cfg.data)
    if not cfg.runtime.custom_ops:
        log.notice("--custom-ops False: ignored; each C++ op runs wherever the library built by `make` is present "
                   "(its PyTorch reference where not)")
    init_process_group(env, device)
    return Setup(cfg, env, device, precision, model, source.checkpoint, layout, accumulation, zero)


@contextlib.contextmanager
def training_modes(cfg: TrainConfig, device: torch.device):
    """What the process trains under: SIGTERM/SIGUSR1 save and stop after a step; on the CPU, denormals
    flushed to zero (a denormal softmax once made an Intel CPU's steps an order of magnitude slower:
    gpt2forge.ops.fp_mode); --deterministic's algorithms."""
    with (exit_signals(cfg.checkpoint.exit_signal_handler), denormals_flushed(device),
          deterministic_algorithms(cfg.runtime.deterministic, device)):
        yield


def build_loop(s: Setup) -> Loop:
    """The step's parts; the data, the run's length, schedule and `Run`; resume; the meter and the monitor."""
    cfg = s.cfg
    strategy, optimizer, scaler, kfac = _step_parts(s)
    data, steps_per_epoch, total_steps = load_data(cfg, s.model.config.vocab_size, cfg.samples_per_step)
    iterations = cfg.parallel.device_iterations
    # Megatron's units: a schedule in samples advances by the global batch (samples per update) per update.
    scheduler = build_run_schedule(optimizer, cfg.optim, total_steps * iterations, cfg.samples_per_update)
    run = Run(cfg, strategy, optimizer, scheduler, scaler, s.device, s.precision, s.accumulation, kfac=kfac)
    if s.env.enabled:
        run.watchdog = Watchdog(strategy.process_name)
        strategy.attach_watchdog(run.watchdog)
    if cfg.eval.eval_wikitext or cfg.eval.eval_lambada:
        run.quick_eval = QuickEval(cfg.eval.eval_wikitext, cfg.eval.eval_lambada, cfg.arch.max_len,
                                   s.model.config.vocab_size, cfg.parallel.batch_size)
    progress = Progress()
    if cfg.checkpoint.resume_training_from_checkpoint:
        resume(run, s.ckpt_dir, progress)
    peak_flops, read = device_peak_flops(s.device, s.precision), in_run_peak_flops(s.device, s.precision)
    if s.device.type == "cuda":  # tokens/s is the job's: one GPU per process (CPU processes share one peak)
        peak_flops = peak_flops * s.env.world_size if peak_flops else peak_flops
        read = read * s.env.world_size if read else read
    meter = StepMeter(cfg.samples_per_step, cfg.arch.max_len, s.model.config.flops_per_token(cfg.arch.max_len),
                      peak_flops, reread_peak_flops=peak_flops_reader(s.device, s.precision), peak_flops_read=read)
    return Loop(run, data, progress, total_steps, steps_per_epoch, meter, RunMonitor(cfg, s.model.config, total_steps))


def compile_only(s: Setup) -> int:
    """--compile-only: build the step's parts, compile the training step on one generated micro-batch,
    print the time, exit 0."""
    cfg, device = s.cfg, s.device
    strategy, optimizer, scaler, _ = _step_parts(s)
    log.banner("Compiling model")
    scheduler = build_lr_schedule(optimizer, "constant", 1, 0)
    run = Run(cfg, strategy, optimizer, scheduler, scaler, device, s.precision, 1)
    gen = torch.Generator().manual_seed(42)
    shape = (cfg.parallel.batch_size, cfg.arch.max_len + 1)
    batch = torch.randint(1, strategy.model.config.vocab_size, shape, generator=gen)
    t0 = time.perf_counter()
    train_step(run, [batch.to(device)])
    synchronize(device)
    log.info(f"Compiled/Loaded model in {time.perf_counter() - t0:.2f} secs")
    log.info("Model successfully compiled. Exiting now as '--compile-only' argument was passed.")
    return 0


def _step_parts(s: Setup) -> tuple[Strategy, torch.optim.Optimizer, LossScaler, object]:
    """(strategy, optimizer, loss scaler, K-FAC preconditioner or None) of the run, the memory features
    applied to the model first; the model's size and the pipeline's stage plan are printed."""
    cfg = s.cfg
    torch.manual_seed(cfg.data.seed + s.env.rank)  # same initial weights everywhere, different dropout per replica
    log.info(f"Model config: {s.model.config}")
    log.info(f"Parameters: {s.model.config.num_params() / 1e6:.1f}M, device {s.device}, precision {s.precision}")
    apply_memory_features(s.model, cfg.memory, s.device)
    strategy = _build_strategy(s, offload_to_host(cfg.memory, s.device))
    _print_stage_plan(s)
    optimizer = _build_optimizer(cfg, strategy, s.device, s.precision)
    kfac = build_preconditioner(cfg.kfac, strategy)  # before the data: a layout it refuses stops here
    return strategy, optimizer, build_loss_scaler(cfg.loss_scale, s.precision, cfg.runtime.precision), kfac


def _build_strategy(s: Setup, offload: bool) -> Strategy:
    """The parallel strategy the layout asks for, from the registry (it stages, shards, wraps and
    compiles the model; memory features are applied before)."""
    cfg = s.cfg
    return build_strategy(s.model, ParallelRequest(
        device=s.device, env=s.env, layout=s.layout, zero=s.zero, offload=offload,
        param_dtype=autocast_dtype(s.precision),
        compile_mode="true" if cfg.runtime.compile_only else cfg.runtime.torch_compile,
        compile_cache=cfg.runtime.executable_cache_dir, schedule=cfg.parallel.pipeline_schedule,
        micro_batches=s.accumulation, batch_size=cfg.parallel.batch_size))


def _print_stage_plan(s: Setup) -> None:
    """Rank 0 of a pipelined run prints the stages' balance and memory per process."""
    if not (s.layout.pipelined and s.env.is_main):
        return
    cfg = s.cfg
    plans = build_plan(cfg.parallel, cfg.memory, s.model.config, cfg.arch.max_len, s.device,
                       autocast_dtype(s.precision), s.zero, replicas=s.layout.data_parallel,
                       micro_batches=s.accumulation)
    print_plan(plans, f"Stage balance and memory per process ({cfg.parallel.pipeline_schedule}, {s.accumulation} "
                      f"micro-batches of {cfg.parallel.batch_size} x {cfg.arch.max_len}; GiB):")
    print_compute_balance(s.model.config, s.layout.layers_per_stage, cfg.arch.max_len)


def _build_optimizer(cfg: TrainConfig, strategy: Strategy, device: torch.device, precision: str
                     ) -> torch.optim.Optimizer:
    """The optimizer over what this process trains, placed (offloaded, ZeRO-1 sharded) as the strategy says;
    Muon's Newton-Schulz steps run in bf16 where the run computes in bf16, else in fp32."""
    optim = cfg.optim
    if optim.optimizer == "Muon" and (not strategy.whole_gradients or cfg.kfac.kfac):
        raise UsageError("--optimizer Muon runs on one process or DDP replicas without --kfac: it orthogonalizes "
                         "whole matrices (not pipeline stages', tensor-parallel or FSDP2 shards) and K-FAC would "
                         "precondition what it orthogonalizes; use --optimizer AdamW for this run")
    placement = strategy.optimizer_placement()
    return build_optimizer(placement.module, optim.optimizer, optim.learning_rate, optim.weight_decay,
                           betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
                           device_type=device.type, offload=placement.offload, shard=placement.shard,
                           shard_group=placement.shard_group, host_update=placement.host_update,
                           muon_lr=optim.muon_learning_rate, muon_momentum=optim.muon_momentum,
                           muon_dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
