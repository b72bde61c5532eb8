"""What a training run reports besides its step lines: the metrics file (written by every run), a
progress bar with ETA, TensorBoard, W&B and the PyTorch profiler.

The trainer talks to one `RunMonitor` through three calls (`step`, `validation`, `close`), each
taking a flat dict of numbers, so a new sink never touches the training loop. Only rank 0 writes.

Where things go:
  metrics file  --metrics-file, else <--checkpoint-output-dir>/metrics.jsonl, else
                runs/<run name>_<timestamp>/metrics.jsonl (runs/ = $GPT2FORGE_RUNS_DIR when set); one
                JSON object per line, {"kind": "train" | "validation", "step": ..., "tokens": ..., ...};
                a fresh run starts the file, a resumed run appends to it (re-done steps appear
                twice: `gpt2forge.tools.plot` keeps the last record of a step)
  profile       --profile-dir, else $GPT2FORGE_PROFILE_DIR, else profile/ beside the metrics file;
                steps from --profile-steps, else $GPT2FORGE_PROFILE_STEPS (the benchmark runner's
                --profile sets both)
  progress bar  tqdm on stderr with ETA, only when stderr is a terminal (TQDM_DISABLE=1 turns it off)
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.metrics.profiler import (
    PROFILE_DIR_ENV,
    PROFILE_STEPS_ENV,
    StepProfiler,
    parse_profile_steps,
)

RUNS_DIR_ENV = "GPT2FORGE_RUNS_DIR"  # replaces ./runs (the benchmark runner points it into its log folder)
_COUNTERS = ("step", "epoch", "tokens")  # axes, not metrics


def run_name(cfg: TrainConfig, model_config) -> str:
    """The reference's W&B run name: `{model}_{vocab}_sl{max_len}_gbs{global batch}` (the model is the
    --model-config file's stem when one is given)."""
    model = Path(cfg.arch.model_config).stem if cfg.arch.model_config else cfg.arch.model
    return f"{model}_{model_config.vocab_size}_sl{cfg.arch.max_len}_gbs{cfg.samples_per_update}"


def metrics_path(cfg: TrainConfig, name: str) -> Path:
    """Where this run's metrics file goes (see the module docstring)."""
    if cfg.logging.metrics_file:
        return Path(cfg.logging.metrics_file)
    if cfg.checkpoint.checkpoint_output_dir:
        return Path(cfg.checkpoint.checkpoint_output_dir) / "metrics.jsonl"
    runs = Path(os.environ.get(RUNS_DIR_ENV) or "runs")
    return runs / f"{name}_{time.strftime('%Y%m%d-%H%M%S')}" / "metrics.jsonl"


