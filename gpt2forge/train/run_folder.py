"""A run's checkpoint folder: the checkpoints a run writes and resumes from, beside its metrics.

    <root>/step_N/ or <root>/epoch_N/
        config.json          HF GPT-2 config (n_positions = the trained --max-len)
        model.safetensors    HF names and layouts (Conv1D weights transposed), unpadded vocabulary
        training_state.pt    optimizer, schedule, step, epoch, data position, RNG states, loss scale
        train_config.json    every flag of the run, readable
        lineage.json         (fine-tunes) the parent checkpoint's path and weights' sha256
    <root>/epoch_N -> step_M a link when one checkpoint has both names
    <root>/latest            name of the newest complete checkpoint

Each checkpoint is a model directory of `model.checkpoint` (what `from_pretrained` and this project's
readers load, following `latest`) plus the training state.

Writes are atomic: everything goes to a hidden temporary directory that is fsynced and then
renamed into place, so a run killed at any moment (kill -9 included) leaves every earlier checkpoint
intact and never a half-written one under a checkpoint's name. A save that cannot happen (too little
free space, which is checked first, or a failing write) removes its temporary directory and raises
one line naming the directory, the bytes needed and free, and the last complete checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from gpt2forge.core.atomic import fsync_path, replace_with_link, write_atomic
from gpt2forge.core.errors import UsageError, one_line, refused_part
from gpt2forge.model.checkpoint import LATEST, to_hf_state_dict
from gpt2forge.model.gpt2 import GPT2LMHeadModel

TRAINING_STATE = "training_state.pt"
LINEAGE = "lineage.json"  # a fine-tune's parent: its path and the sha256 of its weight files
CHECKPOINT_NAME = re.compile(r"(step|epoch)_\d+")
TEMPORARY_NAME = re.compile(r"\.(?:step|epoch)_\d+\.(?:tmp|old)-(\d+)")  # a save in progress, by its process id


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `<root>/latest` names, when it is complete (None when there is none yet)."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    ckpt = Path(root) / pointer.read_text().strip()
    return ckpt if (ckpt / "config.json").is_file() and (ckpt / TRAINING_STATE).is_file() else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest checkpoints (`step_N/`, `epoch_N/`, by write time) in `root`,
    never the one `latest` names; links naming a deleted one go with it (links are not counted).
    Returns the deleted directories."""
    root = Path(root)
    named = [d for d in root.iterdir() if CHECKPOINT_NAME.fullmatch(d.name)]
    found = [d for d in named if not d.is_symlink() and (d / "config.json").is_file()]
    found.sort(key=lambda d: (d / "config.json").stat().st_mtime_ns, reverse=True)
    latest = latest_checkpoint(root)
    removed = [d for d in found[keep:] if latest is None or d.resolve() != latest.resolve()]
    for d in removed:
        shutil.rmtree(d)
    for link in named:
        if link.is_symlink() and not link.exists():  # its checkpoint was just deleted
            link.unlink()
    return removed


def save_checkpoint(root: str | Path, name: str, model: GPT2LMHeadModel, training_state: dict[str, Any],
                    train_config: dict[str, Any], extra_files: dict[str, Path] | None = None,
                    aliases: tuple[str, ...] = (), extra_json: dict[str, Any] | None = None) -> Path:
    """Write <root>/<name>/ atomically, link each of `aliases` (e.g. `epoch_2` for `step_8`) to it and
    point <root>/latest at it. Returns the final path.

    extra_files: file name -> source path copied into the checkpoint (e.g. tokenizer files).
    extra_json: file name -> JSON content written into the checkpoint (e.g. the fine-tune's parent).
    Raises UsageError (one line: the directory, bytes needed and free, the last complete checkpoint)
    when the space is not there or a write fails; the temporary directory is removed then.
    """
    root = Path(root)
    final = root / name
    weights = to_hf_state_dict(model)
    needed = checkpoint_bytes(weights, training_state, extra_files, extra_json)
    tmp = root / f".{name}.tmp-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)
        if needed > shutil.disk_usage(root).free:
            raise UsageError(save_failure(final, "not enough free space", needed))
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_files(tmp, model, weights, training_state, train_config, extra_files, extra_json)
        _publish(tmp, final)
    except (OSError, RuntimeError, SafetensorError) as exc:  # disk full, permissions, I/O errors
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(save_failure(final, one_line(exc), needed)) from None
    for alias in aliases:
        _link(root, alias, name)
    write_atomic(root / LATEST, name + "\n")
    fsync_path(root)
    return final


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Delete the temporary directories of saves whose process is gone (killed mid-save, kill -9
    included), so they do not fill the disk; a live process's are kept. Returns those deleted."""
    stale = []
    for d in root.iterdir():
        if (m := TEMPORARY_NAME.fullmatch(d.name)) and d.is_dir() and not d.is_symlink() and not _alive(int(m[1])):
            shutil.rmtree(d, ignore_errors=True)
            stale.append(d)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or not a pid: leave it alone
    return True


