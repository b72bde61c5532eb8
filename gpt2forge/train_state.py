"""A run's state beyond the weights: progress, checkpoints written and resumed under any layout,
and the whole model gathered on rank 0 from pipeline stages or FSDP shards."""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any

import torch

from . import log
from .checkpoint import latest_checkpoint, load_training_state, prune_checkpoints, save_checkpoint
from .distributed import full_optimizer_state, load_sharded_optimizer_state, sharded_state
from .errors import UsageError
from .health import wait_for_rank0
from .model import GPT2LMHeadModel
from .optim_state import model_group_names, to_indexed, to_named
from .train_config import TrainConfig
from .vocab import MERGES_FILE, VOCAB_FILE, asset_dir

if TYPE_CHECKING:
    from .trainer import Run


@dataclasses.dataclass
class Progress:
    """Where the run is; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0  # host steps done
    epoch: int = 0  # 0-based epoch of the next step
    step_in_epoch: int = 0  # host steps done in the current epoch
    updates: int = 0  # optimizer updates done


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run: Run, progress: Progress, name: str, metrics: dict[str, float]) -> None:
    """The one place checkpoints are written (rank 0; every rank joins the gathering of pipeline
    stages and ZeRO-1 shards)."""
    model = run.model
    if run.pipeline is not None:
        run.pipeline.gather_weights()
        optimizer_state = run.pipeline.optimizer_state(run.optimizer)
    elif run.fsdp:
        model_state, named = sharded_state(run.model, run.optimizer)
        if run.dist_env.is_main:
            optimizer_state = to_indexed(named, model_group_names(run.model))
            model = whole_model_from(model_state, run.model.config)
    else:
        optimizer_state = full_optimizer_state(run.optimizer, run.dist_env)
    if not run.dist_env.is_main:
        wait_for_rank0()  # until rank 0 has written it
        return
    state = {
        "progress": dataclasses.asdict(progress),
        "optimizer": optimizer_state,
        "lr_scheduler": run.scheduler.state_dict(),
        "loss_scaler": run.scaler.state_dict(),
        "rng": rng_state(),
        "metrics": metrics,
    }
    path = save_checkpoint(run.cfg.checkpoint_output_dir, name, model, state, run.cfg.to_dict(),
                           extra_files=tokenizer_files(run.model.config.vocab_size,
                                                       run.cfg.tokenizer_name_or_path))
    log.info(f"saved checkpoint {path}")
    if run.cfg.keep_checkpoints:
        for old in prune_checkpoints(run.cfg.checkpoint_output_dir, run.cfg.keep_checkpoints):
            log.info(f"removed checkpoint {old} (--keep-checkpoints {run.cfg.keep_checkpoints})")
    wait_for_rank0()


def apply_auto_resume(cfg: TrainConfig) -> TrainConfig:
    """--auto-resume: resume from the latest checkpoint in --checkpoint-output-dir when there is one
    (a requeued or restarted job); otherwise the run starts as its other flags say."""
    if not cfg.auto_resume:
        return cfg
    latest = latest_checkpoint(cfg.checkpoint_output_dir)
    if latest is None:
        log.info(f"auto-resume: no checkpoint in {cfg.checkpoint_output_dir} yet; starting "
                 + (f"from {cfg.checkpoint_input_dir}" if cfg.checkpoint_input_dir else "a new run"))
        return cfg
    log.info(f"auto-resume: continuing from {latest}")
    return dataclasses.replace(cfg, checkpoint_input_dir=str(latest), resume_training_from_checkpoint=True)


def tokenizer_files(vocab_size: int, tokenizer_path: str | None = None) -> dict:
    """The tokenizer files to ship inside a checkpoint: --tokenizer-name-or-path's when given, else
    the GPT-2 BPE files (HF vocab.json/merges.txt) when they apply."""
    if tokenizer_path:
        from .tokenizer import tokenizer_files as files_of

        return files_of(tokenizer_path)
    files = {f: asset_dir() / f for f in (VOCAB_FILE, MERGES_FILE)}
    if vocab_size != 50257 or not all(p.is_file() for p in files.values()):
        return {}
    return files


def checkpoint_name(cfg: TrainConfig, progress: Progress, epoch_done: bool, last: bool) -> str | None:
    if not cfg.checkpoint_output_dir:
        return None
    if epoch_done and progress.epoch % cfg.save_per_epochs == 0:
        return f"epoch_{progress.epoch}"
    if cfg.save_per_steps and progress.step % cfg.save_per_steps == 0:
        return f"step_{progress.step}"
    return f"step_{progress.step}" if last else None


def resume(run: Run, ckpt_dir, progress: Progress) -> None:
    state = load_training_state(ckpt_dir)
    try:
        if run.pipeline is not None:
            run.pipeline.load_optimizer_state(run.optimizer, state["optimizer"])
        elif run.fsdp:
            load_sharded_optimizer_state(run.model, run.optimizer,
                                         to_named(state["optimizer"], model_group_names(run.model)))
        else:
            run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["lr_scheduler"])
        run.scaler.load_state_dict(state["loss_scaler"])
        for k, v in state["progress"].items():
            setattr(progress, k, v)
        set_rng_state(state["rng"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise UsageError(f"{ckpt_dir}: training state does not fit this run ({type(exc).__name__}: {exc}); "
                         "resume with the same --model and --optimizer") from None
    log.info(f"resumed from {ckpt_dir} at step {progress.step} (epoch {progress.epoch})")


def whole_model(run: Run) -> GPT2LMHeadModel | None:
    """The current whole model on rank 0 (None elsewhere); a collective when sharded or pipelined."""
    if run.pipeline is not None:
        run.pipeline.gather_weights()
    elif run.fsdp:
        model_state, _ = sharded_state(run.model, run.optimizer)
        return whole_model_from(model_state, run.model.config).to(run.device) if run.dist_env.is_main else None
    return run.model if run.dist_env.is_main else None


def whole_model_from(state: dict, config) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(config)
    model.load_state_dict(state)
    return model
