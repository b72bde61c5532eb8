"""The training loop: an orchestrator around `step.train_step`.

Units: a *micro-batch* is --batch-size sequences; an *update* is one optimizer step over
--gradient-accumulation micro-batches (per replica); a *host step* is --device-iterations updates
and is what the step line, --save-per-steps, --training-steps and --log-steps count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import RunError, UsageError, naming_gpu_failures
from gpt2forge.core.runtime import (
    LossScaler,
    autocast_dtype,
    build_loss_scaler,
    configure_host_allocator,
    configure_matmul,
    deterministic_algorithms,
    resolve_device,
    resolve_precision,
    synchronize,
)
from gpt2forge.data import DatasetSplit
from gpt2forge.evaluation.quick import QuickEval
from gpt2forge.generate.generator import print_sample
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops.fp_mode import denormals_flushed
from gpt2forge.parallel.distributed import (
    TIMEOUT,
    DistEnv,
    check_world,
    device_for,
    env_from_launcher,
    init_process_group,
    processes_on_this_host,
    requested_zero_stage,
    resolve_zero_stage,
    shutdown,
)
from gpt2forge.parallel.health import Watchdog, collective_failure, wait_for_rank0
from gpt2forge.parallel.memory_plan import (
    build_plan,
    check_offload_fits_host,
    print_compute_balance,
    print_plan,
    run_plan,
)
from gpt2forge.parallel.strategy import ParallelRequest, Strategy, build_strategy
from gpt2forge.parallel.topology import Layout, build_layout, folded_accumulation, report_layout, stages_of
from gpt2forge.train.batches import blend_shares, epoch_updates, load_data
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.kfac import build_preconditioner
from gpt2forge.train.memory_features import apply_memory_features, offload_to_host, peak_memory_bytes, reset_peak_memory
from gpt2forge.train.metrics.lines import StepReport, step_line, validation_lines
from gpt2forge.train.metrics.monitor import RunMonitor
from gpt2forge.train.metrics.peak import StepMeter, device_peak, in_run_peak, peak_reader
from gpt2forge.train.model_setup import build_model, check_step_fits_host, resolve_model_config
from gpt2forge.train.optim import build_lr_schedule, build_optimizer
from gpt2forge.train.schedule import build_run_schedule
from gpt2forge.train.signals import ExitRequested, agreed_signal, exit_notice, exit_signals
from gpt2forge.train.state import (
    Progress,
    apply_auto_resume,
    checkpoint_name,
    export_final,
    resume,
    save,
    whole_model,
)
from gpt2forge.train.step import (
    Run,
    evaluate,
    failure_context,
    memory_fixes,
    train_step,
    validation_subset,
    what_is_kept,
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What `run_training` resolved before training: the process, its device, precision, model and layout."""

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


def run_training(cfg: TrainConfig) -> int:
    """Set everything up from `cfg`, train, evaluate, save; returns the exit code."""
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
    precision = resolve_precision(cfg.runtime.precision, device)
    if cfg.runtime.plan:
        return _plan(cfg, device, precision)
    setup = _set_up(cfg, env, device, precision)
    init_process_group(env, device)
    try:
        # SIGTERM/SIGUSR1: save and stop after a step. On the CPU, denormals flushed to zero: a denormal
        # softmax once made an Intel CPU's steps an order of magnitude slower (gpt2forge.ops.fp_mode).
        with (exit_signals(cfg.checkpoint.exit_signal_handler), denormals_flushed(device),
              deterministic_algorithms(cfg.runtime.deterministic, device)):
            return _train(setup)
    except ExitRequested as stopped:
        log.info(str(stopped))
        return 0
    finally:
        shutdown()


def _plan(cfg: TrainConfig, device: torch.device, precision: str) -> int:
    """--plan: the memory plan of the run, without building the model."""
    model_cfg, _ = resolve_model_config(cfg)
    build_layout(cfg.parallel, model_cfg.n_layer)  # the layout flags must describe this model
    parallel, offload = cfg.parallel, cfg.memory.offload_mode
    zero = requested_zero_stage(parallel.zero_stage, parallel.replicated_tensor_sharding, offload)
    name = Path(cfg.arch.model_config).stem if cfg.arch.model_config else cfg.arch.model
    return run_plan(parallel, cfg.memory, model_cfg, cfg.arch.max_len, device, autocast_dtype(precision), zero, name)