def checkpoint_bytes(weights: dict[str, torch.Tensor], training_state: dict[str, Any],
                     extra_files: dict[str, Path] | None = None, extra_json: dict[str, Any] | None = None) -> int:
    """Bytes a checkpoint will take on disk: its tensors (each storage once), the copied files and
    a margin for the formats' headers (1 KiB per tensor, 1 MiB in all)."""
    storages: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr() or id(x)] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    walk(training_state)
    files = sum(Path(src).stat().st_size for src in (extra_files or {}).values())
    texts = sum(len(json.dumps(v)) for v in (extra_json or {}).values())
    return weight_bytes + sum(storages.values()) + files + texts + 1024 * (len(weights) + len(storages)) + (1 << 20)


def save_failure(final: Path, reason: str, needed: int) -> str:
    """The one line a failed save prints: the directory, why, the bytes needed and free there, and
    the newest complete checkpoint (what a restart continues from)."""
    try:
        free = f"{shutil.disk_usage(final.parent).free:,}"
    except OSError:
        free = "unknown"
    last = latest_checkpoint(final.parent) if final.parent.is_dir() else None
    return (f"cannot save checkpoint {final}: {reason}; it needs {needed:,} bytes, {free} bytes free there; "
            f"last complete checkpoint: {last if last is not None else 'none'}; free space or choose another "
            "--checkpoint-output-dir")


def _write_files(tmp: Path, model: GPT2LMHeadModel, weights: dict[str, torch.Tensor], training_state: dict[str, Any],
                 train_config: dict[str, Any], extra_files: dict[str, Path] | None,
                 extra_json: dict[str, Any] | None) -> None:
    """Every file of a checkpoint into `tmp`, each flushed to disk."""
    model.config.save_json(tmp / "config.json")
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    torch.save(training_state, tmp / TRAINING_STATE)
    (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2, sort_keys=True) + "\n")
    for fname, content in (extra_json or {}).items():
        (tmp / fname).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    for fname, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / fname)
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`; an older checkpoint of that name goes only after."""
    if final.is_symlink():  # the name was an alias of another checkpoint
        final.unlink()
    if final.exists():  # re-saving the same name: move the old one aside first, drop it after
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def _link(root: Path, alias: str, name: str) -> None:
    """<root>/<alias> names checkpoint <root>/<name> too: a relative symbolic link, or a copy of
    hard links where the file system has no symbolic links."""
    path = root / alias
    if path.is_dir() and not path.is_symlink():  # a checkpoint of that name from before: replaced
        old = root / f".{alias}.old-{os.getpid()}"
        os.replace(path, old)
        shutil.rmtree(old)
    try:
        replace_with_link(path, name)
    except OSError:
        tmp = root / f".{alias}.tmp-{os.getpid()}"
        shutil.copytree(root / name, tmp, copy_function=os.link)
        _publish(tmp, path)


def load_training_state(ckpt_dir: Path) -> dict[str, Any]:
    """The training state saved in `ckpt_dir`, read without running any code from it (weights-only
    unpickling); a file this program did not write is refused with one line."""
    path = ckpt_dir / TRAINING_STATE
    if not path.is_file():
        raise UsageError(f"--checkpoint-input-dir {ckpt_dir}: no {TRAINING_STATE}, so there is nothing to resume; "
                         "drop --resume-training-from-checkpoint to start a new run from these weights")
    not_ours = (f"{path}: not a training state written by gpt2forge ({{}}); it was not loaded and nothing in it "
                "ran; resume from a checkpoint this program wrote")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UsageError(not_ours.format(refused_part(exc))) from None
    except Exception as exc:  # noqa: BLE001 -- a damaged file fails in many ways inside torch.load
        raise UsageError(f"{path}: cannot read training state ({type(exc).__name__}: damaged or truncated); "
                         "resume from an earlier checkpoint") from None
    if not isinstance(state, dict) or "progress" not in state:
        held = f"keys {sorted(map(str, state))[:4]}" if isinstance(state, dict) else type(state).__name__
        raise UsageError(not_ours.format(f"it holds {held}, no run progress"))
    return state
