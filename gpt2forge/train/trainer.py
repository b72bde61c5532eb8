"""The training loop: an orchestrator around `step.train_step`.

Units: a *micro-batch* is --batch-size sequences; an *update* is one optimizer step over
--gradient-accumulation micro-batches (per replica); a *host step* is --device-iterations updates
and is what the step line, --save-per-steps, --training-steps and --log-steps count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from gpt2forge.core import log
from gpt2forge.core.device import synchronize
from gpt2forge.generate.generator import print_sample
from gpt2forge.parallel.distributed import shutdown
from gpt2forge.parallel.health import wait_for_rank0
from gpt2forge.train.batches import blend_shares, epoch_updates
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.memory_features import peak_memory_bytes, reset_peak_memory
from gpt2forge.train.metrics.lines import StepReport, step_line, validation_lines
from gpt2forge.train.optim import scheduled_lrs
from gpt2forge.train.setup import (
    Loop,
    Setup,
    build_loop,
    compile_only,
    plan_memory,
    set_up,
    start_process,
    training_modes,
)
from gpt2forge.train.signals import ExitRequested, agreed_signal, exit_notice
from gpt2forge.train.state import Progress, checkpoint_name, export_final, save, whole_model
from gpt2forge.train.step import Run, evaluate, failures_named, train_step, validation_subset


def run_training(cfg: TrainConfig) -> int:
    """Set everything up from `cfg`, train, evaluate, save; returns the exit code."""
    cfg, env, device, precision = start_process(cfg)
    if cfg.runtime.plan:
        return plan_memory(cfg, device, precision)
    setup = set_up(cfg, env, device, precision)
    try:
        with training_modes(cfg, device):
            return _train(setup)
    except ExitRequested as stopped:
        log.info(str(stopped))
        return 0
    finally:
        shutdown()


def _train(s: Setup) -> int:
    """Build the step, load the data, train; then the test split, the final model and the sample."""
    cfg = s.cfg
    if cfg.runtime.compile_only:
        return compile_only(s)
    loop = build_loop(s)
    try:
        with failures_named(loop.run, lambda: loop.progress.step + 1):
            last_val = _loop(loop)
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


def _paused(run: Run):
    """Suspend the hang watchdog (evaluation, sampling, checkpoints: phases with their own pace)."""
    return run.watchdog.paused() if run.watchdog is not None else contextlib.nullcontext()


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
    samples_s, tokens_s, _ = loop.meter.rates(step_s)  # raises the peak where the step beat it
    peak_memory_gib = peak_memory_bytes(run.device) / 2**30
    reset_peak_memory(run.device)
    epoch = progress.epoch
    epoch_done = _advance(progress, loop.steps_per_epoch)
    consumed = progress.step * cfg.samples_per_step
    lr, muon_lr = scheduled_lrs(run.optimizer)
    return StepReport(
        step=progress.step, total_steps=loop.total_steps, index_in_epoch=index_in_epoch, epoch=epoch,
        loss=loss_sum / max(tokens, 1), acc=correct / max(tokens, 1), lr=lr, muon_lr=muon_lr,
        samples_per_s=samples_s, tokens_per_s=tokens_s, mfu=loop.meter.mfu(tokens_s),
        mfu_uncertain=loop.meter.last_uncertain,
        peak_memory_gib=peak_memory_gib, data_wait_pct=100 * data_wait / step_s, grad_norm=run.grad_norm,
        seconds_per_step=step_s, consumed_samples=consumed, consumed_tokens=progress.step * cfg.tokens_per_step,
        global_batch=cfg.samples_per_step, loss_scale=run.scaler.scale, skipped=run.skipped_updates,
        processes=run.dist_env.world_size, epoch_done=epoch_done, last=progress.step >= loop.total_steps,
        blend=blend_shares(loop.data.train, consumed), mfu_of_read=loop.meter.read_mfu(tokens_s),
        peak_flops_read=loop.meter.peak_flops_read), t_end


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
            loop.last_val = _evaluate(loop, report.epoch) or loop.last_val
        name = checkpoint_name(cfg.checkpoint, progress, report.epoch_done, report.last, stopping=stop is not None)
        if name:
            metrics = {"loss": report.loss, "acc": report.acc}
            if loop.last_val:
                metrics.update(val_loss=loop.last_val[0], val_perplexity=loop.last_val[1])
            save(loop.run, progress, name, metrics)
    if stop:
        raise ExitRequested(exit_notice(stop, progress.step, cfg.checkpoint.checkpoint_output_dir, name))
    return report.last or report.epoch_done


def _evaluate(loop: Loop, epoch: int) -> tuple[float, float, int] | None:
    """The validation loss (logged and recorded; None without a validation set), then the quick
    zero-shot figures when asked (rank 0 alone, the other ranks wait). `epoch`: the last step's (0-based)."""
    run, step = loop.run, loop.progress.step
    val = None
    if loop.data.val is not None:
        val = evaluate(run, validation_subset(loop.data.val, run.cfg))
        for line in validation_lines(run.cfg.logging.log_format, step, *val, epoch=epoch):
            log.info(line)
        loop.monitor.validation({"step": step, "tokens": step * run.cfg.tokens_per_step,
                                 "val_loss": val[0], "val_perplexity": val[1]})
    if run.quick_eval is not None:
        if (whole := whole_model(run)) is not None:
            quick = run.quick_eval.run(whole, run.precision)
            log.info(f"zero-shot after step {step}: {run.quick_eval.describe(quick)}")
        wait_for_rank0()
    return val
