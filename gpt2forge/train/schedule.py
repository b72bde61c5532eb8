"""Learning-rate schedules (reference section 5.3), with Megatron's floor and sample-based lengths.

The schedule is a multiplier of the peak LR (`--learning-rate`) per optimizer update, stepped once
after every applied update, so the first update runs at the update-0 multiplier; an update skipped for
non-finite gradients holds the LR (Megatron-LM's and accelerate's rule). The warm-up's form
(`--lr-warmup-form`) decides that first multiplier: nanoGPT's (the default) gives update u (from 0)
(u + 1) / (W + 1) of the peak, transformers' (the reference's; the Megatron, DeepSpeed and run_clm
front ends choose it, as their tools do) u / W, so its first update runs at LR 0.

Lengths are counted in optimizer updates (`--lr-decay-steps`, `--lr-warmup-steps`, `--lr-warmup`)
unless any of `--train-samples`, `--lr-decay-samples`, `--lr-warmup-samples` is given: the
schedule then counts samples, as Megatron-LM's `OptimizerParamScheduler` does (it advances by the
global batch after every update, so update u sits at sample u x samples-per-update, and lengths
that are not whole updates are kept exact). `--lr-decay-steps`/`--lr-warmup-steps` given alongside
count updates of samples-per-update samples; the decay defaults to `--train-samples` (Megatron's
default), else the whole run.

`--min-lr` is the floor of linear and cosine decay (Megatron's and nanoGPT's): the multiplier is
`floor + (1 - floor) * coeff` with floor = min_lr / learning_rate, and after the decay the LR holds
the floor. With the default `--min-lr 0` the values are transformers' `get_*_schedule_with_warmup`
(whose cosine rises again past the decay length; runs of earlier versions are unchanged).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.train.config import WARMUP_FORMS, OptimizerArgs

SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class ScheduleLength:
    """Warm-up and decay lengths of a schedule; one optimizer update advances `per_update` counts."""

    decay: int
    """Schedule length (updates, or samples when per_update > 1 or lengths are given in samples)."""
    warmup: int
    """Warm-up length, same unit as `decay`, in [0, decay]."""
    per_update: int = 1
    """Counts per optimizer update: 1 for update-based lengths, the global batch for sample-based."""
    unit: str = "updates"
    """`updates` or `samples`, for messages."""


def resolve_warmup_steps(total_steps: int, warmup_fraction: float, warmup_steps: int | None) -> int:
    """Number of warm-up updates: `--lr-warmup-steps` if given, else `int(--lr-warmup * total)`.

    Args:
        total_steps: schedule length in optimizer updates (`--lr-decay-steps` or its default).
        warmup_fraction: `--lr-warmup`, a fraction in [0, 1].
        warmup_steps: `--lr-warmup-steps`, in [0, total_steps], or None.

    Raises:
        UsageError: either value out of range.
    """
    if not 0.0 <= warmup_fraction <= 1.0:
        raise UsageError(f"--lr-warmup {warmup_fraction} is not a fraction; pass a value in [0, 1]")
    if warmup_steps is None:
        return int(warmup_fraction * total_steps)
    if not 0 <= warmup_steps <= total_steps:
        raise UsageError(
            f"--lr-warmup-steps {warmup_steps} is outside [0, {total_steps}] (the schedule length); "
            "pass a smaller value or raise --lr-decay-steps"
        )
    return int(warmup_steps)


def schedule_length(optim: OptimizerArgs, total_updates: int, samples_per_update: int) -> ScheduleLength:
    """The schedule's lengths from the flags (see the module docstring for the units).

    Args:
        optim: the run's optimizer flags.
        total_updates: optimizer updates the run makes.
        samples_per_update: global batch in sequences (micro-batch x accumulation x replicas).

    Raises:
        UsageError: a warm-up longer than the schedule, or a warm-up fraction outside [0, 1].
    """
    if optim.train_samples is None and optim.lr_decay_samples is None and optim.lr_warmup_samples is None:
        decay = optim.lr_decay_steps or total_updates
        return ScheduleLength(decay, resolve_warmup_steps(decay, optim.lr_warmup, optim.lr_warmup_steps))
    if not 0.0 <= optim.lr_warmup <= 1.0:
        raise UsageError(f"--lr-warmup {optim.lr_warmup} is not a fraction; pass a value in [0, 1]")
    n = samples_per_update
    if optim.lr_decay_samples is not None:
        decay, decay_flag = optim.lr_decay_samples, f"--lr-decay-samples {optim.lr_decay_samples}"
    elif optim.lr_decay_steps is not None:
        decay, decay_flag = optim.lr_decay_steps * n, f"--lr-decay-steps {optim.lr_decay_steps}"
    else:
        decay = optim.train_samples or total_updates * n
        decay_flag = "the run's length"
    if optim.lr_warmup_samples is not None:
        warmup, warmup_flag = optim.lr_warmup_samples, f"--lr-warmup-samples {optim.lr_warmup_samples}"
    elif optim.lr_warmup_steps is not None:
        warmup, warmup_flag = optim.lr_warmup_steps * n, f"--lr-warmup-steps {optim.lr_warmup_steps}"
    else:
        warmup, warmup_flag = int(optim.lr_warmup * decay), f"--lr-warmup {optim.lr_warmup}"
    if warmup > decay:
        raise UsageError(f"{warmup_flag} ({warmup} samples) is longer than the schedule ({decay} samples, from "
                         f"{decay_flag}); pass a shorter warm-up or a longer decay")
    return ScheduleLength(decay, warmup, per_update=n, unit="samples")


def _lr_multiplier(step: int, *, schedule: str, warmup: int, total: int, floor: float = 0.0,
                   per_update: int = 1, warmup_offset: int = 0) -> float:
    """Peak-LR multiplier for 0-based update `step` (formulas in `build_lr_schedule`)."""
    pos = step * per_update  # where the update sits in the schedule's unit
    if pos < warmup:
        shift = warmup_offset * per_update
        return float(pos + shift) / float(max(1, warmup + shift))
    if schedule == "constant":
        return 1.0
    if floor and pos >= total:  # Megatron and nanoGPT hold the floor after the decay
        return floor
    if schedule == "linear":
        coeff = max(0.0, float(total - pos) / float(max(1, total - warmup)))
    else:  # cosine: half a cosine period from 1 down to 0 over the decay phase (num_cycles = 0.5).
        progress = float(pos - warmup) / float(max(1, total - warmup))
        coeff = max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress)))
    return coeff if not floor else floor + (1.0 - floor) * coeff


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, schedule: str, total_steps: int, warmup_steps: int,
    min_lr_ratio: float = 0.0, per_update: int = 1, warmup_form: str = "transformers",
) -> torch.optim.lr_scheduler.LambdaLR:
    """LR schedule for `--lr-schedule`; call `scheduler.step()` once after every update.

    Multiplier of the peak LR at 0-based update u, at position p = u * per_update in the schedule
    (W = warmup_steps, N = total_steps, f = min_lr_ratio, o = 1 for warmup_form nanogpt, else 0):
        warm-up (all schedules), p < W:  (p + o * per_update) / max(1, W + o * per_update)
        constant:  1                                   (the reference ignored warm-up: fixed)
        linear:    f + (1 - f) * max(0, (N - p) / max(1, N - W))
        cosine:    f + (1 - f) * max(0, 0.5 * (1 + cos(pi * r))),  r = (p - W) / max(1, N - W)
        with f > 0, p >= N (linear, cosine):  f
    With f = 0, per_update 1 and warmup_form transformers these equal transformers'
    get_{constant,linear,cosine}_schedule_with_warmup; with f = min_lr / lr and per_update = the global
    batch, Megatron's sample-based schedule; with warmup_form nanogpt and cosine, nanoGPT's get_lr.

    Raises:
        UsageError: unknown schedule (`--lr-schedule`), total_steps < 1 (`--lr-decay-steps`),
            warmup_steps outside [0, total_steps] (`--lr-warmup-steps`), min_lr_ratio outside [0, 1],
            unknown warmup_form (`--lr-warmup-form`).
    """
    if warmup_form not in WARMUP_FORMS:
        raise UsageError(f"--lr-warmup-form {warmup_form} is not one of {', '.join(WARMUP_FORMS)}")
    if schedule not in SCHEDULES:
        raise UsageError(f"--lr-schedule {schedule} is not supported; choose one of {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise UsageError(f"--lr-decay-steps {total_steps} must be >= 1; pass a positive number of updates")
    if not 0 <= warmup_steps <= total_steps:
        raise UsageError(
            f"--lr-warmup-steps {warmup_steps} is outside [0, {total_steps}]; pass a value in that range"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise UsageError(f"--min-lr is {min_lr_ratio} x --learning-rate; pass a value in [0, --learning-rate]")
    # A partial (not a lambda) so LambdaLR.state_dict() can record it.
    fn = functools.partial(_lr_multiplier, schedule=schedule, warmup=warmup_steps, total=total_steps,
                           floor=float(min_lr_ratio), per_update=int(per_update),
                           warmup_offset=int(warmup_form == "nanogpt"))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def build_run_schedule(optimizer: torch.optim.Optimizer, optim: OptimizerArgs, total_updates: int,
                       samples_per_update: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The training run's schedule from its flags (lengths by `schedule_length`, floor `--min-lr`),
    described in one log line."""
    length = schedule_length(optim, total_updates, samples_per_update)
    floor = optim.min_lr / optim.learning_rate if optim.learning_rate > 0 else 0.0
    if optim.learning_rate == 0:  # a silent no-op fine-tune (nanoGPT#161) is at least named
        log.notice("--learning-rate 0: no update will change the weights")
    if optim.lr_schedule != "constant":
        muon = ""
        if optim.optimizer == "Muon" and optim.muon_learning_rate not in (None, optim.learning_rate):
            muon = f" (Muon's matrices: from {optim.muon_learning_rate:g} to {optim.muon_learning_rate * floor:g})"
        log.info(f"LR schedule: {optim.lr_schedule} from {optim.learning_rate:g} to {optim.min_lr:g}{muon} over "
                 f"{length.decay} {length.unit}, warm-up {length.warmup} {length.unit} "
                 f"in {optim.lr_warmup_form}'s form")
    elif optim.min_lr:
        log.notice("--min-lr has no effect with --lr-schedule constant")
    return build_lr_schedule(optimizer, optim.lr_schedule, length.decay, length.warmup, floor, length.per_update,
                             optim.lr_warmup_form)
