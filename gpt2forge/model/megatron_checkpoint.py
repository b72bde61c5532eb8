"""Megatron-LM checkpoints in: a `--save` directory of Megatron-LM (its `torch` format) read as a
GPT-2 of this package, for evaluation, generation, fine-tuning and export to Hugging Face's format.

    <dir>/latest_checkpointed_iteration.txt        the iteration, or `release`
    <dir>/iter_0000500/mp_rank_00/model_optim_rng.pt      one file per tensor-parallel rank,
    <dir>/iter_0000500/mp_rank_01_002/model_optim_rng.pt  `_PPP` with pipeline stages
        {'args': Namespace, 'checkpoint_version': 3.0, 'iteration': N, 'model': state dict, ...}

Both naming families are read: Megatron-Core's `GPTModel` (`embedding.word_embeddings`,
`decoder.layers.N.self_attention.linear_qkv`, local or Transformer Engine layer specs) and the
legacy `language_model.encoder.layers.N.self_attention.query_key_value` nesting. Tensor-parallel
shards are merged (column-parallel along dim 0, row-parallel along dim 1, the vocabulary-parallel
embedding along its rows), each rank's fused QKV rows are put from the layout of its
`checkpoint_version` into ours ([q; k; v], heads in order), pipeline stages are concatenated, and
the vocabulary padding is trimmed to the real vocabulary (then padded as this package pads).

The directory and its files are found and read by gpt2forge.model.megatron_files (weights-only,
with an allowlist of globals: nothing in a file runs).

    python -m gpt2forge.model.megatron_checkpoint export MEGATRON_DIR OUT_DIR [--vocab-file F --merge-file F]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpt2forge.core.errors import UsageError, cli_main
from gpt2forge.model.checkpoint import to_hf_state_dict
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.model.megatron_files import KNOWN_VERSIONS, _first_shard, iteration_dir, read_shard, shard_paths
from gpt2forge.text.vocab import MERGES_FILE, VOCAB_FILE

GPT2_BPE_VOCAB = 50257

# -- the config ------------------------------------------------------------------------------------


def activation_of(args: Any) -> str:
    """The MLP non-linearity Megatron computed: the tanh approximation with --openai-gelu, with the
    fused bias-GeLU kernel (Megatron-LM's default, --no-bias-gelu-fusion turns it off) and with
    Transformer Engine's layers; the exact erf GeLU otherwise (as transformers' converter decides)."""
    fused = getattr(args, "bias_gelu_fusion", False) and getattr(args, "add_bias_linear", True)
    te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    return "gelu_new" if getattr(args, "openai_gelu", False) or fused or te else "gelu"


def unsupported(args: Any) -> list[str]:
    """The Megatron options this GPT-2 cannot represent exactly, each with its value."""
    heads = args.num_attention_heads
    checks = {
        "--position-embedding-type": getattr(args, "position_embedding_type", "learned_absolute")
        not in (None, "learned_absolute"),
        "--normalization": getattr(args, "normalization", "LayerNorm") not in (None, "LayerNorm"),
        "--swiglu": getattr(args, "swiglu", False), "--squared-relu": getattr(args, "squared_relu", False),
        "--num-query-groups": bool(getattr(args, "group_query_attention", False))
        and getattr(args, "num_query_groups", heads) not in (None, heads),
        "--kv-channels": getattr(args, "kv_channels", None) not in (None, args.hidden_size // heads),
        "--apply-residual-connection-post-layernorm": getattr(args, "apply_residual_connection_post_layernorm",
                                                              False),
        "--apply-layernorm-1p": getattr(args, "apply_layernorm_1p", False),
        "--untie-embeddings-and-output-weights": getattr(args, "untie_embeddings_and_output_weights", False),
        "--num-experts": bool(getattr(args, "num_experts", None)),
        "--num-layers-per-virtual-pipeline-stage": bool(getattr(args, "virtual_pipeline_model_parallel_size", None)),
    }
    return [f"{flag} {getattr(args, flag[2:].replace('-', '_'), True)}" for flag, bad in checks.items() if bad]


def real_vocab_size(args: Any, given: int | None, where: Path) -> int:
    """Rows of the embedding that are real tokens: `given` (the tokenizer's, or --vocab-size), which
    must agree with what the args say (their --vocab-size, or 50257 for the GPT-2 BPE tokenizer)."""
    tokenizer = getattr(args, "tokenizer_type", None)
    said = getattr(args, "vocab_size", None) or (GPT2_BPE_VOCAB if tokenizer in (None, "GPT2BPETokenizer") else None)
    if given is not None and said is not None and given != said:
        raise UsageError(f"{where}: the checkpoint's vocabulary has {said} tokens ({tokenizer or 'GPT-2 BPE'}), "
                         f"not {given}; use the tokenizer it was trained with")
    if given is None and said is None:
        raise UsageError(f"{where}: trained with {tokenizer}, which does not say how many of its "
                         f"{args.padded_vocab_size} embedding rows are real tokens; pass --vocab-size N")
    return int(given if given is not None else said)


def config_from_args(args: Any, vocab_size: int | None, where: Path) -> ModelConfig:
    """Our ModelConfig for the Megatron run whose args Namespace is `args`."""
    if not isinstance(args, argparse.Namespace):
        raise UsageError(f"{where}: holds no training arguments ('args', written by Megatron-LM since 2020); "
                         "re-save it with a newer Megatron-LM")
    if problems := unsupported(args):
        raise UsageError(f"{where}: trained with {', '.join(problems)}, which GPT-2 here does not have; "
                         "only GPT-2-shaped Megatron models load")
    V = real_vocab_size(args, vocab_size, where)
    ffn = getattr(args, "ffn_hidden_size", None)
    eps = getattr(args, "norm_epsilon", None) or getattr(args, "layernorm_epsilon", None) or 1e-5
    return ModelConfig(
        vocab_size=V, n_positions=args.max_position_embeddings, n_embd=args.hidden_size, n_layer=args.num_layers,
        n_head=args.num_attention_heads, n_inner=None if ffn in (None, 4 * args.hidden_size) else ffn,
        activation_function=activation_of(args), layer_norm_epsilon=eps,
        resid_pdrop=getattr(args, "hidden_dropout", 0.1), embd_pdrop=getattr(args, "hidden_dropout", 0.1),
        attn_pdrop=getattr(args, "attention_dropout", 0.1), initializer_range=getattr(args, "init_method_std", 0.02),
        bos_token_id=min(GPT2_BPE_VOCAB - 1, V - 1), eos_token_id=min(GPT2_BPE_VOCAB - 1, V - 1))


def megatron_model_config(path: str | Path, iteration: int | None = None,
                          vocab_size: int | None = None) -> ModelConfig:
    """The ModelConfig of a Megatron checkpoint (reads its first shard's args only)."""
    first = _first_shard(iteration_dir(path, iteration))
    return config_from_args(read_shard(first).get("args"), vocab_size, first)


# -- the weights -----------------------------------------------------------------------------------

# Module path inside a layer -> (ours inside `transformer.h.N.`, how tensor parallelism split it).
# `x.layer_norm` is Transformer Engine's LayerNorm fused into the linear layer x that follows it.
LAYER_MODULES = {
    "input_layernorm": ("ln_1", "replicated"), "self_attention.linear_qkv.layer_norm": ("ln_1", "replicated"),
    "post_attention_layernorm": ("ln_2", "replicated"), "pre_mlp_layernorm": ("ln_2", "replicated"),
    "mlp.linear_fc1.layer_norm": ("ln_2", "replicated"),
    "self_attention.query_key_value": ("attn.c_attn", "qkv"), "attention.query_key_value": ("attn.c_attn", "qkv"),
    "self_attention.linear_qkv": ("attn.c_attn", "qkv"),
    "self_attention.dense": ("attn.c_proj", "row"), "attention.dense": ("attn.c_proj", "row"),
    "self_attention.linear_proj": ("attn.c_proj", "row"),
    "mlp.dense_h_to_4h": ("mlp.c_fc", "column"), "mlp.linear_fc1": ("mlp.c_fc", "column"),
    "mlp.dense_4h_to_h": ("mlp.c_proj", "row"), "mlp.linear_fc2": ("mlp.c_proj", "row"),
}
# Modules outside the layers: Megatron-Core's names, then the legacy `language_model.` ones.
TOP_MODULES = {
    "embedding.word_embeddings": ("transformer.wte", "vocab"),
    "embedding.position_embeddings": ("transformer.wpe", "replicated"),
    "decoder.final_layernorm": ("transformer.ln_f", "replicated"),
    "encoder.final_layernorm": ("transformer.ln_f", "replicated"),
    "transformer.final_layernorm": ("transformer.ln_f", "replicated"),
    "output_layer": ("head", "vocab"), "word_embeddings_for_head": ("head", "vocab"),
}
LAYER_NAME = re.compile(r"(?:decoder|encoder|transformer)\.layers\.(\d+)\.(.+)")
PARAM_NAME = re.compile(r"(.+)\.(weight|bias|layer_norm_weight|layer_norm_bias|_extra_state)")


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Legacy Megatron nests its model state dict (`language_model` -> `encoder` -> ...): one level of
    dotted names, as Megatron-Core's already is."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def our_name(name: str, layer_offset: int, where: Path) -> tuple[str, str] | None:
    """(our name, split kind) for one Megatron tensor name; None for Transformer Engine's extra state.
    `layer_offset`: the pipeline stage's first layer (a stage numbers its layers from 0)."""
    m = PARAM_NAME.fullmatch(name.removeprefix("language_model."))
    if m is None:
        raise UsageError(f"{where}: holds {name!r}, not a GPT model tensor this reader knows")
    module, param = m.groups()
    if param == "_extra_state":
        return None
    if param.startswith("layer_norm_"):
        module, param = f"{module}.layer_norm", param.removeprefix("layer_norm_")
    if layer := LAYER_NAME.fullmatch(module):
        found = LAYER_MODULES.get(layer[2])
        prefix = f"transformer.h.{int(layer[1]) + layer_offset}."
    else:
        found, prefix = TOP_MODULES.get(module), ""
    if found is None:
        raise UsageError(f"{where}: holds {name!r}, which GPT-2 here has no place for; only GPT-2-shaped "
                         "Megatron models load")
    ours, kind = found
    return f"{prefix}{ours}.{param}", ("replicated" if kind == "row" and param == "bias" else kind)


def qkv_to_ours(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """One rank's fused QKV rows (heads of that rank) -> (3, heads * hn, ...), q, k, v in head order.

    checkpoint_version 0 stored [3 * np * hn], 1.0 [np * hn * 3], 2.0 and later (Megatron-Core's
    linear_qkv too) [np * 3 * hn] (np: the rank's heads, hn: head size)."""
    rest = t.shape[1:]
    hn = t.shape[0] // (3 * heads)
    if version == 0:
        t = t.view(3, heads, hn, *rest)
    elif version == 1.0:
        t = t.view(heads, hn, 3, *rest).movedim(2, 0)
    else:
        t = t.view(heads, 3, hn, *rest).transpose(0, 1)
    return t.reshape(3, heads * hn, *rest)


def merge_ranks(shards: list[dict[str, Any]], files: list[Path], layer_offset: int, version: float,
                heads_per_rank: int) -> dict[str, torch.Tensor]:
    """One pipeline stage's tensor-parallel shards -> whole tensors under our names."""
    named = []
    for shard, where in zip(shards, files):
        found = {}
        for name, t in flatten(shard["model"]).items():
            if (mapped := our_name(name, layer_offset, where)) is not None:
                found[mapped[0]] = (mapped[1], t, name)
        named.append(found)
    merged = {}
    for ours, (kind, _, name) in named[0].items():
        parts = []
        for found, where in zip(named, files):
            if ours not in found:
                raise UsageError(f"{where}: lacks {name!r}, which {files[0]} holds; the shards are not of one "
                                 "checkpoint")
            parts.append(found[ours][1])
        if len({tuple(p.shape) for p in parts}) > 1:
            shapes = ", ".join(f"{tuple(p.shape)}" for p in parts)
            raise UsageError(f"{files[0].parent.parent}: {name!r} has inconsistent shapes across the tensor-parallel "
                             f"ranks ({shapes}); the shards are not of one checkpoint")
        if kind == "qkv":
            t = torch.cat([qkv_to_ours(p, version, heads_per_rank) for p in parts], dim=1)
            merged[ours] = t.reshape(-1, *t.shape[2:])  # (3, C, ...) -> (3C, ...): [q; k; v]
        elif kind in ("column", "vocab") or (kind == "row" and len(parts) == 1):
            merged[ours] = torch.cat(parts, dim=0)
        elif kind == "row":
            merged[ours] = torch.cat(parts, dim=1)
        else:
            merged[ours] = parts[0]
    return merged


def load_megatron_checkpoint(path: str | Path, iteration: int | None = None,
                             vocab_size: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, fp32 state dict in this package's names) of a Megatron-LM checkpoint directory.

    path: the run's --save directory (its latest_checkpointed_iteration.txt picks the iteration
    unless `iteration` is given) or one iter_NNNNNNN/ directory. vocab_size: the real vocabulary
    (the tokenizer's); by default the args' --vocab-size, or 50257 for the GPT-2 BPE tokenizer.
    Raises UsageError (one line) for a missing or damaged shard, shards that disagree, an unknown
    checkpoint_version and models GPT-2 cannot represent (rotary, RMSNorm, SwiGLU, untied output).
    """
    it_dir = iteration_dir(path, iteration)
    first = _first_shard(it_dir)
    head = read_shard(first)
    cfg = config_from_args(head.get("args"), vocab_size, first)
    version = float(head.get("checkpoint_version", 0))
    if version not in KNOWN_VERSIONS:
        raise UsageError(f"{first}: checkpoint_version {version} is unknown here (0, 1.0, 2.0 and 3.0 are known); "
                         "re-save it with a Megatron-LM that writes 3.0")
    stages = shard_paths(it_dir, head["args"])
    tp = len(stages[0])
    if cfg.n_head % tp:
        raise UsageError(f"{first}: {cfg.n_head} attention heads do not split over tensor-parallel size {tp}")
    merged: dict[str, torch.Tensor] = {}
    offset = 0
    for files in stages:
        stage = merge_ranks([head if f == first else read_shard(f) for f in files], files, offset, version,
                            cfg.n_head // tp)
        if len(stages) > 1 and files is not stages[0]:
            stage.pop("head.weight", None)  # the last stage's copy of the tied word embeddings
        offset += len({k.split(".")[2] for k in stage if k.startswith("transformer.h.")})
        merged.update(stage)
    return cfg, finish_state_dict(merged, cfg, head["args"], first)


def finish_state_dict(merged: dict[str, torch.Tensor], cfg: ModelConfig, args: Any,
                      where: Path) -> dict[str, torch.Tensor]:
    """Merged Megatron tensors -> exactly our model's state dict: vocabulary trimmed and re-padded,
    biases of --disable-bias-linear runs as zeros, fp32, every name and shape checked."""
    if "head.weight" in merged:
        raise UsageError(f"{where}: has an output layer apart from the word embeddings (untied); GPT-2 here ties "
                         "them, so this checkpoint cannot load exactly")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in GPT2LMHeadModel(cfg).state_dict().items()}
    wte = merged.get("transformer.wte.weight")
    if wte is not None:
        if wte.shape[0] < cfg.vocab_size:
            raise UsageError(f"{where}: the word embeddings have {wte.shape[0]} rows, fewer than the vocabulary's "
                             f"{cfg.vocab_size} tokens; pass the --vocab-size the model was trained with")
        pad = wte.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, wte.shape[1])
        merged["transformer.wte.weight"] = torch.cat([wte[:cfg.vocab_size], pad])
        merged["lm_head.weight"] = merged["transformer.wte.weight"]
    if not getattr(args, "add_bias_linear", True):
        for name in expected.keys() - merged.keys():
            if name.endswith("bias") and (".attn." in name or ".mlp." in name):
                merged[name] = torch.zeros(expected[name])
    missing = sorted(expected.keys() - merged.keys())
    unexpected = sorted(merged.keys() - expected.keys())
    bad = [k for k in expected.keys() & merged.keys() if tuple(merged[k].shape) != expected[k]]
    if missing or unexpected or bad:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                  else f"{bad[0]} is {tuple(merged[bad[0]].shape)}, expected {expected[bad[0]]}")
        raise UsageError(f"{where}: the weights do not match the checkpoint's args ({detail}); the checkpoint is "
                         "incomplete or not a GPT model")
    return {k: v.float().contiguous() for k, v in merged.items()}


def load_megatron_model(path: str | Path, iteration: int | None = None,
                        vocab_size: int | None = None) -> GPT2LMHeadModel:
    """Our GPT2LMHeadModel (fp32, CPU) holding a Megatron-LM checkpoint's weights."""
    cfg, state = load_megatron_checkpoint(path, iteration, vocab_size)
    model = GPT2LMHeadModel(cfg)
    model.load_state_dict(state, strict=True)
    return model


# -- export ----------------------------------------------------------------------------------------


def export_hf(path: str | Path, out_dir: str | Path, iteration: int | None = None, vocab_size: int | None = None,
              vocab_file: str | None = None, merge_file: str | None = None) -> Path:
    """Write a Megatron-LM checkpoint as a Hugging Face GPT-2 directory (config.json +
    model.safetensors, and vocab.json + merges.txt when the tokenizer files are given) that
    `transformers.GPT2LMHeadModel.from_pretrained(out_dir)` opens. Returns out_dir."""
    if bool(vocab_file) != bool(merge_file):
        raise UsageError("--vocab-file and --merge-file go together (the GPT-2 BPE needs both)")
    for flag, f in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if f and not Path(f).is_file():
            raise UsageError(f"{flag} {f}: not found")
    if vocab_file and vocab_size is None:
        from gpt2forge.text.tokenizer import load_bpe_files  # why: only an export with tokenizer files reads them
        vocab_size = load_bpe_files(Path(vocab_file), Path(merge_file)).vocab_size
    model = load_megatron_model(path, iteration, vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_json(out / "config.json")
    save_file(to_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if vocab_file:
        shutil.copyfile(vocab_file, out / VOCAB_FILE)
        shutil.copyfile(merge_file, out / MERGES_FILE)
    return out


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpt2forge.model.megatron_checkpoint",
                                     description="Megatron-LM checkpoints (torch format) to Hugging Face GPT-2.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a Megatron-LM checkpoint as a Hugging Face GPT-2 directory")
    export.add_argument("megatron_dir", help="the Megatron-LM --save directory, or one of its iter_NNNNNNN/")
    export.add_argument("out_dir", help="where config.json and model.safetensors go")
    export.add_argument("--iteration", type=int, help="the iteration to export (default: the latest)")
    export.add_argument("--vocab-size", type=int, help="real vocabulary size (default: from the args or "
                        "--vocab-file; 50257 for the GPT-2 BPE)")
    export.add_argument("--vocab-file", help="Megatron's gpt2-vocab.json, copied as vocab.json")
    export.add_argument("--merge-file", help="Megatron's gpt2-merges.txt, copied as merges.txt")
    args = parser.parse_args(argv)
    out = export_hf(args.megatron_dir, args.out_dir, args.iteration, args.vocab_size, args.vocab_file,
                    args.merge_file)
    print(f"wrote {out} (config.json, model.safetensors"
          + (", vocab.json, merges.txt)" if args.vocab_file else "); no tokenizer files: pass --vocab-file "
             "and --merge-file to add them"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
