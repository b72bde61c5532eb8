"""A model directory: what `transformers.GPT2LMHeadModel.from_pretrained` loads (config.json and
model.safetensors in HF names and layouts, Conv1D weights transposed, the vocabulary unpadded), read
and written here. A run's checkpoints (train/run_folder.py) are such directories plus the training
state, under a root whose `latest` file names the newest; the readers here follow it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gpt2forge.core.atomic import fsync_path
from gpt2forge.core.errors import UsageError, one_line, refused_part
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.gpt_neo import weights_from_neo, weights_to_neo

# HF's GPT-2 uses Conv1D (weight stored as (in, out)) where we use nn.Linear ((out, in)).
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LATEST = "latest"


def to_hf_state_dict(model: GPT2LMHeadModel) -> dict[str, torch.Tensor]:
    """Our state dict in HF GPT2LMHeadModel (or GPTNeoForCausalLM) names/layouts; the tied lm_head is
    left out (HF re-ties)."""
    V = model.config.vocab_size
    neo = model.config.model_type == "gpt_neo"
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        t = t.detach()
        if name.endswith(CONV1D_WEIGHTS) and not neo:  # GPT-Neo's are nn.Linear, as ours
            t = t.t()
        elif name == "transformer.wte.weight":
            t = t[:V]
        out[name] = t
    if neo:
        out = weights_to_neo(out)
    return {name: t.contiguous().cpu() for name, t in out.items()}


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weights (GPT2LMHeadModel or GPTNeoForCausalLM names, or their base models' names without
    `transformer.`) -> ours, with the token embedding padded to cfg.padded_vocab_size (zero rows)."""
    neo = cfg.model_type == "gpt_neo"
    if neo:
        sd = weights_from_neo(sd)
    out = {}
    for name, t in sd.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers of old HF versions; the head is tied to wte
        if not name.startswith("transformer."):
            name = "transformer." + name
        if name.endswith(CONV1D_WEIGHTS) and not neo:
            t = t.t()
        elif name == "transformer.wte.weight" and t.shape[0] < cfg.padded_vocab_size:
            pad = t.new_zeros(cfg.padded_vocab_size - t.shape[0], t.shape[1])
            t = torch.cat([t, pad])
        out[name] = t.contiguous()
    if "transformer.wte.weight" in out:  # else the caller reports the token embedding missing
        out["lm_head.weight"] = out["transformer.wte.weight"]
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


def load_model_config(ckpt_dir: Path, vocab_pad_multiple: int | None = None) -> ModelConfig:
    cfg = ModelConfig.from_json(ckpt_dir / "config.json")
    if vocab_pad_multiple is not None:
        cfg.vocab_pad_multiple = vocab_pad_multiple
    return cfg


def load_weights(model: GPT2LMHeadModel, ckpt_dir: Path) -> None:
    """Load model.safetensors (or an HF pytorch_model.bin) from ckpt_dir into model, strictly (GPT-2
    or GPT-Neo names and layouts, as the model's config.model_type says)."""
    path = next((ckpt_dir / f for f in WEIGHT_FILES if (ckpt_dir / f).is_file()), None)
    if path is None:
        raise UsageError(f"{ckpt_dir}: no {' or '.join(WEIGHT_FILES)}; the checkpoint is incomplete")
    try:
        if path.suffix == ".safetensors":
            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UsageError(f"{path}: not a weights file ({refused_part(exc)}); it was not loaded and nothing in it "
                         "ran; re-save the model with save_pretrained") from None
    except Exception as exc:  # noqa: BLE001 -- SafetensorError, OSError, and torch.load's many failure types
        raise UsageError(f"{path}: cannot read weights ({one_line(exc)}); the file is damaged, re-save it") from None
    ours = from_hf_state_dict(sd, model.config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    bad_shape = [k for k in set(ours) & set(expected) if ours[k].shape != expected[k].shape]
    if missing or unexpected or bad_shape:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"shape mismatch in {bad_shape[:3]}")
        raise UsageError(f"{path}: weights do not match config.json ({detail}); "
                         f"the checkpoint is not a {model.config.model_type} model of this shape")
    ours = {k: v.to(expected[k].dtype) for k, v in ours.items()}  # fp32 masters whatever the file's dtype
    model.load_state_dict(ours, strict=True, assign=True)  # the file's tensors become the parameters: no copy
    if model.lm_head is not None:
        model.lm_head.weight = model.transformer.wte.weight  # assign wraps each name in its own Parameter: re-tie


def load_model(ckpt_dir: Path, config: ModelConfig | None = None) -> GPT2LMHeadModel:
    """The checkpoint's model, built on the meta device and given the file's tensors: one copy of
    the weights in memory, never a random initialisation beside them (run_clm's --low_cpu_mem_usage).
    `config`: the shape when the caller changed it (dropout); default config.json's."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(config or load_model_config(ckpt_dir))
    load_weights(model, ckpt_dir)
    return model


def export_pretrained(directory: str | Path, model: GPT2LMHeadModel, extra_files: dict[str, Path] | None = None,
                      extra_json: dict[str, Any] | None = None) -> Path:
    """The model alone in the Hugging Face layout (config.json, model.safetensors, the tokenizer's
    `extra_files`, `extra_json` files) written into `directory`, which may hold other things (a run's
    checkpoints). Each file appears whole (written aside, then renamed), the `extra_json` files last.

    Raises UsageError, one line, when a write fails (nothing half-written is left under a final name).
    """
    directory = Path(directory)
    tmp = directory / f".export.tmp-{os.getpid()}"
    weights = to_hf_state_dict(model)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        model.config.save_json(tmp / "config.json")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for fname, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / fname)
        for fname, content in (extra_json or {}).items():
            (tmp / fname).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        order = [f for f in tmp.iterdir() if f.name not in (extra_json or {})] + [tmp / f for f in extra_json or {}]
        for f in order:
            fsync_path(f)
            os.replace(f, directory / f.name)
        fsync_path(directory)
    except (OSError, RuntimeError, SafetensorError) as exc:
        raise UsageError(f"{directory}: could not write the final model ({one_line(exc)}); free space or fix the "
                         "permissions; the run's checkpoints (step_N/) open with from_pretrained too") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