def numeric_mfu(value: Any) -> float | None:
    """MFU as a fraction: numbers pass through, the step line's text ("12.3%", "~97.0%" when
    uncertain) is converted, "unknown" (no device peak) becomes None."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.endswith("%"):
        return float(value.removeprefix("~")[:-1]) / 100.0
    return None


class RunMonitor:
    """Sinks for one run's metrics. Records are flat dicts of numbers keyed by metric name;
    every record carries `step` (host steps done) and `tokens` (training tokens seen)."""

    def __init__(self, cfg: TrainConfig, model_config, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.enabled = log.rank() == 0
        self._metrics = self._wandb = self._tensorboard = self._profiler = None
        self._bar = _ProgressBar(total_steps)
        if not self.enabled:
            return
        name = run_name(cfg, model_config)
        path = metrics_path(cfg, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A resumed run continues its file; a fresh one starts it anew (not mixed with an earlier run's).
        self._metrics = path.open("a" if cfg.checkpoint.resume_training_from_checkpoint else "w", encoding="utf-8")
        log.info(f"Metrics file: {path} (plot: python -m gpt2forge.tools.plot {path} --out DIR)")
        logging = cfg.logging
        steps = logging.profile_steps or os.environ.get(PROFILE_STEPS_ENV)
        if steps:
            source = "--profile-steps" if logging.profile_steps else PROFILE_STEPS_ENV
            first, last = parse_profile_steps(steps, source)
            out = logging.profile_dir or os.environ.get(PROFILE_DIR_ENV) or path.parent / "profile"
            self._profiler = StepProfiler(first, last, Path(out))
        if logging.tensorboard_dir:
            self._tensorboard = _init_tensorboard(logging.tensorboard_dir)
        if logging.use_wandb:
            self._wandb = _init_wandb(cfg, name)

    def step(self, record: dict[str, Any]) -> None:
        """After every host step: step, epoch, tokens, loss, acc, lr, samples_per_sec, tokens_per_sec,
        mfu (a fraction, or the step line's "12.3%" text), peak_memory_gib, ... (grad_norm when known)."""
        if not self.enabled:
            return
        record = dict(record)
        if "mfu" in record:
            record["mfu"] = numeric_mfu(record["mfu"])
        self._write("train", record)
        self._bar.update(record)
        if self._profiler is not None:
            self._profiler.after_step(record["step"])
        if self._tensorboard is not None:
            _scalars(self._tensorboard, "train", record)
        if self._wandb is not None:
            main = {"Loss": record["loss"], "Acc": record["acc"], "LR": record["lr"], "Step": record["step"],
                    "Epoch": record["epoch"] + 1, "Throughput": record["samples_per_sec"]}
            extra = {k: v for k, v in record.items() if _is_number(v) and k not in _COUNTERS
                     and k not in ("loss", "acc", "lr", "samples_per_sec")}
            self._wandb.log({**main, **extra})

    def validation(self, record: dict[str, Any]) -> None:
        """After an evaluation: val_loss, val_perplexity (and zero-shot figures when asked)."""
        if not self.enabled:
            return
        self._write("validation", record)
        if self._tensorboard is not None:
            _scalars(self._tensorboard, "validation", {k.removeprefix("val_"): v for k, v in record.items()})
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if _is_number(v)})

    def close(self) -> None:
        """Flush and close every sink (safe to call twice; the trainer calls it in `finally`)."""
        self._bar.close()
        if self._profiler is not None:
            self._profiler.close()
            self._profiler = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _write(self, kind: str, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._metrics.write(json.dumps({"kind": kind, **clean}) + "\n")
            self._metrics.flush()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- progress bar --------------------------------------------------------------------------------

class _ProgressBar:
    """tqdm over host steps with ETA, on stderr, off when stderr is not a terminal. While it shows,
    prints to a terminal go through tqdm.write so step lines do not tear the bar."""

    def __init__(self, total: int):
        self.total = total
        self.bar = None
        self._saved: tuple[Any, Any] | None = None

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            from tqdm import tqdm

            # Created at the first step so a resumed run starts the bar (and its ETA) where it is.
            self.bar = tqdm(total=self.total, initial=record["step"] - 1, unit="step", desc="training",
                            file=sys.stderr, dynamic_ncols=True, disable=None)
            if not self.bar.disable and sys.stdout.isatty():
                self._saved = (sys.stdout, sys.stderr)
                sys.stdout, sys.stderr = _AroundBar(sys.stdout, self.bar), _AroundBar(sys.stderr, self.bar)
        if self.bar.disable:
            return
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_sec']:.0f}", refresh=False)
        self.bar.update(record["step"] - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            if self._saved is not None:
                sys.stdout, sys.stderr = self._saved
                self._saved = None
            self.bar.close()
            self.bar = None


class _AroundBar:
    """A text stream that writes whole lines with the bar lifted (cleared, then redrawn below them)."""

    def __init__(self, stream, bar):
        self._stream, self._bar, self._pending = stream, bar, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            with self._bar.external_write_mode(file=self._bar.fp):
                self._stream.write(lines + "\n")
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


# -- TensorBoard ---------------------------------------------------------------------------------

def _init_tensorboard(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard-dir needs the tensorboard package: .venv/bin/pip install -r "
                         "requirements.txt") from None
    return SummaryWriter(log_dir=directory)


def _scalars(writer, group: str, record: dict[str, Any]) -> None:
    """Every number of the record as `<group>/<name>` at x = host step (tokens are a scalar too)."""
    step = int(record["step"])
    for key, value in record.items():
        if key not in ("step", "epoch") and _is_number(value):
            writer.add_scalar(f"{group}/{key}", value, step)
    writer.flush()


# -- Weights & Biases ----------------------------------------------------------------------------

def wandb_offline_reason() -> str | None:
    """Why W&B must run offline here (no API key, or its server unreachable); None to go online.
    An explicit WANDB_MODE is always respected (None)."""
    if os.environ.get("WANDB_MODE"):
        return None
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    host = urlparse(base).hostname or "api.wandb.ai"
    if not os.environ.get("WANDB_API_KEY") and not _netrc_has(host):
        return "no API key (set WANDB_API_KEY or run `wandb login`)"
    try:
        socket.create_connection((host, urlparse(base).port or 443), timeout=3).close()
    except OSError:
        return f"{host} is unreachable"
    return None


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _init_wandb(cfg: TrainConfig, name: str):
    try:
        import wandb
    except ImportError:
        raise UsageError("--use-wandb needs the wandb package: .venv/bin/pip install wandb") from None
    reason = wandb_offline_reason()
    if reason:
        os.environ["WANDB_MODE"] = "offline"
        log.notice(f"W&B runs offline: {reason}; upload later with `wandb sync`")
    wandb.init(project="torch-gpt2", name=name, config=cfg.to_dict())
    return wandb
