"""A run's state beyond the weights: progress, checkpoints written and resumed under any layout
(their names, what a fine-tune records of its parent, a failed save agreed by every rank), and the
whole model gathered on rank 0 from pipeline stages or FSDP shards."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpt2forge.core import log
from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError
from gpt2forge.model.checkpoint import WEIGHT_FILES, export_pretrained, resolve_checkpoint_dir
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.megatron_files import is_megatron_checkpoint, iteration_dir
from gpt2forge.parallel.health import wait_for_rank0
from gpt2forge.text.tokenizer import tokenizer_files
from gpt2forge.text.vocab import MERGES_FILE, VOCAB_FILE, asset_dir
from gpt2forge.train.config import CheckpointArgs, TrainConfig
from gpt2forge.train.run_folder import (
    LINEAGE,
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
    save_checkpoint,
)

if TYPE_CHECKING:
    from gpt2forge.train.step import Run


@dataclasses.dataclass
class Progress:
    """Where the run is; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0  # host steps done
    epoch: int = 0  # 0-based epoch of the next step
    step_in_epoch: int = 0  # host steps done in the current epoch
    updates: int = 0  # optimizer updates done


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random state: torch (CPU), Python, and its own GPU's when it runs on one."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if isinstance(cuda, list):  # older checkpoints kept every visible GPU's state
        cuda = cuda[device.index or 0] if device is not None and (device.index or 0) < len(cuda) else None
    if cuda is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def gather_rng_states(device: torch.device) -> list[dict[str, Any]]:
    """Every rank's random state, in rank order (a collective; one entry in a single process)."""
    mine = rng_state(device)
    if not dist.is_initialized():
        return [mine]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def restore_rng_state(state: dict[str, Any], device: torch.device, seed: int, step: int) -> None:
    """Each rank takes its own saved random state (dropout masks continue as uninterrupted). A
    checkpoint from another process count has no state for every rank: rank 0's is taken and the
    others are reseeded from (seed, rank, step), so replicas still draw different masks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    states = state.get("rng_ranks") or [state["rng"]]
    world = dist.get_world_size() if dist.is_initialized() else 1
    set_rng_state(states[rank] if len(states) == world else states[0], device)
    if len(states) != world and rank:
        torch.manual_seed(seed + 1_000_003 * rank + step)


def save(run: Run, progress: Progress, names: str | tuple[str, ...], metrics: dict[str, float]) -> None:
    """The one place checkpoints are written (rank 0; every rank joins the gathering of pipeline
    stages and ZeRO shards). `names`: the directory's name, then names linked to it (`epoch_N`).
    A save that fails raises UsageError on every rank, after rank 0 has removed what it began."""
    names = (names,) if isinstance(names, str) else tuple(names)
    model, optimizer_state = run.strategy.checkpoint_state(run.optimizer)
    rngs = gather_rng_states(run.device)

    def write() -> None:
        state = {
            "progress": dataclasses.asdict(progress),
            "optimizer": optimizer_state,
            "lr_scheduler": run.scheduler.state_dict(),
            "loss_scaler": run.scaler.state_dict(),
            "rng": rngs[0],
            "rng_ranks": rngs,
            "metrics": metrics,
        }
        if run.kfac is not None:  # the same on every replica (factors all-reduced, decompositions broadcast)
            state["kfac"] = run.kfac.state_dict()
        _write(run.cfg, model, state, names)

    _on_rank0(run, write, "save the checkpoint")


def _on_rank0(run: Run, write: Callable[[], None], what: str) -> None:
    """`write()` on rank 0 while the others wait; its UsageError is raised on every rank."""
    error = None
    if run.dist_env.is_main:
        try:
            write()
        except UsageError as exc:
            error = str(exc)
    wait_for_rank0()  # until rank 0 has written it
    error = _from_rank0(error)
    if error is not None:
        raise UsageError(error if run.dist_env.is_main else f"rank 0 could not {what}; its error says why")


def _write(cfg: TrainConfig, model: GPT2LMHeadModel, state: dict[str, Any], names: tuple[str, ...]) -> None:
    """Rank 0's part of `save`: the checkpoint directory, its links, and pruning."""
    ckpt = cfg.checkpoint
    try:
        lineage = run_lineage(ckpt.checkpoint_input_dir, ckpt.resume_training_from_checkpoint)
    except (UsageError, OSError) as exc:  # the parent went away during the run: save without the record
        log.notice(f"the checkpoints do not record their parent: {exc}")
        lineage = None
    path = save_checkpoint(ckpt.checkpoint_output_dir, names[0], model, state, cfg.to_dict(),
                           extra_files=checkpoint_tokenizer_files(model.config.vocab_size,
                                                                  cfg.data.tokenizer_name_or_path),
                           aliases=names[1:], extra_json={LINEAGE: lineage} if lineage else None)
    log.info(f"saved checkpoint {path}" + "".join(f" (also {path.parent / n})" for n in names[1:]))
    if ckpt.keep_checkpoints:
        for old in prune_checkpoints(ckpt.checkpoint_output_dir, ckpt.keep_checkpoints):
            log.info(f"removed checkpoint {old} (--keep-checkpoints {ckpt.keep_checkpoints})")


