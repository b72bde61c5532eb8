"""The CPU decode step as one C++ call: `gpt2forge.DecodeModel` (custom_ops/decode_step.cpp).

A decode step reads every weight once; what it does besides is small, but on the CPU the compiled
step spent a measurable part of each token outside its matmuls, much of it entering and leaving
inductor's graph and running a dozen small kernels per layer between the matmuls; the fused step
spends less there (measured: docs/benchmarks.md, Design measurements). It runs the same matmul and
attention kernels (custom_ops/gemv.cpp, decode_attention.cpp) with that work in plain loops between
them, from one call per token. `Generator(compile=True)` (`--poptorch-loop`) uses it on the CPU
whenever `FusedDecodeStep.of` accepts the model, and inductor's compiled step otherwise.

    step = FusedDecodeStep.of(cached_lm)       # None: not this model, device or build
    logits = step(ids, slots, pad)             # as cached_lm(ids, slots, pad) for one token, in fp32
"""

from __future__ import annotations

import torch

from gpt2forge.generate.gemv import GEMV_MAX_ROWS
from gpt2forge.generate.kv_cache import CachedLM
from gpt2forge.ops import library as custom_ops

ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "quick_gelu": "quick_gelu",
    "silu": "silu",
}
"""The model's activation_function -> DecodeModel's name for it (the ones it computes)."""


def _decode_model_class():
    """torch.classes.gpt2forge.DecodeModel, or None when the library is not built or predates it."""
    if not custom_ops.load_custom_ops():
        return None
    try:
        return torch.classes.gpt2forge.DecodeModel
    except RuntimeError:  # torch raises this, not AttributeError, for a class never registered
        return None


class FusedDecodeStep:
    """CachedLM's one-token forward (T = 1) through `gpt2forge.DecodeModel.step`, on the CachedLM's own
    parameters and cache buffers (the same tensors: weights updated in place are seen; a module
    whose tensors are replaced, by `.to()` or `load_state_dict(assign=True)`, needs a new step)."""

    def __init__(self, params: list[torch.Tensor], caches: list[torch.Tensor], scales: list[float],
                 n_head: int, eps: float, activation: str):
        self.model = _decode_model_class()(params, caches, scales, n_head, eps, activation)

    @classmethod
    def of(cls, lm: CachedLM) -> FusedDecodeStep | None:
        """The fused step of `lm`, or None where it does not apply: the library lacks the class, the
        batch is larger than the matmul kernel serves (GEMV_MAX_ROWS rows: above it BLAS is faster),
        the model is not on the CPU in fp32 or bf16, a part is missing (a pipeline stage), a layer's
        shape is not GPT-2's, or the activation is not one the class computes."""
        args = cls.arguments(lm)
        return None if args is None else cls(**args)

    @staticmethod
    def arguments(lm: CachedLM) -> dict | None:
        """What `FusedDecodeStep(...)` takes for `lm` (None: see `of`)."""
        model = lm.model
        cfg = model.config
        t = model.transformer
        param = next(model.parameters())
        blocks = list(t.h.values())
        if (_decode_model_class() is None or lm.batch_size > GEMV_MAX_ROWS or param.device.type != "cpu"
                or param.dtype not in (torch.float32, torch.bfloat16) or not lm.decode_kernel
                or t.wte is None or t.wpe is None or t.ln_f is None or len(blocks) != cfg.n_layer
                or cfg.activation_function not in ACTIVATIONS):
            return None
        C = cfg.n_embd
        params = [t.wte.weight, t.wpe.weight]
        for block in blocks:
            a, m = block.attn, block.mlp
            linears = (a.c_attn, a.c_proj, m.c_fc, m.c_proj)
            if (any(x.bias is None for x in linears) or block.ln_1.weight is None or block.ln_2.weight is None
                    or a.c_attn.weight.shape != (3 * C, C) or a.n_head != cfg.n_head or a.window is not None):
                return None
            params += [block.ln_1.weight, block.ln_1.bias, a.c_attn.weight, a.c_attn.bias, a.c_proj.weight,
                       a.c_proj.bias, block.ln_2.weight, block.ln_2.bias, m.c_fc.weight, m.c_fc.bias,
                       m.c_proj.weight, m.c_proj.bias]
        head, V = model.lm_head, cfg.vocab_size
        params += [t.ln_f.weight, t.ln_f.bias, head.weight[:V]]
        if head.bias is not None:
            params.append(head.bias[:V])
        eps = {ln.eps for b in blocks for ln in (b.ln_1, b.ln_2)} | {t.ln_f.eps}
        if (len(eps) != 1 or any(p is None or p.dtype != param.dtype or not p.is_contiguous() for p in params)):
            return None
        caches = [getattr(lm, f"{kind}{i}") for i in range(cfg.n_layer) for kind in ("k", "v")]
        if any(c.dtype != param.dtype for c in caches):
            return None
        return dict(params=params, caches=caches, scales=[float(b.attn.scale) for b in blocks], n_head=cfg.n_head,
                    eps=eps.pop(), activation=ACTIVATIONS[cfg.activation_function])

    def __call__(self, ids: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """ids (B, 1) in slot slots (1,), pad (B,) -> the next token's logits (B, vocab_size), fp32."""
        return self.model.step(ids, slots, pad)