def _set_up(cfg: TrainConfig, env: DistEnv, device: torch.device, precision: str) -> Setup:
    """The ZeRO stage, the host checks, the model and the layout (before the process group)."""
    zero = resolve_zero_stage(cfg.parallel.zero_stage, cfg.parallel.replicated_tensor_sharding, env,
                              cfg.memory.offload_mode)
    shape = resolve_model_config(cfg)  # once: the host check and the model both need it
    check_step_fits_host(cfg)
    if cfg.memory.offload_mode != "none":  # before any allocation
        check_offload_fits_host(cfg.parallel, cfg.memory, shape[0], zero, env.world_size, processes_on_this_host())
    configure_matmul(device, precision, cfg.runtime.enable_half_partials)
    model, ckpt_dir = build_model(cfg, device, shape)
    layout = build_layout(cfg.parallel, model.config.n_layer, env.world_size)
    accumulation = folded_accumulation(layout, cfg.parallel)  # replicas without a process fold into accumulation
    report_layout(layout, cfg.parallel, accumulation, cfg.data.async_dataloader)
    return Setup(cfg, env, device, precision, model, ckpt_dir, layout, accumulation, zero)


def _train(s: Setup) -> int:
    """Build the step, load the data, train; then the test split, the final model and the sample."""
    cfg = s.cfg
    torch.manual_seed(cfg.data.seed + s.env.rank)  # same initial weights everywhere, different dropout per replica
    log.info(f"Model config: {s.model.config}")
    log.info(f"Parameters: {s.model.config.num_params() / 1e6:.1f}M, device {s.device}, precision {s.precision}")
    apply_memory_features(s.model, cfg.memory, s.device)
    strategy = _build_strategy(s, offload_to_host(cfg.memory, s.device))
    _print_stage_plan(s)
    optimizer = _build_optimizer(cfg, strategy, s.device, s.precision)
    kfac = build_preconditioner(cfg.kfac, strategy)  # before the data: a layout it refuses stops here
    scaler = build_loss_scaler(cfg.runtime, s.precision)
    if cfg.runtime.compile_only:
        return _compile_only(cfg, strategy, optimizer, scaler, s.device, s.precision)
    loop = _loop_over_data(s, strategy, optimizer, scaler, kfac)
    try:
        last_val = _loop_naming_lost_nodes(loop)
        _test(loop)
    finally:
        loop.monitor.close()
    with _paused(loop.run):
        if cfg.checkpoint.final_model_dir:
            export_final(loop.run, cfg.checkpoint.final_model_dir, {"perplexity": last_val[1]} if last_val else {})
        if cfg.eval.sample_tokens:
            print_sample(whole_model(loop.run), cfg.data.tokenizer_name_or_path, cfg.eval.sample_prompt,
                         cfg.eval.sample_tokens, cfg.data.seed)
    return 0


