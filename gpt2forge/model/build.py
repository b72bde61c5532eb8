"""Building a run's model: its shape (`resolve_model`: from --model, --model-config or a checkpoint,
with the shape and dropout flags applied) and its weights (`build_model`: a seeded initialisation or
the checkpoint's). The trainer, `--plan` and `inference_gpt2.py` build their models through these two.

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
from gpt2forge.core.memory import refuse_beyond_host
from gpt2forge.model.args import ModelArgs
from gpt2forge.model.checkpoint import load_model, load_model_config, resolve_checkpoint_dir
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.megatron_checkpoint import load_megatron_checkpoint, megatron_model_config
from gpt2forge.model.megatron_files import is_megatron_checkpoint
from gpt2forge.text.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The model a run builds: its shape and where its weights come from."""

    config: ModelConfig
    """The shape, overrides applied."""
    checkpoint: Path | None = None
    """The directory whose weights load (ours, Hugging Face's or Megatron-LM's); None: a fresh model."""
    resume: bool = False
    """Whether the run continues the checkpoint's training state (--resume-training-from-checkpoint)
    rather than fine-tuning from its weights."""
    seed: int = 0
    """--seed: a fresh model's initial weights are drawn from `init_generator(seed)`."""


def resolve_model(arch: ModelArgs, checkpoint_dir: str | None = None, *, tokenizer: str | None = None,
                  resume: bool = False, seed: int = 0) -> ModelSource:
    """The model of a run with model flags `arch`, loading `checkpoint_dir` (--checkpoint-input-dir)
    when set; `tokenizer` (--tokenizer-name-or-path) sets the vocabulary of a fresh or Megatron model.

    A checkpoint's own config wins (as in the reference); --max-len must fit its n_positions.
    A fresh model gets n_positions = --max-len (the reference's behaviour).
    """
    if checkpoint_dir:
        ckpt, mcfg = _checkpoint_shape(arch, checkpoint_dir, tokenizer, resume)
    else:
        ckpt, mcfg = None, _fresh_shape(arch, tokenizer)
    return ModelSource(_apply_dropout_overrides(mcfg, arch), ckpt, resume, seed)


def _fresh_shape(arch: ModelArgs, tokenizer: str | None) -> ModelConfig:
    """A fresh model's shape: --model-config's (else --model's), with n_positions =
    --max-position-embeddings (default --max-len), any of --num-layers, --hidden-size,
    --num-attention-heads, --ffn-hidden-size, --init-method-std (Megatron's names) replacing its
    values, and the vocabulary of `tokenizer` (the data's) when one is named."""
    mcfg = ModelConfig.from_json(arch.model_config) if arch.model_config else ModelConfig.preset(arch.model)
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
    if tokenizer:
        changes["vocab_size"] = load_tokenizer(tokenizer).vocab_size
    return dataclasses.replace(mcfg, **changes)


def _checkpoint_shape(arch: ModelArgs, path: str, tokenizer: str | None, resume: bool) -> tuple[Path, ModelConfig]:
    """(directory, shape) of the checkpoint at `path` (ours, Hugging Face's or Megatron-LM's), checked
    against the run's flags."""
    if not is_megatron_checkpoint(path):
        ckpt = resolve_checkpoint_dir(path)
        mcfg = load_model_config(ckpt)
    elif resume:
        raise UsageError(f"--checkpoint-input-dir {path}: a Megatron-LM checkpoint; its weights load here, its "
                         "optimizer state and iteration do not: add --finetune (pretrain_gpt.py) or drop "
                         "--resume-training-from-checkpoint")
    else:
        vocab = load_tokenizer(tokenizer).vocab_size if tokenizer else None
        ckpt, mcfg = Path(path), megatron_model_config(path, vocab_size=vocab)
    if arch.max_len > mcfg.n_positions:
        raise UsageError(f"--max-len {arch.max_len} exceeds n_positions={mcfg.n_positions} of the checkpoint "
                         f"{ckpt}; use --max-len {mcfg.n_positions} or less")
    if arch.model_config:
        log.notice(f"--model-config is ignored: the checkpoint {ckpt} brings its own config.json")
    _refuse_contradicting_shape(mcfg, arch, ckpt)
    return ckpt, mcfg


def _refuse_contradicting_shape(mcfg: ModelConfig, arch: ModelArgs, ckpt: Path) -> None:
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


def _apply_dropout_overrides(mcfg: ModelConfig, arch: ModelArgs) -> ModelConfig:
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


def check_weights_fit_host(mcfg: ModelConfig) -> None:
    """The model is built in host memory first, in fp32: refuse a shape whose weights alone exceed
    the host's available memory (a mistyped --max-len or --hidden-size), before allocating them."""
    params = mcfg.num_params()
    refuse_beyond_host(4.0 * params, f"the model's fp32 weights, {params:,} parameters ({mcfg.n_layer} layers, "
                       f"width {mcfg.n_embd}, {mcfg.n_positions} positions, vocabulary {mcfg.vocab_size}),",
                       "choose a smaller --model-config, --max-len, --hidden-size or --num-layers")


def init_generator(seed: int) -> torch.Generator:
    """The initial weights' own random stream, derived from --seed: the held-out split and each epoch's
    order seed theirs with --seed itself, and one generator state shared by two draws ties them (as
    Megatron and torchtitan keep the initialisation's seed apart from the data's)."""
    digest = hashlib.sha256(f"gpt2forge initial weights, seed {seed}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def build_model(source: ModelSource, device: torch.device) -> GPT2LMHeadModel:
    """The model of `source` on `device` in fp32 (master weights): seeded initial weights, or the
    checkpoint's."""
    mcfg, ckpt = source.config, source.checkpoint
    check_weights_fit_host(mcfg)
    if ckpt is None:
        model = GPT2LMHeadModel(mcfg)
        model.init_weights(init_generator(source.seed))
    elif is_megatron_checkpoint(ckpt):
        model = GPT2LMHeadModel(mcfg)
        _, state = load_megatron_checkpoint(ckpt, vocab_size=mcfg.vocab_size)
        model.load_state_dict(state, strict=True)
        log.info(f"loaded weights from the Megatron-LM checkpoint {ckpt}")
    else:
        model = load_model(ckpt, mcfg)
        log.info(f"loaded weights from {ckpt}")
        if not source.resume:
            log.info("fine-tuning: a new optimizer, LR schedule and step count (--resume-training-from-checkpoint "
                     "continues the checkpoint's own)")
    return model.to(device)
