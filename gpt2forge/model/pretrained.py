"""Loading a trained GPT-2 for inference: weights, config and the tokenizer that goes with them.

One entry point, `load_pretrained`, shared by text generation, the inference benchmark and the
evaluation tasks. It takes our checkpoints (`step_N/`, `epoch_N/`, or a root with a `latest`
pointer), Hugging Face GPT-2 directories (`config.json` + `model.safetensors` or
`pytorch_model.bin`) and Megatron-LM `--save` directories (gpt2forge.model.megatron_checkpoint;
the tokenizer is GPT-2's, or Megatron's gpt2-vocab.json + gpt2-merges.txt placed in the directory
with --tokenizer-type 1). Anything missing or unreadable is a UsageError (exit 2): generation never
falls back to random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.model.checkpoint import load_model, resolve_checkpoint_dir
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.megatron_checkpoint import load_megatron_model
from gpt2forge.model.megatron_files import is_megatron_checkpoint
from gpt2forge.text.tokenizer import HF_FILE, Tokenizer, load_bpe_files, load_tokenizer
from gpt2forge.text.vocab import MERGES_FILE, VOCAB_FILE

MEGATRON_FILES = ("gpt2-vocab.json", "gpt2-merges.txt")

TOKENIZER_TYPES = {0: "Hugging Face GPT-2 files (vocab.json + merges.txt or tokenizer.json)",
                   1: "Megatron GPT-2 BPE (gpt2-vocab.json + gpt2-merges.txt: the same byte-level BPE)"}


def resolve_model_dir(path: str | Path) -> Path:
    """The checkpoint directory for `path` (a checkpoint, a root with `latest`, an HF directory or
    a Megatron-LM checkpoint directory, returned as it is), or for a hub id (`gpt2`, `org/name`) whose
    snapshot is in the local Hugging Face cache."""
    p = local_or_hub_cached(path)
    if p is None:
        raise UsageError(f"--model-name-or-path {path}: not found, and not in the local Hugging Face cache (nothing "
                         "is downloaded at run time); pass a checkpoint directory (step_N/, epoch_N/, a root with "
                         "`latest`) or a Hugging Face GPT-2 directory")
    if is_megatron_checkpoint(p):
        return p
    try:
        return resolve_checkpoint_dir(p)
    except UsageError:
        raise UsageError(f"--model-name-or-path {path}: no config.json (not a GPT-2 checkpoint); pass a "
                         "step_N/ or epoch_N/ directory, a root with `latest`, or a Hugging Face GPT-2 "
                         "directory") from None


def local_or_hub_cached(path: str | Path) -> Path | None:
    """`path` when it exists here, else the snapshot of hub model `path` in the local Hugging Face
    cache (`hub_cache_folder`), else None; never downloads."""
    p = Path(path)
    return p if p.exists() else hub_cache_folder(str(path))


def hub_cache_folder(repo_id: str) -> Path | None:
    """The snapshot of hub model `repo_id` (`name` or `org/name`) in the local Hugging Face cache
    (`$HF_HUB_CACHE`, `$HF_HOME/hub`), or None when it is not there; never downloads."""
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/")):
        return None
    try:
        from huggingface_hub import snapshot_download  # lazy: only for hub ids
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 -- not cached, not a valid id, or huggingface_hub missing: all mean "not here"
        return None


def load_checkpoint_tokenizer(ckpt: Path, tokenizer_type: int | None = None) -> Tokenizer:
    """The tokenizer saved with the checkpoint when there is one, else the GPT-2 default.

    tokenizer_type 0 (or None): vocab.json + merges.txt or tokenizer.json in `ckpt`; 1: Megatron's
    gpt2-vocab.json + gpt2-merges.txt pair in `ckpt`. GPT-2's own files give the fast built-in
    tokenizer (identical ids; see gpt2forge.text.tokenizer).
    """
    if tokenizer_type not in (None, *TOKENIZER_TYPES):
        raise UsageError(f"--tokenizer-type {tokenizer_type}: choose 0 ({TOKENIZER_TYPES[0]}) "
                         f"or 1 ({TOKENIZER_TYPES[1]})")
    if tokenizer_type == 1:
        vocab, merges = ckpt / MEGATRON_FILES[0], ckpt / MEGATRON_FILES[1]
        return load_bpe_files(vocab, merges) if vocab.is_file() and merges.is_file() else load_tokenizer()
    shipped = (ckpt / HF_FILE).is_file() or ((ckpt / VOCAB_FILE).is_file() and (ckpt / MERGES_FILE).is_file())
    return load_tokenizer(ckpt) if shipped else load_tokenizer()


def load_pretrained(path: str | Path, device: torch.device | str = "cpu",
                    tokenizer_type: int | None = None) -> tuple[GPT2LMHeadModel, Tokenizer]:
    """(model in eval mode on `device`, fp32 weights; tokenizer) for a checkpoint, HF or Megatron-LM
    directory. A Megatron checkpoint's real vocabulary is the tokenizer's (its embedding is padded).

    Raises UsageError when the directory, its config, weights or tokenizer cannot be loaded, or when
    the tokenizer's vocabulary differs from the model's (ids would be out of range or undecodable).
    """
    ckpt = resolve_model_dir(path)
    if is_megatron_checkpoint(ckpt):
        tok = load_checkpoint_tokenizer(ckpt, tokenizer_type)
        model = load_megatron_model(ckpt, vocab_size=tok.vocab_size)
    else:
        model = load_model(ckpt)
        tok = load_checkpoint_tokenizer(ckpt, tokenizer_type)
    if tok.vocab_size != model.config.vocab_size:
        raise UsageError(f"{ckpt}: the model's vocabulary ({model.config.vocab_size} ids) does not match the "
                         f"tokenizer's ({tok.vocab_size} ids); save the checkpoint with the tokenizer it was "
                         "trained with (vocab.json + merges.txt or tokenizer.json)")
    return model.to(device).eval(), tok