def _loop_over_data(s: Setup, strategy: Strategy, optimizer: torch.optim.Optimizer, scaler: LossScaler,
                    kfac) -> Loop:
    """Load the data; the run's length, schedule and `Run`; resume; the meter and the monitor."""
    cfg = s.cfg
    samples_per_step = s.accumulation * cfg.parallel.device_iterations * cfg.parallel.batch_size * \
        strategy.replica.world_size  # = cfg.samples_per_step
    data, steps_per_epoch, total_steps = load_data(cfg, s.model.config.vocab_size, samples_per_step)
    iterations = cfg.parallel.device_iterations
    # Megatron's units: a schedule in samples advances by the global batch (samples per update) per update.
    scheduler = build_run_schedule(optimizer, cfg.optim, total_steps * iterations, samples_per_step // iterations)
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
    peak, read = device_peak(s.device, s.precision), in_run_peak(s.device, s.precision)
    if s.device.type == "cuda":  # tokens/s is the job's: one GPU per process (CPU processes share one peak)
        peak = peak * s.env.world_size if peak else peak
        read = read * s.env.world_size if read else read
    meter = StepMeter(cfg.samples_per_step, cfg.arch.max_len, s.model.config.flops_per_token(cfg.arch.max_len), peak,
                      reread_peak=peak_reader(s.device, s.precision), read_peak=read)
    return Loop(run, data, progress, total_steps, steps_per_epoch, meter, RunMonitor(cfg, s.model.config, total_steps))


def _test(loop: Loop) -> None:
    """The test split, once after training (logged and recorded), when the data has one."""
    if loop.data.test is None:
        return
    with _paused(loop.run):
        test = evaluate(loop.run, loop.data.test)
    step = loop.progress.step
    for line in validation_lines(loop.cfg.logging.log_format, step, *test, split="test"):
        log.info(line)
    loop.monitor.validation({"step": step, "tokens": step * loop.cfg.tokens_per_step,
                             "test_loss": test[0], "test_perplexity": test[1]})


def _loop_naming_lost_nodes(loop: Loop) -> tuple[float, float, int] | None:
    """`_loop`; a collective that fails (a node, its processes or its link lost) ends the run with one
    line naming the node(s) and the timeout (health.collective_failure), not gloo's traceback; so does
    a GPU out of memory or gone (errors.naming_gpu_failures: the step, the memory, the flags that help)."""
    run = loop.run
    try:
        with naming_gpu_failures(run.device, lambda: failure_context(run, loop.progress.step + 1),
                                 memory_fixes(run), what_is_kept(run.cfg)):
            return _loop(loop)
    except RuntimeError as exc:
        watchdog = loop.run.watchdog
        line = collective_failure(exc, TIMEOUT, watchdog.what if watchdog is not None else "")
        if line is None:
            raise
        raise RunError(line) from None


def _paused(run: Run):
    """Suspend the hang watchdog (evaluation, sampling, checkpoints: phases with their own pace)."""
    return run.watchdog.paused() if run.watchdog is not None else contextlib.nullcontext()


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


def _loop(loop: Loop) -> tuple[float, float, int] | None:
    """Train to `loop.total_steps`; returns the last validation result (None without one)."""
    shuffle = loop.cfg.data.dataset != "generated"
    log.banner("Training")
    loop.run.model.train()
    while loop.progress.step < loop.total_steps:
        t_start = time.perf_counter()
        updates = epoch_updates(loop.run, loop.data.train, loop.progress, loop.steps_per_epoch, shuffle)
        for index_in_epoch in range(loop.progress.step_in_epoch, loop.steps_per_epoch):
            report, t_start = _host_step(loop, updates, index_in_epoch, t_start)
            _record(loop, report)
            if _after_step(loop, report):
                break
    return loop.last_val


def _host_step(loop: Loop, updates: Iterator[list[torch.Tensor]], index_in_epoch: int, t_start: float
               ) -> tuple[StepReport, float]:
    """One host step (--device-iterations updates) and what its line reports; advances the progress.
    Returns the report and the step's end time (the next step's start)."""
    run, progress, cfg = loop.run, loop.progress, loop.cfg
    totals = torch.zeros(3, device=run.device)
    data_wait = 0.0  # host seconds blocked on the data loader in this step
    if run.watchdog is not None:
        run.watchdog.kick(f"step {progress.step} (update {progress.updates})")
    for _ in range(cfg.parallel.device_iterations):
        t_wait = time.perf_counter()
        micro_batches = next(updates)
        data_wait += time.perf_counter() - t_wait
        totals += train_step(run, micro_batches)
    progress.updates += cfg.parallel.device_iterations
    loss_sum, correct, tokens = totals.tolist()  # syncs the device
    t_end = synchronize(run.device)
    step_s = t_end - t_start
    samples_s, tokens_s, mfu = loop.meter.rates(step_s)
    peak_gib = peak_memory_bytes(run.device) / 2**30
    reset_peak_memory(run.device)
    epoch = progress.epoch
    epoch_done = _advance(progress, loop.steps_per_epoch)
    consumed = progress.step * cfg.samples_per_step
    return StepReport(
        step=progress.step, total_steps=loop.total_steps, index_in_epoch=index_in_epoch, epoch=epoch,
        loss=loss_sum / max(tokens, 1), acc=correct / max(tokens, 1), lr=run.optimizer.param_groups[0]["lr"],
        samples_per_s=samples_s, tokens_per_s=tokens_s, mfu=mfu, mfu_fraction=loop.meter.mfu(tokens_s),
        peak_memory_gib=peak_gib, data_wait_pct=100 * data_wait / step_s, grad_norm=run.grad_norm,
        seconds_per_step=step_s, consumed_samples=consumed, consumed_tokens=progress.step * cfg.tokens_per_step,
        global_batch=cfg.samples_per_step, loss_scale=run.scaler.scale, skipped=run.skipped_updates,
        processes=run.dist_env.world_size, epoch_done=epoch_done, last=progress.step >= loop.total_steps,
        blend=blend_shares(loop.data.train, consumed), mfu_of_read=loop.meter.read_mfu(tokens_s),
        peak_read=loop.meter.read_peak), t_end


def _advance(progress: Progress, steps_per_epoch: int) -> bool:
    """Count one host step; returns whether it ended the epoch (the next one then starts)."""
    progress.step += 1
    progress.step_in_epoch += 1
    if progress.step_in_epoch < steps_per_epoch:
        return False
    progress.epoch += 1
    progress.step_in_epoch = 0
    return True


def _record(loop: Loop, report: StepReport) -> None:
    """The step line (every --log-steps and the last step) and the step's record for the monitors."""
    if report.step % loop.cfg.logging.log_steps == 0 or report.last:
        log.info(step_line(loop.cfg.logging.log_format, report))
    loop.monitor.step(report.record())
    if report.step == 1:
        loop.run.strategy.report_peak_memory(report.peak_memory_gib)


def _after_step(loop: Loop, report: StepReport) -> bool:
    """Validation, checkpoint and an agreed exit signal after a step; returns whether the epoch (or
    the run) ended with it. Raises ExitRequested when a signal asked the run to stop (after its save)."""
    cfg, progress = loop.cfg, loop.progress
    every = cfg.eval.eval_every_steps
    stop = None if report.last else agreed_signal(loop.run.device)  # an exit signal on any rank (a collective)
    eval_now = not stop and (report.epoch_done or report.last or bool(every and progress.step % every == 0))
    with _paused(loop.run):
        if eval_now:
            loop.last_val = _evaluate(loop.run, loop.data, progress, loop.monitor, report.epoch) or loop.last_val
        name = checkpoint_name(cfg.checkpoint, progress, report.epoch_done, report.last, stopping=stop is not None)
        if name:
            metrics = {"loss": report.loss, "acc": report.acc}
            if loop.last_val:
                metrics.update(val_loss=loop.last_val[0], val_perplexity=loop.last_val[1])
            save(loop.run, progress, name, metrics)
    if stop:
        raise ExitRequested(exit_notice(stop, progress.step, cfg.checkpoint.checkpoint_output_dir, name))
    return report.last or report.epoch_done


def _evaluate(run: Run, data, progress: Progress, monitor: RunMonitor, epoch: int
              ) -> tuple[float, float, int] | None:
    """The validation loss (logged and recorded; None without a validation set), then the quick
    zero-shot figures when asked (rank 0 alone, the other ranks wait). `epoch`: the last step's (0-based)."""
    val = None
    if data.val is not None:
        val = evaluate(run, validation_subset(data.val, run.cfg))
        for line in validation_lines(run.cfg.logging.log_format, progress.step, *val, epoch=epoch):
            log.info(line)
        monitor.validation({"step": progress.step, "tokens": progress.step * run.cfg.tokens_per_step,
                            "val_loss": val[0], "val_perplexity": val[1]})
    if run.quick_eval is not None:
        if (whole := whole_model(run)) is not None:
            quick = run.quick_eval.run(whole, run.precision)
            log.info(f"zero-shot after step {progress.step}: {run.quick_eval.describe(quick)}")
        wait_for_rank0()
    return val


def _compile_only(cfg: TrainConfig, strategy: Strategy, optimizer: torch.optim.Optimizer, scaler: LossScaler,
                  device: torch.device, precision: str) -> int:
    """Compile the training step on one generated micro-batch, print the time, exit 0."""
    log.banner("Compiling model")
    scheduler = build_lr_schedule(optimizer, "constant", 1, 0)
    run = Run(cfg, strategy, optimizer, scheduler, scaler, device, precision, 1)
    gen = torch.Generator().manual_seed(42)
    shape = (cfg.parallel.batch_size, cfg.arch.max_len + 1)
    batch = torch.randint(1, strategy.model.config.vocab_size, shape, generator=gen)
    t0 = time.perf_counter()
    train_step(run, [batch.to(device)])
    synchronize(device)
    log.info(f"Compiled/Loaded model in {time.perf_counter() - t0:.2f} secs")
    log.info("Model successfully compiled. Exiting now as '--compile-only' argument was passed.")
    return 0
