"""Building the model for a run: shape from --model / --model-config / a checkpoint, weights from a
seeded initialisation or a checkpoint, and the sample printed after training.

Fine-tuning: `--checkpoint-input-dir` takes one of our checkpoints or any local Hugging Face GPT-2
directory (`save_pretrained` output: config.json + model.safetensors or pytorch_model.bin). The
run starts from its weights with a new optimizer, LR schedule and step count unless
`--resume-training-from-checkpoint` continues the checkpoint's own. A Megatron-LM `--save`
directory (gpt2forge.model.megatron_checkpoint) is taken too, for its weights only: the Megatron
run's optimizer and iteration are not resumed (Megatron's `--finetune`). `--hidden-dropout` (residual
and embedding dropout, Megatron's meaning) and `--attention-dropout` override the config of a fresh
or loaded model, and the checkpoints of the run record the values used.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError, collect
from gpt2forge.core.runtime import GiB, available_host_memory
from gpt2forge.model.checkpoint import load_model, load_model_config, resolve_checkpoint_dir
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.megatron_checkpoint import load_megatron_checkpoint, megatron_model_config
from gpt2forge.model.megatron_files import is_megatron_checkpoint
from gpt2forge.text.tokenizer import load_tokenizer
from gpt2forge.train.config import ModelArgs, TrainConfig


def resolve_model_config(cfg: TrainConfig) -> tuple[ModelConfig, Path | None]:
    """The model shape and, when --checkpoint-input-dir is set, the resolved checkpoint directory.

    A checkpoint's own config wins (as in the reference); --max-len must fit its n_positions.
    A fresh model gets n_positions = --max-len (the reference's behaviour).
    """
    if cfg.checkpoint.checkpoint_input_dir:
        ckpt, mcfg = checkpoint_model_config(cfg)
        if cfg.arch.max_len > mcfg.n_positions:
            raise UsageError(f"--max-len {cfg.arch.max_len} exceeds n_positions={mcfg.n_positions} of the checkpoint "
                             f"{ckpt}; use --max-len {mcfg.n_positions} or less")
        if cfg.arch.model_config:
            log.notice(f"--model-config is ignored: the checkpoint {ckpt} brings its own config.json")
        refuse_contradicting_shape(mcfg, cfg.arch, ckpt)
        return apply_dropout_overrides(mcfg, cfg.arch), ckpt
    mcfg = ModelConfig.from_json(cfg.arch.model_config) if cfg.arch.model_config else ModelConfig.preset(cfg.arch.model)
    mcfg = apply_shape_overrides(mcfg, cfg.arch)
    if cfg.data.tokenizer_name_or_path:  # the data's tokenizer sets the vocabulary of a fresh model
        mcfg.vocab_size = load_tokenizer(cfg.data.tokenizer_name_or_path).vocab_size
    return apply_dropout_overrides(mcfg, cfg.arch), None


def apply_shape_overrides(mcfg: ModelConfig, arch: ModelArgs) -> ModelConfig:
    """A fresh model's shape: the config's, with n_positions = --max-position-embeddings (default
    --max-len) and any of --num-layers, --hidden-size, --num-attention-heads, --ffn-hidden-size,
    --init-method-std (Megatron's names) replacing its values."""
    changes = {"n_positions": arch.max_position_embeddings or arch.max_len}
    for field, value in (("n_layer", arch.num_layers), ("n_embd", arch.hidden_size),
                         ("n_head", arch.num_attention_heads), ("n_inner", arch.ffn_hidden_size),
                         ("initializer_range", arch.init_method_std)):
        if value is not None:
            changes[field] = value
    width, heads = changes.get("n_embd", mcfg.n_embd), changes.get("n_head", mcfg.n_head)
    if width % heads:
        raise UsageError(f"hidden size {width} is not divisible by the number of attention heads {heads}; change "
                         "--hidden-size or --num-attention-heads")
    return dataclasses.replace(mcfg, **changes)


def refuse_contradicting_shape(mcfg: ModelConfig, arch: ModelArgs, ckpt: Path) -> None:
    """UsageError, one line per flag, when a shape flag (--num-layers, --hidden-size,
    --num-attention-heads, --ffn-hidden-size, --max-position-embeddings) differs from the checkpoint
    the run loads: the checkpoint's shape is what trains, so a contradicting flag is never dropped
    silently. Equal values (a seed's full command line resuming its own run) pass."""
    collect([f"--{flag} {value} contradicts the checkpoint {ckpt}: its {field} is {have}; drop the flag or "
             f"pass {have} (a checkpoint brings its own shape)"
             for flag, field, value, have in (
                 ("num-layers", "n_layer", arch.num_layers, mcfg.n_layer),
                 ("hidden-size", "n_embd", arch.hidden_size, mcfg.n_embd),
                 ("num-attention-heads", "n_head", arch.num_attention_heads, mcfg.n_head),
                 ("ffn-hidden-size", "n_inner", arch.ffn_hidden_size, mcfg.inner_dim),
                 ("max-position-embeddings", "n_positions", arch.max_position_embeddings, mcfg.n_positions))
             if value is not None and value != have])


def checkpoint_model_config(cfg: TrainConfig) -> tuple[Path, ModelConfig]:
    """(directory, model shape) of --checkpoint-input-dir: ours, Hugging Face's or Megatron-LM's."""
    path = cfg.checkpoint.checkpoint_input_dir
    if not is_megatron_checkpoint(path):
        ckpt = resolve_checkpoint_dir(path)
        return ckpt, load_model_config(ckpt)
    if cfg.checkpoint.resume_training_from_checkpoint:
        raise UsageError(f"--checkpoint-input-dir {path}: a Megatron-LM checkpoint; its weights load here, its "
                         "optimizer state and iteration do not: add --finetune (pretrain_gpt.py) or drop "
                         "--resume-training-from-checkpoint")
    return Path(path), megatron_model_config(path, vocab_size=_tokenizer_vocab(cfg))


def _tokenizer_vocab(cfg: TrainConfig) -> int | None:
    """The data's tokenizer's vocabulary when --tokenizer-name-or-path names one, else None."""
    return load_tokenizer(cfg.data.tokenizer_name_or_path).vocab_size if cfg.data.tokenizer_name_or_path else None


def apply_dropout_overrides(mcfg: ModelConfig, arch: ModelArgs) -> ModelConfig:
    """`mcfg` with --hidden-dropout as its residual and embedding dropout (resid_pdrop, embd_pdrop) and
    --attention-dropout as its attention-probability dropout (attn_pdrop); unset flags keep the
    config's values. Every dropout of a model built from the result uses them."""
    changes = {}
    if arch.hidden_dropout is not None:
        changes.update(resid_pdrop=arch.hidden_dropout, embd_pdrop=arch.hidden_dropout)
    if arch.attention_dropout is not None:
        changes.update(attn_pdrop=arch.attention_dropout)
    changed = {k: v for k, v in changes.items() if getattr(mcfg, k) != v}
    if changed:
        log.info("dropout: " + ", ".join(f"{k} {getattr(mcfg, k):g} -> {v:g}" for k, v in changed.items()))
    return dataclasses.replace(mcfg, **changes)


def _refuse_beyond_host(need: float, what: str, fix: str) -> None:
    """UsageError naming `what` (its `need` bytes) and the fix when it exceeds the host's available memory."""
    have = available_host_memory()
    if need > have:
        raise UsageError(f"{what} need {need / GiB:,.1f} GiB and this host has {have / GiB:,.1f} GiB available; {fix}")


def check_weights_fit_host(mcfg: ModelConfig) -> None:
    """The model is built in host memory first, in fp32: refuse a shape whose weights alone exceed
    the host's available memory (a mistyped --max-len or --hidden-size), before allocating them."""
    params = mcfg.num_params()
    _refuse_beyond_host(4.0 * params, f"the model's fp32 weights, {params:,} parameters ({mcfg.n_layer} layers, "
                        f"width {mcfg.n_embd}, {mcfg.n_positions} positions, vocabulary {mcfg.vocab_size}),",
                        "choose a smaller --model-config, --max-len, --hidden-size or --num-layers")


def check_step_fits_host(cfg: TrainConfig) -> None:
    """One host step's token ids (int64 inputs and labels, samples per step x --max-len) are held in
    host memory at once: refuse a batch that cannot be (a mistyped --batch-size or
    --gradient-accumulation), before the data order is drawn for it."""
    p = cfg.parallel
    _refuse_beyond_host(16.0 * cfg.samples_per_step * cfg.arch.max_len,
                        f"one step's token ids, {cfg.samples_per_step:,} sequences of {cfg.arch.max_len} tokens "
                        f"(--batch-size {p.batch_size} x --gradient-accumulation {p.gradient_accumulation} x "
                        f"--replication-factor {p.replication_factor} x --device-iterations {p.device_iterations}),",
                        "choose a smaller batch")


def init_generator(seed: int) -> torch.Generator:
    """The initial weights' own random stream, derived from --seed: the held-out split and each epoch's
    order seed theirs with --seed itself, and one generator state shared by two draws ties them (as
    Megatron and torchtitan keep the initialisation's seed apart from the data's)."""
    digest = hashlib.sha256(f"gpt2forge initial weights, seed {seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def build_model(cfg: TrainConfig, device: torch.device,
                shape: tuple[ModelConfig, Path | None] | None = None) -> tuple[GPT2LMHeadModel, Path | None]:
    """Model on `device` in fp32 (master weights), seeded init or checkpoint weights. `shape`:
    `resolve_model_config(cfg)` when the caller has it already."""
    mcfg, ckpt = shape or resolve_model_config(cfg)
    check_weights_fit_host(mcfg)
    if ckpt is None:
        model = GPT2LMHeadModel(mcfg)
        model.init_weights(init_generator(cfg.data.seed))
    elif is_megatron_checkpoint(ckpt):
        model = GPT2LMHeadModel(mcfg)
        _, state = load_megatron_checkpoint(ckpt, vocab_size=mcfg.vocab_size)
        model.load_state_dict(state, strict=True)
        log.info(f"loaded weights from the Megatron-LM checkpoint {ckpt}")
    else:
        model = load_model(ckpt, mcfg)
        log.info(f"loaded weights from {ckpt}")
        if not cfg.checkpoint.resume_training_from_checkpoint:
            log.info("fine-tuning: a new optimizer, LR schedule and step count (--resume-training-from-checkpoint "
                     "continues the checkpoint's own)")
    return model.to(device), ckpt
