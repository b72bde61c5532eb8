"""GPT-2 in plain PyTorch, and GPT-Neo as a configuration of it (local attention layers, unscaled
scores, no q/k/v biases: gpt2forge.model.gpt_neo).

Parameter names are Hugging Face's (`transformer.wte`, `transformer.h.{i}.attn.c_attn`, `lm_head`,
...), so checkpoints map one to one onto `transformers.GPT2LMHeadModel` (HF's Conv1D stores its
weight transposed; `checkpoint.py` handles that). This module knows nothing about devices,
distribution, data or checkpoints: placement, checkpointing and compilation are applied from outside.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gpt2forge.core.capability import capabilities
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.documents import (
    DocumentMask,
    dense_document_mask,
    document_mask,
    flex_attention,
    flex_available,
    flex_window_mask,
)
from gpt2forge.model.dropout import causal_attention_dropout, dropout
from gpt2forge.ops.lm_head_loss import LossChunking, fused_lm_head_loss

_GELU_TANH_C = 2.0 * math.sqrt(2.0 / math.pi)


class _GeluNewKeepsSlope(torch.autograd.Function):
    """gelu_new as x * sigmoid(2z) whose forward also keeps its slope for backward, so backward is
    one multiply instead of recomputing the sigmoid (the exp) and the slope's dozen operations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x2 = x * x
        s = torch.sigmoid(_GELU_TANH_C * (x + 0.044715 * x2 * x))
        ctx.save_for_backward(s + x * s * (1.0 - s) * (_GELU_TANH_C * (1.0 + 3 * 0.044715 * x2)))
        return x * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (slope,) = ctx.saved_tensors
        return grad * slope


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh z), z = sqrt(2/pi) (x + 0.044715 x^3); compiled as the same function written
    x * sigmoid(2z), which inductor's CPU kernels compute with an exp instead of a costlier tanh.
    On the CPU the compiled forward also keeps the slope for backward (`_GeluNewKeepsSlope`), which
    costs no extra memory: autograd kept the activation's input anyway. Eager keeps ATen's one fused
    tanh kernel (the sigmoid form would be several). The forms agree to fp32 rounding; the sigmoid
    form is the more exact for negative x, where 1 + tanh z cancels. The measurements of both
    choices (the activations alone and whole steps, on the AMX Xeon): docs/benchmarks.md, "Design
    measurements"."""
    if torch.compiler.is_compiling():
        if x.device.type == "cpu" and x.requires_grad and torch.is_grad_enabled():  # training: keep the slope
            return _GeluNewKeepsSlope.apply(x)
        return x * torch.sigmoid(_GELU_TANH_C * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class Dropout(nn.Module):
    """nn.Dropout with gpt2forge.model.dropout's `dropout` (its masks from `dropout_keep_mask` on the CPU)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": _gelu_new,
    "gelu_fast": _gelu_new,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def window_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(queries, keys) bool, True = attend: the queries are the last `queries` of `keys` positions, and
    query i sees key j when i - window < j <= i (GPT-Neo's local attention: itself and window - 1 before)."""
    i = torch.arange(keys - queries, keys, device=device)[:, None]  # (queries, 1)
    j = torch.arange(keys, device=device)[None, :]  # (1, keys)
    return (j <= i) & (j > i - window)


class Attention(nn.Module):
    """Causal multi-head self-attention with fused q/k/v projection (SDPA kernel); a local layer
    (`window`, GPT-Neo) sees only the last `window` positions."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        C = cfg.n_embd
        self.n_head = cfg.n_head
        self.window = cfg.attention_window(layer_idx)
        self.c_attn = nn.Linear(C, 3 * C, bias=cfg.qkv_bias)
        self.c_proj = nn.Linear(C, C)
        self.resid_dropout = Dropout(cfg.resid_pdrop)
        self.attn_pdrop = cfg.attn_pdrop
        scale = 1.0 / math.sqrt(cfg.head_dim) if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.scale = scale

    def forward(self, x: torch.Tensor, kv=None, last: int | None = None,
                documents: DocumentMask | None = None, local_block=None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). `kv` (inference only, see gpt2forge.generate.kv_cache) is one layer's
        preallocated cache: `kv.attend(q, k, v, scale, window)` stores this call's keys/values and returns the
        attention of q over all S cached ones (B, n_head, T, hd), under the cache's mask. `last`
        (without kv): only the last `last` positions attend (over all T keys) -> (B, last, C).
        `documents` (packed documents, without kv and last): a token attends within its document only.
        `local_block`: the FlexAttention block mask of a local layer's window (CUDA; see Transformer)."""
        B, T, C = x.shape
        # (B, T, 3C) -> 3 x (B, n_head, T, head_dim)
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)  # -1: a TP shard's heads
        dropout_p = self.attn_pdrop if self.training else 0.0
        if kv is not None:
            y = kv.attend(q, k, v, self.scale, self.window)
        elif self.window is not None:
            y = self._local_attention(q, k, v, documents, last, dropout_p, local_block)
            T = y.shape[2]
        elif documents is not None:
            y = self._document_attention(q, k, v, documents, dropout_p)
        elif last is not None:
            q = q[:, :, T - last:]  # query i is position T - last + i: it sees keys 0 .. T - last + i
            causal = torch.ones(last, T, dtype=torch.bool, device=x.device).tril(T - last)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, dropout_p=dropout_p, scale=self.scale)
            T = last
        elif self.training and self.attn_pdrop > 0.0 and not capabilities(q.device).sdpa_dropout:
            # CPU SDPA has no fused kernel with dropout; on CUDA the flash kernel applies it.
            y = causal_attention_dropout(q, k, v, self.attn_pdrop, self.scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, n_head, T, hd) -> (B, T, n_head * hd)
        return self.resid_dropout(self.c_proj(y))

    def _local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask | None,
                         last: int | None, dropout_p: float, block=None) -> torch.Tensor:
        """Windowed causal attention of q, k, v (B, n_head, T, hd) -> (B, n_head, T or last, hd), within
        each document when packed: FlexAttention's sliding-window `block` mask where the model built
        one (CUDA, no dropout; only the tiles in the band are computed), else SDPA under a dense window
        mask (T, T) (its masked kernels accumulate the unscaled scores in fp32, as transformers upcasts)."""
        if block is not None and dropout_p == 0.0 and last is None:
            return flex_attention(q, k, v, block, self.scale)
        T = k.shape[2]
        if last is not None:
            q = q[:, :, T - last:]
        mask = window_mask(q.shape[2], T, self.window, q.device)  # (Tq, T)
        if documents is not None:
            mask = mask & (documents.dense if documents.dense is not None else dense_document_mask(documents.ids))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=self.scale)

    def _document_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentMask,
                            dropout_p: float) -> torch.Tensor:
        """Block-causal attention of q, k, v (B, n_head, T, hd) -> (B, n_head, T, hd): the chunked CPU
        path when it applies dropout (it skips the keys before a chunk's documents), FlexAttention's
        block mask where the model built one (CUDA, no dropout), else SDPA with the dense mask. The
        device's `capabilities` choose (gpt2forge.core.capability)."""
        if dropout_p > 0.0 and not capabilities(q.device).sdpa_dropout:
            return causal_attention_dropout(q, k, v, dropout_p, self.scale, documents.ids, documents.starts)
        if documents.block is not None and dropout_p == 0.0:
            return flex_attention(q, k, v, documents.block, self.scale)
        # The dense mask, built here if the model planned another path (its dropout was changed since).
        mask = documents.dense if documents.dense is not None else dense_document_mask(documents.ids)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=self.scale)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.inner_dim)
        self.c_proj = nn.Linear(cfg.inner_dim, cfg.n_embd)
        self.act = _ACTIVATIONS[cfg.activation_function]
        self.dropout = Dropout(cfg.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv=None, last: int | None = None,
                documents: DocumentMask | None = None, local_block=None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C), or (B, last, C): the block's output for the last positions only.
        `documents`: packed documents attend within themselves; `local_block`: see Attention.forward."""
        a = self.attn(self.ln_1(x), kv, last, documents, local_block)
        x = x if last is None else x[:, x.shape[1] - last:]
        x = x + a
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """Embeddings, blocks and final LayerNorm: ids (B, T) -> hidden states (B, T, C).

    Parts may be missing, so that a pipeline stage is this model with what it does not own removed
    (gpt2forge.parallel.pipeline_stages): `wte`/`wpe` None (forward then takes hidden states (B, T, C) instead
    of ids), `h` holding a subset of the blocks (an `nn.ModuleDict` keyed by the layer index as a
    string, so the state-dict names stay `transformer.h.{i}...` whichever blocks remain), `ln_f` None
    (forward returns the last block's output). Blocks run in the order of `h`, which is layer order.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte: nn.Embedding | None = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe: nn.Embedding | None = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn_pdrop = cfg.attn_pdrop

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                kv_cache=None, last: int | None = None, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: ids (B, T) int64, or hidden states (B, T, C) when `wte` is None -> hidden (B, T, C).
        position_ids (B, T) default 0..T-1 (used only with the embeddings); kv_cache (inference)
        holds one cache layer per block, indexed by layer (see Attention.forward). `last`
        (evaluation, no cache): the hidden states of the last `last` positions only, (B, last, C);
        the final block of `h` then computes its attention output and MLP for those rows alone (its
        keys and values still span all T). document_ids (B, T) (packed documents, see
        gpt2forge.model.documents): a token attends only to earlier tokens of its own document."""
        T = x.shape[1]
        if last is not None and not 0 < last <= T:
            raise ValueError(f"last={last}: expected 1 .. {T} positions")
        documents = None
        if document_ids is not None:
            if kv_cache is not None or last is not None:
                raise ValueError("document_ids apply to training and evaluation forwards (no kv_cache, no last)")
            documents = self._document_mask(document_ids)
        if self.wte is not None:
            if position_ids is None:
                position_ids = torch.arange(T, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(position_ids))  # (B, T) ids -> (B, T, C)
        local = None if kv_cache is not None or last is not None else self._local_block_mask(x, document_ids)
        final = len(self.h) - 1
        for n, (i, block) in enumerate(self.h.items()):
            x = block(x, None if kv_cache is None else kv_cache[int(i)], last if n == final else None, documents,
                      local)
        return x if self.ln_f is None else self.ln_f(x)

    def _local_block_mask(self, x: torch.Tensor, document_ids: torch.Tensor | None):
        """The FlexAttention block mask every local layer shares (GPT-Neo on CUDA, without attention
        dropout), or None: the local layers then use a dense window mask (Attention._local_attention)."""
        windows = {block.attn.window for block in self.h.values()} - {None}
        if not windows or (self.training and self.attn_pdrop > 0.0):
            return None
        if not (capabilities(x.device).flex_attention and flex_available()):
            return None
        (window,) = windows  # one window_size per model
        return flex_window_mask(document_ids, x.shape[1], window, x.device)

    def _document_mask(self, document_ids: torch.Tensor) -> DocumentMask:
        """The mask every block shares: what its attention path needs (Attention._document_attention)."""
        dropout = self.training and self.attn_pdrop > 0.0
        can = capabilities(document_ids.device)
        chunked = dropout and not can.sdpa_dropout
        flex = can.flex_attention and not dropout and flex_available()
        return document_mask(document_ids, dense=not (chunked or flex), flex=flex)


class LMLoss(NamedTuple):
    """Sums over the non-ignored label positions, so micro-batches add up exactly."""

    loss_sum: torch.Tensor  # scalar, sum of per-token cross-entropy (fp32)
    correct: torch.Tensor  # scalar, number of tokens whose argmax equals the label
    tokens: torch.Tensor  # scalar, number of non-ignored labels


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with the LM head tied to the token embedding (`lm_head.weight is transformer.wte.weight`).

    `lm_head` may be None (with parts of `transformer` removed too, see Transformer): forward then
    returns the hidden states. A pipeline stage is this model with what the stage does not own
    removed; chaining the stages' forwards and `head_loss` gives the whole model's forward and loss.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = Transformer(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.fused_loss: LossChunking | None = None
        """How `forward(ids, labels)` computes the loss: None = full logits + cross-entropy; a
        LossChunking = the fused chunked LM head + loss (gpt2forge.ops.lm_head_loss), set from outside."""

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """HF/GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms, and residual
        output projections (`c_proj`) scaled by 1/sqrt(2 n_layer) (GPT-2 paper, section 2.3; not for
        GPT-Neo, whose transformers class initialises every nn.Linear alike)."""
        std = self.config.initializer_range
        proj_std = std if self.config.model_type == "gpt_neo" else std / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, proj_std, generator=generator)
            elif p.ndim == 2:
                p.normal_(0.0, std, generator=generator)
            elif name.endswith(".weight"):  # LayerNorm gain
                p.fill_(1.0)
            else:
                p.zero_()
        self.transformer.wte.weight[self.config.vocab_size:].zero_()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., padded_vocab) with the padded columns at -inf (never sampled or predicted)."""
        return mask_padded_vocab_(self.lm_head(hidden), self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None):
        """input_ids (B, T) int64, or hidden states (B, T, C) when `transformer.wte` is None.

        Without labels: logits (B, T, padded_vocab), padded columns at -inf; the hidden states
        (B, T, C) when `lm_head` is None.
        With labels (B, T, IGNORE_INDEX where not scored): an `LMLoss` of sums over scored tokens
        (needs `lm_head`).
        Packed documents (gpt2forge.model.documents.document_layout): position_ids (B, T) restart
        in each document (default 0..T-1), document_ids (B, T) keep attention within each document
        (default: one document per row, causal).
        """
        hidden = self.transformer(input_ids, position_ids, document_ids=document_ids)  # (B, T, C)
        if self.lm_head is None:
            if labels is not None:
                raise ValueError("labels given to a model without lm_head: score its hidden states with head_loss")
            return hidden
        if labels is None:
            return self.logits(hidden)
        return head_loss(hidden, self.lm_head.weight, labels, self.config.vocab_size, self.fused_loss)


def mask_padded_vocab_(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Sets the padded vocabulary columns (>= vocab_size) of fresh logits to -inf, in place: a
    matmul does not save its output for backward."""
    if logits.shape[-1] > vocab_size:
        logits[..., vocab_size:] = float("-inf")
    return logits


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., C) @ weight (padded_vocab, C).T with the padded columns at -inf."""
    return mask_padded_vocab_(F.linear(hidden, weight), vocab_size)


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
              fused: LossChunking | None) -> LMLoss:
    """The LM head + loss of hidden states (B, T, C) against labels (B, T): the fused chunked op when
    `fused` is set (the (B*T, V) logits are never materialized), else full logits + cross-entropy."""
    if fused is not None:
        return LMLoss(*fused_lm_head_loss(hidden.flatten(0, 1), weight, labels.flatten(), vocab_size, IGNORE_INDEX,
                                          fused))
    return lm_loss(head_logits(hidden, weight, vocab_size).flatten(0, 1), labels.flatten())


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> LMLoss:
    """Cross-entropy sum, correct-argmax count and token count over labels != IGNORE_INDEX.

    logits (N, V) in any float dtype (reduced in fp32 by the kernel), labels (N,) int64.
    """
    loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    with torch.no_grad():
        mask = labels != IGNORE_INDEX
        correct = ((logits.argmax(-1) == labels) & mask).sum()
        tokens = mask.sum()
    return LMLoss(loss_sum, correct, tokens)
