"""Building the model for a run: shape from --model / --model-config / a checkpoint, weights from a
seeded initialisation or a checkpoint, and the sample printed after training.

Fine-tuning: `--checkpoint-input-dir` takes one of our checkpoints or any local Hugging Face GPT-2
directory (`save_pretrained` output: config.json + model.safetensors or pytorch_model.bin). The
run starts from its weights with a new optimizer, LR schedule and step count unless
`--resume-training-from-checkpoint` continues the checkpoint's own. `--hidden-dropout` (residual
and embedding dropout, Megatron's meaning) and `--attention-dropout` override the config of a fresh
or loaded model, and the checkpoints of the run record the values used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.generate.generator import sample
from gpt2forge.model.checkpoint import load_model_config, load_weights, resolve_checkpoint_dir
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.text.tokenizer import load_tokenizer
from gpt2forge.train.config import ModelArgs, TrainConfig


def resolve_model_config(cfg: TrainConfig) -> tuple[ModelConfig, Path | None]:
    """The model shape and, when --checkpoint-input-dir is set, the resolved checkpoint directory.

    A checkpoint's own config wins (as in the reference); --max-len must fit its n_positions.
    A fresh model gets n_positions = --max-len (the reference's behaviour).
    """
    if cfg.checkpoint.checkpoint_input_dir:
        ckpt = resolve_checkpoint_dir(cfg.checkpoint.checkpoint_input_dir)
        mcfg = load_model_config(ckpt)
        if cfg.arch.max_len > mcfg.n_positions:
            raise UsageError(f"--max-len {cfg.arch.max_len} exceeds n_positions={mcfg.n_positions} of the checkpoint "
                             f"{ckpt}; use --max-len {mcfg.n_positions} or less")
        if cfg.arch.model_config:
            log.notice(f"--model-config is ignored: the checkpoint {ckpt} brings its own config.json")
        return apply_dropout_overrides(mcfg, cfg.arch), ckpt
    mcfg = ModelConfig.from_json(cfg.arch.model_config) if cfg.arch.model_config else ModelConfig.preset(cfg.arch.model)
    mcfg.n_positions = cfg.arch.max_len
    if cfg.data.tokenizer_name_or_path:  # the data's tokenizer sets the vocabulary of a fresh model
        mcfg.vocab_size = load_tokenizer(cfg.data.tokenizer_name_or_path).vocab_size
    return apply_dropout_overrides(mcfg, cfg.arch), None


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


def build_model(cfg: TrainConfig, device: torch.device) -> tuple[GPT2LMHeadModel, Path | None]:
    """Model on `device` in fp32 (master weights), seeded init or checkpoint weights."""
    mcfg, ckpt = resolve_model_config(cfg)
    model = GPT2LMHeadModel(mcfg)
    if ckpt is None:
        model.init_weights(torch.Generator().manual_seed(cfg.data.seed))
    else:
        load_weights(model, ckpt)
        log.info(f"loaded weights from {ckpt}")
        if not cfg.checkpoint.resume_training_from_checkpoint:
            log.info("fine-tuning: a new optimizer, LR schedule and step count (--resume-training-from-checkpoint "
                     "continues the checkpoint's own)")
    return model.to(device), ckpt


def maybe_sample(cfg: TrainConfig, model: GPT2LMHeadModel, device: torch.device) -> None:
    """Print --sample-tokens generated tokens after training (GPT-2 vocabulary models only)."""
    if cfg.eval.sample_tokens <= 0 or log.rank() != 0:
        return
    tok = load_tokenizer(cfg.data.tokenizer_name_or_path)
    if model.config.vocab_size != tok.vocab_size:
        log.notice(f"no sample: the model's vocabulary ({model.config.vocab_size}) is not the GPT-2 BPE's")
        return
    prompt = tok.encode(cfg.eval.sample_prompt) or [tok.eot_id]
    gen = torch.Generator().manual_seed(cfg.data.seed)
    ids = sample(model, prompt, cfg.eval.sample_tokens, generator=gen, stop_id=None)
    log.banner("Sample")
    log.info(tok.decode(prompt + ids))
