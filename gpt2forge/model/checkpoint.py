"""Checkpoints: a directory that `transformers.GPT2LMHeadModel.from_pretrained` loads, plus the
training state and the resolved run config.

    <root>/step_N/ or <root>/epoch_N/
        config.json          HF GPT-2 config (n_positions = the trained --max-len)
        model.safetensors    HF names and layouts (Conv1D weights transposed), unpadded vocabulary
        training_state.pt    optimizer, schedule, step, epoch, data position, RNG states, loss scale
        train_config.json    every flag of the run, readable
    <root>/latest            name of the newest complete checkpoint

Writes are atomic: everything goes to a hidden temporary directory that is fsynced and then
renamed into place, so a run killed at any moment (kill -9 included) leaves every earlier checkpoint
intact and never a half-written one under a checkpoint's name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gpt2forge.core.atomic import fsync_path, write_atomic
from gpt2forge.core.errors import UsageError
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel

# HF's GPT-2 uses Conv1D (weight stored as (in, out)) where we use nn.Linear ((out, in)).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TRAINING_STATE = "training_state.pt"
LATEST = "latest"
CHECKPOINT_NAME = re.compile(r"(step|epoch)_\d+")


def to_hf_state_dict(model: GPT2LMHeadModel) -> dict[str, torch.Tensor]:
    """Our state dict in HF GPT2LMHeadModel names/layouts; the tied lm_head is left out (HF re-ties)."""
    V = model.config.vocab_size
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        t = t.detach()
        if name.endswith(CONV1D_WEIGHTS):
            t = t.t()
        elif name == "transformer.wte.weight":
            t = t[:V]
        out[name] = t.contiguous().cpu()
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weights (GPT2LMHeadModel names, or GPT2Model names without `transformer.`) -> ours,
    with the token embedding padded to cfg.padded_vocab_size (zero rows)."""
    out = {}
    for name, t in sd.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers of old HF versions; the head is tied to wte
        if not name.startswith("transformer."):
            name = "transformer." + name
        if name.endswith(CONV1D_WEIGHTS):
            t = t.t()
        elif name == "transformer.wte.weight" and t.shape[0] < cfg.padded_vocab_size:
            pad = t.new_zeros(cfg.padded_vocab_size - t.shape[0], t.shape[1])
            t = torch.cat([t, pad])
        out[name] = t.contiguous()
    out["lm_head.weight"] = out.get("transformer.wte.weight")
    return out


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, or a root whose `latest` file names one."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if (p / LATEST).is_file():
        name = (p / LATEST).read_text().strip()
        if (p / name / "config.json").is_file():
            return p / name
    if not p.exists():
        raise UsageError(f"--checkpoint-input-dir {path}: directory not found")
    raise UsageError(f"--checkpoint-input-dir {path}: no config.json (not a GPT-2 checkpoint); point it at a "
                     "step_N/ or epoch_N/ directory or a Hugging Face GPT-2 directory")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `<root>/latest` names, when it is complete (None when there is none yet)."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    ckpt = Path(root) / pointer.read_text().strip()
    return ckpt if (ckpt / "config.json").is_file() and (ckpt / TRAINING_STATE).is_file() else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest checkpoints (`step_N/`, `epoch_N/`, by write time) in `root`,
    never the one `latest` names. Returns the deleted directories."""
    root = Path(root)
    found = [d for d in root.iterdir() if CHECKPOINT_NAME.fullmatch(d.name) and (d / "config.json").is_file()]
    found.sort(key=lambda d: (d / "config.json").stat().st_mtime_ns, reverse=True)
    latest = latest_checkpoint(root)
    removed = [d for d in found[keep:] if latest is None or d.resolve() != latest.resolve()]
    for d in removed:
        shutil.rmtree(d)
    return removed


def load_model_config(ckpt_dir: Path, vocab_pad_multiple: int | None = None) -> ModelConfig:
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    if vocab_pad_multiple is not None:
        cfg.vocab_pad_multiple = vocab_pad_multiple
    return cfg


def load_weights(model: GPT2LMHeadModel, ckpt_dir: Path) -> None:
    """Load model.safetensors (or an HF pytorch_model.bin) from ckpt_dir into model, strictly."""
    path = next((ckpt_dir / f for f in WEIGHT_FILES if (ckpt_dir / f).is_file()), None)
    if path is None:
        raise UsageError(f"{ckpt_dir}: no {' or '.join(WEIGHT_FILES)}; the checkpoint is incomplete")
    try:
        if path.suffix == ".safetensors":
            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError) as exc:
        raise UsageError(f"{path}: cannot read weights ({exc}); the file is damaged, re-save it") from None
    ours = from_hf_state_dict(sd, model.config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    bad_shape = [k for k in set(ours) & set(expected) if ours[k].shape != expected[k].shape]
    if missing or unexpected or bad_shape:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"shape mismatch in {bad_shape[:3]}")
        raise UsageError(f"{path}: weights do not match config.json ({detail}); "
                         "the checkpoint is not a GPT-2 model of this shape")
    model.load_state_dict(ours, strict=True)


def save_checkpoint(root: str | Path, name: str, model: GPT2LMHeadModel, training_state: dict[str, Any],
                    train_config: dict[str, Any], extra_files: dict[str, Path] | None = None) -> Path:
    """Write <root>/<name>/ atomically and point <root>/latest at it. Returns the final path.

    extra_files: file name -> source path copied into the checkpoint (e.g. tokenizer files).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.config.save_json(tmp / "config.json")
    save_file(to_hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    torch.save(training_state, tmp / TRAINING_STATE)
    (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2, sort_keys=True) + "\n")
    for fname, src in (extra_files or {}).items():
        shutil.copyfile(src, tmp / fname)
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():  # re-saving the same name: move the old one aside first, drop it after
        old = root / f".{name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    write_atomic(root / LATEST, name + "\n")
    fsync_path(root)
    return final


def load_training_state(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / TRAINING_STATE
    if not path.is_file():
        raise UsageError(f"--checkpoint-input-dir {ckpt_dir}: no {TRAINING_STATE}, so there is nothing to resume; "
                         "drop --resume-training-from-checkpoint to start a new run from these weights")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UsageError(f"{path}: cannot read training state ({type(exc).__name__}); "
                         "resume from an earlier checkpoint") from None
