"""The step and validation lines, in the reference's layout or Megatron-LM's (`--log-format`).

Users' log parsers key on these lines, so each layout is kept to the character: the Graphcore
reference's `step S of epoch E, loss: ...` (with this project's additions at the end), and
Megatron-LM's `training_log` / `evaluate_and_print_results` lines (megatron/training/training.py):

     [2026-11-24 19:40:12] iteration       10/     100 | consumed samples:           80 | elapsed time per
    iteration (ms): 512.3 | learning rate: 1.500000E-04 | global batch size:     8 | lm loss: 7.123456E+00 |
    loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |

and the validation result between two rules of dashes:
    ` validation loss at iteration 100 | lm loss value: 6.123456E+00 | lm loss PPL: 4.563210E+02 | `
"""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepReport:
    """One host step as the step line and the monitors (metrics file, TensorBoard, W&B) report it."""

    step: int
    """Host steps done, counting from 1 (Megatron's iteration)."""
    total_steps: int
    index_in_epoch: int
    """The step's 0-based index in its epoch (the reference's `step S of epoch E`)."""
    epoch: int
    """The step's 0-based epoch."""
    loss: float
    acc: float
    lr: float
    """The learning rate of `--learning-rate`'s parameter groups at this update."""
    muon_lr: float | None = None
    """With `--optimizer Muon`, the learning rate of its matrices at this update (else None)."""
    samples_per_s: float
    tokens_per_s: float
    mfu: float | None
    """Model FLOPs utilisation as a fraction (0.123 = 12.3%), None when the device's peak FLOP/s is
    unknown; the step line prints it with `mfu_text`."""
    mfu_uncertain: bool
    """A step beat the peak FLOP/s (see `peak_flops.StepMeter`): the step line marks the MFU `~`."""
    peak_memory_gib: float
    data_wait_pct: float
    grad_norm: float
    seconds_per_step: float
    """The step's wall time."""
    consumed_samples: int
    consumed_tokens: int
    global_batch: int
    loss_scale: float
    skipped: int
    """Updates skipped so far (non-finite gradients)."""
    processes: int
    """Processes of the job (tokens/s per process)."""
    epoch_done: bool
    """The step ended its epoch."""
    last: bool
    """The step is the run's last."""
    blend: str = ""
    """The realized blend shares (` | shares ...`), or empty."""
    mfu_of_read: float | None = None
    """On a GPU, MFU against the matmul peak read at start-up (`peak_flops.in_run_peak_flops`), beside
    `mfu`, which is against the data sheet; None on a CPU (its peak is a read already)."""
    peak_flops_read: float | None = None
    """The job's peak FLOP/s read at start-up (None with `mfu_of_read`)."""

    def record(self) -> dict[str, float | int | None]:
        """The step's metrics record (the keys of the metrics file's "train" lines)."""
        record = {"step": self.step, "epoch": self.epoch, "tokens": self.consumed_tokens, "loss": self.loss,
                  "acc": self.acc, "lr": self.lr, "grad_norm": self.grad_norm, "loss_scale": self.loss_scale,
                  "samples_per_sec": self.samples_per_s, "tokens_per_sec": self.tokens_per_s,
                  "tokens_per_sec_per_process": self.tokens_per_s / self.processes, "mfu": self.mfu,
                  "peak_memory_gib": self.peak_memory_gib, "data_wait_pct": self.data_wait_pct,
                  "step_seconds": self.seconds_per_step}
        if self.muon_lr is not None:
            record["muon_lr"] = self.muon_lr
        if self.mfu_of_read is not None:
            record["mfu_of_read"] = self.mfu_of_read
        return record


def step_line(fmt: str, r: StepReport) -> str:
    if fmt == "megatron":
        return megatron_step_line(r)
    muon = "" if r.muon_lr is None else f"muon lr: {r.muon_lr:.6g}, "
    return (f"step {r.index_in_epoch} of epoch {r.epoch}, loss: {r.loss:.4f}, acc: {r.acc:.4f}, lr: {r.lr:.6g}, "
            f"{muon}throughput: {r.samples_per_s:.2f} samples/sec, tokens/s: {r.tokens_per_s:.1f}, "
            f"MFU: {mfu_text(r.mfu, r.mfu_uncertain)}, "
            f"{_read_mfu(r)}peak memory: {r.peak_memory_gib:.2f} GiB, data wait: {r.data_wait_pct:.1f}%, "
            f"grad norm: {r.grad_norm:.4g}{r.blend}")


def mfu_text(mfu: float | None, uncertain: bool) -> str:
    """MFU as the step line prints it: "12.3%", "~97.0%" when `uncertain`, or "unknown" (None)."""
    if mfu is None:
        return "unknown"
    return f"{'~' if uncertain else ''}{100.0 * mfu:.1f}%"


def _read_mfu(r: StepReport) -> str:
    """`MFU of the peak read here: <x>% of <read> TFLOP/s, ` on a GPU (after the data sheet's MFU), else empty."""
    if r.mfu_of_read is None or r.peak_flops_read is None:
        return ""
    return f"MFU of the peak read here: {100 * r.mfu_of_read:.1f}% of {r.peak_flops_read / 1e12:.1f} TFLOP/s, "


def megatron_step_line(r: StepReport, now: datetime | None = None) -> str:
    stamp = (now or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    nan = 0 if math.isfinite(r.loss) else 1
    return (f" [{stamp}] iteration {r.step:8d}/{r.total_steps:8d} | consumed samples: {r.consumed_samples:12d} | "
            f"elapsed time per iteration (ms): {r.seconds_per_step * 1000.0:.1f} | learning rate: {r.lr:.6E} | "
            f"global batch size: {r.global_batch:5d} | lm loss: {r.loss:.6E} | loss scale: {r.loss_scale:.1f} | "
            f"grad norm: {r.grad_norm:.3f} | number of skipped iterations: {r.skipped:3d} | "
            f"number of nan iterations: {nan:3d} |")


def validation_lines(fmt: str, step: int, loss: float, perplexity: float, tokens: int, split: str = "validation",
                     epoch: int = 0) -> list[str]:
    """The lines of one validation (or test: split="test") result; `epoch`: 0-based, of the last step."""
    if fmt == "run_clm" and split == "validation":  # transformers' run_clm_no_trainer.py, after each epoch
        try:
            perplexity = math.exp(loss)
        except OverflowError:
            perplexity = float("inf")
        return [f"epoch {epoch}: perplexity: {perplexity} eval_loss: {loss}"]
    if fmt != "megatron":
        return [f"{split} after step {step}: loss {loss:.4f}, perplexity {perplexity:.2f}, tokens {tokens}"]
    where = f"iteration {step}" if split == "validation" else f"iteration {step} on {split} set"  # Megatron's prefix
    text = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
    rule = "-" * (len(text) + 1)
    return [rule, text, rule]
