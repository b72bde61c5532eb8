"""What a training run reports besides its step lines: the metrics file, W&B (and, later,
TensorBoard, the progress bar and the profiler).

The trainer talks to one `RunMonitor` through three calls (`step`, `validation`, `close`), each
taking a flat dict of numbers, so a new sink never touches the training loop. Only rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import log
from .errors import UsageError
from .train_config import TrainConfig


class RunMonitor:
    """Sinks for one run's metrics. Records are flat dicts of numbers keyed by metric name;
    every record carries `step` (host steps done) and `tokens` (training tokens seen)."""

    def __init__(self, cfg: TrainConfig, model_config, total_steps: int):
        self.cfg = cfg
        self.total_steps = total_steps
        self.enabled = log.rank() == 0
        self._metrics = None
        self._wandb = None
        if not self.enabled:
            return
        if cfg.checkpoint_output_dir:
            path = Path(cfg.checkpoint_output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics = path.open("a", encoding="utf-8")
        if cfg.use_wandb:
            self._wandb = _init_wandb(cfg, model_config)

    def step(self, record: dict[str, Any]) -> None:
        """After every host step: loss, acc, lr, samples_per_sec, tokens_per_sec, mfu, ..."""
        self._write("train", record)
        if self._wandb is not None:
            self._wandb.log({"Loss": record["loss"], "Acc": record["acc"], "LR": record["lr"],
                             "Step": record["step"], "Epoch": record["epoch"] + 1,
                             "Throughput": record["samples_per_sec"]})

    def validation(self, record: dict[str, Any]) -> None:
        """After an evaluation: val_loss, val_perplexity (and zero-shot figures when asked)."""
        self._write("validation", record)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))})

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _write(self, kind: str, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps({"kind": kind, **record}) + "\n")
            self._metrics.flush()


def _init_wandb(cfg: TrainConfig, model_config):
    try:
        import wandb
    except ImportError:
        raise UsageError("--use-wandb needs the wandb package: .venv/bin/pip install wandb") from None
    name = f"{cfg.model}_{model_config.vocab_size}_sl{cfg.max_len}_gbs{cfg.samples_per_update}"
    wandb.init(project="torch-gpt2", name=name, config=cfg.to_dict())
    return wandb