def _from_rank0(value: str | None) -> str | None:
    """Rank 0's `value` on every rank (a collective when distributed)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_lineage(input_dir: str, resuming: bool) -> dict[str, Any] | None:
    """What the run's checkpoints record about where its weights came from (lineage.json): for a
    run started from --checkpoint-input-dir without resuming (a fine-tune), the parent's path and
    the sha256 of its weight files (and the parent's own lineage); a resumed run keeps the
    lineage of the checkpoint it continues; None for a run from scratch."""
    if not input_dir:
        return None
    if is_megatron_checkpoint(input_dir):  # its model_optim_rng.pt shards are the weight files
        it = iteration_dir(input_dir)
        shards = sorted(str(f.relative_to(it)) for f in it.glob("mp_rank_*/model_optim_rng.pt"))
        return {"parent": {"path": str(it.resolve()), "format": "megatron-lm",
                           "weights_sha256": {name: file_sha256(it / name) for name in shards}}}
    ckpt = resolve_checkpoint_dir(input_dir)
    if resuming:
        return _read_lineage(ckpt)
    files = tuple((f, (ckpt / f).stat().st_mtime_ns) for f in WEIGHT_FILES if (ckpt / f).is_file())
    parent: dict[str, Any] = {"path": str(ckpt.resolve()), "weights_sha256": _weights_sha256(ckpt, files)}
    if (grandparent := _read_lineage(ckpt)) is not None:
        parent["lineage"] = grandparent
    return {"parent": parent}


@functools.lru_cache(maxsize=4)
def _weights_sha256(ckpt: Path, files: tuple[tuple[str, int], ...]) -> dict[str, str]:
    """File name -> sha256 (hashed once per run, at its first save; `files` carries the mtimes)."""
    return {name: file_sha256(ckpt / name) for name, _ in files}


def _read_lineage(ckpt: Path) -> dict[str, Any] | None:
    path = ckpt / LINEAGE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        log.notice(f"{path}: unreadable, so the new checkpoints do not record this run's parent")
        return None


def apply_auto_resume(cfg: TrainConfig) -> TrainConfig:
    """--auto-resume: resume from the latest checkpoint in --checkpoint-output-dir when there is one
    (a requeued or restarted job); otherwise the run starts as its other flags say. Either way a
    --checkpoint-input-dir root is pinned to the checkpoint its `latest` names now, so the run's
    record of its start (train_config.json, lineage.json) does not move with later saves."""
    ckpt = cfg.checkpoint
    if ckpt.auto_resume and (latest := latest_checkpoint(ckpt.checkpoint_output_dir)) is not None:
        log.info(f"auto-resume: continuing from {latest}")
        return cfg.replace(checkpoint_input_dir=str(latest), resume_training_from_checkpoint=True)
    if ckpt.auto_resume:
        log.info(f"auto-resume: no checkpoint in {ckpt.checkpoint_output_dir} yet; starting "
                 + (f"from {ckpt.checkpoint_input_dir}" if ckpt.checkpoint_input_dir else "a new run"))
    if ckpt.checkpoint_input_dir and is_megatron_checkpoint(ckpt.checkpoint_input_dir):
        return cfg.replace(checkpoint_input_dir=str(iteration_dir(ckpt.checkpoint_input_dir)))
    if ckpt.checkpoint_input_dir and not (Path(ckpt.checkpoint_input_dir) / "config.json").is_file():
        return cfg.replace(checkpoint_input_dir=str(resolve_checkpoint_dir(ckpt.checkpoint_input_dir)))
    return cfg


def export_final(run: Run, directory: str, results: dict[str, float]) -> None:
    """--final-model-dir: the trained model, its tokenizer and all_results.json there (rank 0 writes;
    a collective when the model is sharded or pipelined)."""
    model = whole_model(run)

    def write() -> None:
        files = checkpoint_tokenizer_files(model.config.vocab_size, run.cfg.data.tokenizer_name_or_path)
        export_pretrained(directory, model, files, {"all_results.json": results})
        log.info(f"saved the final model and tokenizer in {directory}")

    _on_rank0(run, write, "write the final model")


def checkpoint_tokenizer_files(vocab_size: int, tokenizer_path: str | None = None) -> dict:
    """The tokenizer files to ship inside a checkpoint: --tokenizer-name-or-path's when given, else
    the GPT-2 BPE files (HF vocab.json/merges.txt) when they apply."""
    if tokenizer_path:
        return tokenizer_files(tokenizer_path)
    files = {f: asset_dir() / f for f in (VOCAB_FILE, MERGES_FILE)}
    if vocab_size != 50257 or not all(p.is_file() for p in files.values()):
        return {}
    return files


def checkpoint_name(cfg: CheckpointArgs, progress: Progress, epoch_done: bool, last: bool,
                    stopping: bool = False) -> tuple[str, ...]:
    """The names of the checkpoint to write after this host step: `step_N` when --save-per-steps
    falls here or the run stops on a signal, `epoch_N` at a --save-per-epochs end, `step_N` at the
    end of training when nothing else applies; the first is the directory, the others link to it.
    () for no save."""
    if not cfg.checkpoint_output_dir:
        return ()
    names = []
    if stopping or (cfg.save_per_steps and progress.step % cfg.save_per_steps == 0):
        names.append(f"step_{progress.step}")
    if epoch_done and cfg.save_per_epochs and progress.epoch % cfg.save_per_epochs == 0:
        names.append(f"epoch_{progress.epoch}")
    if last and not names:
        names.append(f"step_{progress.step}")
    return tuple(names)


def resume(run: Run, ckpt_dir, progress: Progress) -> None:
    state = load_training_state(ckpt_dir)
    try:
        run.strategy.load_optimizer_state(run.optimizer, state["optimizer"])
        run.scheduler.load_state_dict(state["lr_scheduler"])
        run.scaler.load_state_dict(state["loss_scaler"])
        for k, v in state["progress"].items():
            setattr(progress, k, v)
        restore_rng_state(state, run.device, run.cfg.data.seed, progress.step)
        if run.kfac is not None and "kfac" in state:
            run.kfac.load_state_dict(state["kfac"])
        elif run.kfac is not None:
            log.notice(f"{ckpt_dir}: no K-FAC state in this checkpoint; the factors start from the identity")
    except (KeyError, ValueError, RuntimeError) as exc:
        raise UsageError(f"{ckpt_dir}: training state does not fit this run ({type(exc).__name__}: {exc}); "
                         "resume with the same --model, --optimizer and --kfac flags") from None
    log.info(f"resumed from {ckpt_dir} at step {progress.step} (epoch {progress.epoch})")


def whole_model(run: Run) -> GPT2LMHeadModel | None:
    """The current whole model on rank 0 (None elsewhere); a collective when sharded or pipelined."""
    return run.strategy.whole_model()
