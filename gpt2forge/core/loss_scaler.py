"""fp16 loss scaling: its flags (`LossScaleArgs`, a section of the run's configuration), the scaler
(`LossScaler`, static or dynamic) and the run's (`build_loss_scaler`)."""

from __future__ import annotations

import dataclasses

import torch

from gpt2forge.core.errors import collect
from gpt2forge.core.flags import flag, opt, positive


@dataclasses.dataclass
class LossScaleArgs:
    """Fp16 loss scaling: static, or dynamic as Megatron's."""

    loss_scaling: float = opt(50000.0)
    """Fp16: static loss scale (initial scale with --auto-loss-scaling)"""
    auto_loss_scaling: bool = opt(False, kind="bool")
    """Fp16: dynamic loss scaling."""
    initial_loss_scale: float = opt(1.0)
    """fp16 dynamic scaling: the first scale (Megatron's --initial-loss-scale; 1.0 as the reference's
    --auto-loss-scaling)"""
    loss_scale_window: int = opt(2000)
    """fp16 dynamic scaling: clean updates before the scale doubles (Megatron's --loss-scale-window)"""
    min_loss_scale: float = opt(1.0)
    """fp16 dynamic scaling: the scale never goes below this (Megatron's --min-loss-scale)"""
    loss_scale_hysteresis: int = opt(1)
    """fp16 dynamic scaling: overflowing updates tolerated before the scale halves (Megatron's --hysteresis)"""

    def __post_init__(self) -> None:
        problems = positive(self, "loss_scale_window", "loss_scale_hysteresis")
        problems += [f"--{flag(name)} must be > 0" for name in ("loss_scaling", "initial_loss_scale", "min_loss_scale")
                     if getattr(self, name) <= 0]
        collect(problems)


class LossScaler:
    """fp16 loss scaling: static (--loss-scaling S) or dynamic (--auto-loss-scaling): Megatron-Core's
    DynamicGradScaler rule, halve after `hysteresis` overflowing updates (never below `min_scale`),
    double after `growth_interval` clean updates in a row (which also restores the hysteresis count).
    Overflowing updates are skipped. For fp32/bf16 it is disabled: scale 1, nothing skipped."""

    def __init__(self, enabled: bool, init_scale: float, dynamic: bool, growth_interval: int = 2000,
                 min_scale: float = 1.0, hysteresis: int = 1):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.dynamic = dynamic and enabled
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.hysteresis_left = hysteresis
        self.good_steps = 0
        self.skipped = 0

    @property
    def can_lower(self) -> bool:
        """Whether an overflow is the scaler's own signal: dynamic scaling above `min_scale` still has a
        lower scale to try (Megatron turns its NaN check off then: the NaNs are the scaler's input)."""
        return self.dynamic and self.scale > self.min_scale

    def unscale_and_check(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale; return True when all are finite (the update may proceed)."""
        if not self.enabled:
            return True
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = torch.zeros(1, device=grads[0].device)
        inv = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        return not bool(found_inf.item())

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.dynamic and self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.growth_interval == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
        self.hysteresis_left = state.get("hysteresis_left", self.hysteresis)  # absent before it existed


AUTO_FP16_INITIAL_SCALE = 2.0**16
"""The first loss scale where --precision auto chose fp16: torch.amp.GradScaler's (the reference's
--auto-loss-scaling starts at 1.0, which leaves small fp16 gradients to underflow for the thousands
of updates the scale takes to grow)."""


def build_loss_scaler(args: LossScaleArgs, precision: str, asked: str) -> LossScaler:
    """The run's LossScaler from its loss-scale flags, its resolved `precision` and the --precision it
    `asked` for: enabled for fp16 only; dynamic from --initial-loss-scale with --auto-loss-scaling, else
    static at --loss-scaling, except where --precision auto chose fp16 (a GPU without native bf16),
    which is dynamic from AUTO_FP16_INITIAL_SCALE: a run that did not ask for fp16 gets a scale that
    follows its gradients."""
    auto_fp16 = precision == "fp16" and asked == "auto"
    if args.auto_loss_scaling:
        init = args.initial_loss_scale
    else:
        init = AUTO_FP16_INITIAL_SCALE if auto_fp16 else args.loss_scaling
    return LossScaler(precision == "fp16", init, args.auto_loss_scaling or auto_fp16, args.loss_scale_window,
                      args.min_loss_scale, args.loss_scale_hysteresis)
