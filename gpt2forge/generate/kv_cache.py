"""A preallocated key/value cache and the cached forward pass built on it (inference only).

Layout: one key and one value buffer per layer, (B, n_head, S, head_dim), S = the longest sequence
one generation may reach (prompt + new tokens). Batches of prompts of different lengths are LEFT
padded to a common length P, so every row writes its token t into the same slot t:

    slot        0    1    2    3  |  4    5 ...      (P = 4)
    row 0      pad  pad   a    b  |  new  new
    row 1       c    d    e    f  |  new  new

Row b has `pad[b]` padding slots; its real tokens get positions slot - pad[b] (so position ids
are those of the unpadded prompt), and a query in slot i attends to slots pad[b] <= j <= i. Slots
not yet written are masked, so the buffers never need clearing between generations. The shapes
never change during decoding, which is what torch.compile (and CUDA graphs) need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpt2forge.generate.gemv import GemvLinear, gemv_linear, with_gemv_linears
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops import library as custom_ops


def attention_mask(pad: torch.Tensor, slots: torch.Tensor, S: int) -> torch.Tensor:
    """(B, 1, T, S) bool, True = attend: key slot j for the query in slot slots[t] of row b.

    pad (B,) padding slots per row; slots (T,) the query slots of this call. A padding query also
    sees itself, so no row of the mask is empty (an empty row makes SDPA return NaN).
    """
    j = torch.arange(S, device=slots.device)  # (S,)
    i = slots[:, None]  # (T, 1)
    causal = j[None, :] <= i  # (T, S)
    real = j[None, :] >= pad[:, None]  # (B, S)
    return (causal[None] & (real[:, None, :] | (j[None, :] == i)[None]))[:, None]  # (B, 1, T, S)


class _LayerKV:
    """One layer's view of the cache for one call: what `model.Attention.forward` expects."""

    __slots__ = ("k", "v", "slots", "mask", "pad", "kernel")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                 pad: torch.Tensor, kernel: bool):
        self.k, self.v, self.slots, self.mask, self.pad, self.kernel = k, v, slots, mask, pad, kernel

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None) -> torch.Tensor:
        """Store k, v (B, n_head, T, hd) in this call's slots, then attend q (B, n_head, T, hd) over
        the whole cache (B, n_head, S, hd) under the mask; returns (B, n_head, T, hd). `window` (a
        GPT-Neo local layer): the query in slot i sees slots i - window < j <= i only."""
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)
        keys, values = self.k, self.v
        mask = self.mask
        if window is not None:  # slots are positions apart as in the padded prompt, as HF's cache counts them
            S = keys.shape[2]
            mask = attention_mask(self.pad, self.slots, S) if mask is None else mask
            recent = torch.arange(S, device=q.device)[None, :] > self.slots[:, None] - window  # (T, S)
            mask = mask & recent
        elif self.kernel and q.shape[2] == 1:
            # One query per row (a decode step): custom_ops/decode_attention.cpp reads only the filled
            # slots, pad[b] .. slot, where SDPA reads and masks all S.
            return torch.ops.gpt2forge.decode_attention(q, keys, values, self.pad, self.slots, scale)
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # Prefill, or decode without the library: CPU SDPA is several times slower in bf16 than
            # in fp32 (measured: docs/benchmarks.md, Design measurements); converting this layer's
            # cache costs less.
            q, keys, values = q.float(), keys.float(), values.float()
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale).to(v.dtype)


class CachedLM(nn.Module):
    """`model` plus a KV cache for `batch_size` rows of up to `max_len` tokens.

    `forward(ids, slots, pad)` runs ids (B, T) whose tokens occupy cache slots `slots` (T,) and
    returns the logits of the LAST position only, (B, vocab_size): the LM head never runs for the
    other prompt positions, nor for the embedding's padding rows. Prefill is one call with T = P;
    each decode step is a call with T = 1 (static shapes, so the step compiles once).

    `full_head=True` (CUDA's graph decode): the head runs over all padded_vocab rows, an aligned
    shape (50,304 for GPT-2, a multiple of 64) that GPU matmuls prefer to 50,257 odd rows, and the
    logits (B, padded_vocab) have -inf in the padding columns, so those ids are never chosen.
    """

    def __init__(self, model: GPT2LMHeadModel, batch_size: int, max_len: int, dtype: torch.dtype | None = None,
                 full_head: bool = False):
        super().__init__()
        self.full_head = full_head
        cfg = model.config
        if max_len > cfg.n_positions:
            raise ValueError(f"max_len {max_len} exceeds n_positions {cfg.n_positions}")
        param = next(model.parameters())
        dtype = dtype or param.dtype
        self.model = with_gemv_linears(model)  # the same weights; decode-sized matmuls on the gemv kernel
        self.max_len = max_len
        # The decode kernel: CPU fp32/bf16 caches (with_gemv_linears's conditions, and the op built).
        self.decode_kernel = (param.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                              and custom_ops.has_op("decode_attention"))
        shape = (batch_size, cfg.n_head, max_len, cfg.head_dim)
        # Separate buffers per layer (not one 5-D tensor): an in-place write to a view of a shared
        # base would make torch.compile rebuild the whole base every step.
        for i in range(cfg.n_layer):
            self.register_buffer(f"k{i}", torch.zeros(shape, dtype=dtype, device=param.device), persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(shape, dtype=dtype, device=param.device), persistent=False)

    @property
    def batch_size(self) -> int:
        return self.k0.shape[0]

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        one_query = self.decode_kernel and ids.shape[1] == 1  # the decode kernel needs no mask
        mask = None if one_query else attention_mask(pad, slots, self.max_len)
        position_ids = (slots[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
        layers = [_LayerKV(getattr(self, f"k{i}"), getattr(self, f"v{i}"), slots, mask, pad, self.decode_kernel)
                  for i in range(self.model.config.n_layer)]
        hidden = self.model.transformer(ids, position_ids, layers)  # (B, T, C)
        # The vocabulary's rows of the head only: with all padded_vocab rows, setting the padding's
        # logits to -inf made the compiled step sweep every logit again after the head's matmul.
        head, V = self.model.lm_head, self.model.config.vocab_size
        linear = gemv_linear if isinstance(head, GemvLinear) else F.linear
        if self.full_head:
            logits = linear(hidden[:, -1], head.weight, head.bias)  # (B, padded_vocab)
            logits[:, V:] = float("-inf")  # the padding columns only: B x (padded_vocab - V) values
            return logits
        return linear(hidden[:, -1], head.weight[:V], None if head.bias is None else head.bias[:V])  # (B, V)
