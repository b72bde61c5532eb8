"""The Hugging Face GPT-Neo file format (`model_type: gpt_neo`), read into and written from this
package's GPT-2 model.

GPT-Neo is GPT-2 with: attention layers that are 'global' (causal) or 'local' (causal over the last
`window_size` positions), attention scores not divided by sqrt(head_dim), separate q/k/v
projections without biases, and `nn.Linear` weights ((out, in), where GPT-2's Conv1D stores
(in, out)). The model here is the same GPT-2 module configured so (gpt2forge.model.config:
`attention_layers`, `window_size`, `scale_attn_weights=False`, `qkv_bias`); this module only renames:

    config.json:  hidden_size -> n_embd, num_layers -> n_layer, ... (NEO_CONFIG_NAMES)
                  attention_types [[["global", "local"], 6]] -> attention_layers, one entry per layer
    weights:      h.{i}.attn.attention.{q,k,v}_proj.weight -> h.{i}.attn.c_attn.weight (rows [q; k; v])
                  h.{i}.attn.attention.out_proj.{weight,bias} -> h.{i}.attn.c_proj.{weight,bias}

Imports only torch: config.py and checkpoint.py call it.
"""

from __future__ import annotations

from typing import Any

import torch

NEO_CONFIG_NAMES = {
    "n_positions": "max_position_embeddings",
    "n_embd": "hidden_size",
    "n_layer": "num_layers",
    "n_head": "num_heads",
    "n_inner": "intermediate_size",
    "resid_pdrop": "resid_dropout",
    "embd_pdrop": "embed_dropout",
    "attn_pdrop": "attention_dropout",
}
"""Our field -> GPTNeoConfig's key; the other shared fields (vocab_size, window_size,
activation_function, layer_norm_epsilon, ...) have the same name in both."""

NEO_DEFAULT_ATTENTION_TYPES = [[["global", "local"], 12]]
"""GPTNeoConfig's default `attention_types` (a config.json without the key means it)."""

_QKV = ("q_proj", "k_proj", "v_proj")


def expand_attention_types(attention_types: list) -> list[str]:
    """GPT-Neo's `[[["global", "local"], 6], ...]` -> one type per layer (GPTNeoConfig's expansion)."""
    return [kind for pattern, repeat in attention_types for _ in range(repeat) for kind in pattern]


def compress_attention_layers(layers: list[str]) -> list:
    """One type per layer -> `[[pattern, repeat]]` with the shortest pattern that repeats to `layers`."""
    n = len(layers)
    period = next(p for p in range(1, n + 1) if n % p == 0 and layers == layers[:p] * (n // p))
    return [[list(layers[:period]), n // period]]


def config_from_neo(d: dict[str, Any]) -> dict[str, Any]:
    """A GPT-Neo config.json dict -> ModelConfig keyword arguments (unknown keys kept, the caller
    drops them)."""
    out = dict(d)
    for ours, theirs in NEO_CONFIG_NAMES.items():
        if theirs in out:
            out[ours] = out.pop(theirs)
    out["attention_layers"] = expand_attention_types(d.get("attention_types") or NEO_DEFAULT_ATTENTION_TYPES)
    out["scale_attn_weights"] = False  # GPT-Neo never scales the scores
    return out


def config_to_neo(fields: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields (dataclasses.asdict) -> a config.json dict `transformers.GPTNeoConfig` reads."""
    keep = ("vocab_size", "window_size", "activation_function", "layer_norm_epsilon", "initializer_range",
            "bos_token_id", "eos_token_id", "tie_word_embeddings")
    d = {k: fields[k] for k in keep}
    d.update({theirs: fields[ours] for ours, theirs in NEO_CONFIG_NAMES.items()})
    d.update(model_type="gpt_neo", architectures=["GPTNeoForCausalLM"],
             attention_types=compress_attention_layers(fields["attention_layers"]))
    return d


def weights_from_neo(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-Neo weights (HF names, nn.Linear layout) -> GPT-2 names in nn.Linear layout: q/k/v fused
    into c_attn, out_proj renamed c_proj. The mask buffers of old files (attn.attention.bias,
    masked_bias) are dropped; names without the `transformer.` prefix (GPTNeoModel) are kept as they are."""
    out, qkv = {}, {}
    for name, t in sd.items():
        if ".attn.attention." not in name:
            out[name] = t
            continue
        block, _, leaf = name.partition(".attn.attention.")  # transformer.h.3, q_proj.weight
        proj = leaf.split(".")[0]
        if proj in _QKV and leaf.endswith(".weight"):
            qkv.setdefault(block, {})[proj] = t
        elif proj == "out_proj":
            out[f"{block}.attn.c_proj.{leaf.split('.')[1]}"] = t
        elif leaf in ("bias", "masked_bias"):
            continue  # causal-mask buffers of older transformers versions
        else:
            out[name] = t  # unexpected: the caller's strict check names it
    for block, parts in qkv.items():
        if len(parts) == 3:
            out[f"{block}.attn.c_attn.weight"] = torch.cat([parts[p] for p in _QKV])  # (3C, C) rows [q; k; v]
        else:
            out.update({f"{block}.attn.attention.{p}.weight": t for p, t in parts.items()})  # reported as unexpected
    return out


def weights_to_neo(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 names in nn.Linear layout -> GPT-Neo's (the inverse of `weights_from_neo`)."""
    out = {}
    for name, t in sd.items():
        block, sep, leaf = name.partition(".attn.")
        if not sep:
            out[name] = t
        elif leaf == "c_attn.weight":
            for proj, part in zip(_QKV, t.chunk(3)):  # (3C, C) -> 3 x (C, C)
                out[f"{block}.attn.attention.{proj}.weight"] = part
        else:  # c_proj.weight / c_proj.bias
            out[f"{block}.attn.attention.out_proj.{leaf.split('.')[1]}"] = t
    return out
