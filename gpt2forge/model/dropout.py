"""Dropout: cheap keep-masks, and causal attention with dropout computed in query chunks.

On CUDA, SDPA's flash kernel applies attention dropout inside the kernel. On CPU no fused SDPA
kernel takes a dropout probability, and the spelled-out math holds several (B, n_head, T, T) fp32
tensors per layer (403 MB each at B=8, T=1024, 12 heads). `causal_attention_dropout` computes the
same function a block of query rows at a time (the flash-attention recurrence: backward
recomputes the probabilities from the saved log-sum-exp), skips the keys a causal row never sees
(about half the matmul work at long T), and keeps only the bool masks and the row log-sum-exp
between forward and backward. A sequence short enough for one chunk keeps its probabilities
instead (recomputing them would cost more time than the memory is worth).
"""

from __future__ import annotations

import torch

DROP_BITS = 15
"""Random bits per dropout decision: p is rounded to a multiple of 2**-15 (0.1 -> 0.100006)."""

ATTENTION_CHUNK_ELEMENTS = 1 << 23
"""Score elements per query chunk (B * n_head * rows * keys): 32 MB of fp32 at a time."""


@torch.library.custom_op("gpt2forge::dropout_keep_mask", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def dropout_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Bool mask shaped like `x`, True (keep) with probability 1 - round(p * 2**15) / 2**15, drawn
    from torch's generator.

    Each 32-bit draw of the generator decides two elements (int32 `random_()` gives 31 uniform
    bits, viewed as two int16 of which the low 15 bits are used): half the draws of
    `torch.rand(x.shape) >= p`, which on a 2-core CPU spent 0.18 s of a 5.5 s GPT-2 small
    training step drawing masks (now 0.10 s). An opaque op on purpose: torch.compile then calls
    ATen's generator instead of inlining its own per-element Philox generator, which on CPU costs
    ~3x more per element. Compiled and eager runs draw the same masks from the same seed.
    """
    n = x.numel()
    bits = torch.empty((n + 1) // 2, dtype=torch.int32, device=x.device).random_().view(torch.int16)
    keep = (bits[:n] & ((1 << DROP_BITS) - 1)) >= round(p * (1 << DROP_BITS))
    return keep.view(x.shape)


@dropout_keep_mask.register_fake
def _(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


def kept_fraction(p: float) -> float:
    """The probability that `dropout_keep_mask(x, p)` keeps an element."""
    return 1.0 - round(p * (1 << DROP_BITS)) / (1 << DROP_BITS)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout with p rounded to a multiple of 2**-15 (`dropout_keep_mask`): zero with that
    probability, the rest scaled by 1 / (1 - it), so the expectation stays exactly x."""
    if not training or p == 0.0:
        return x
    kept = kept_fraction(p)
    if kept <= 0.0:
        return torch.zeros_like(x)
    return x * dropout_keep_mask(x, p) * (1.0 / kept)


def _chunks(q: torch.Tensor) -> list[tuple[int, int]]:
    """Query row ranges [t0, t1) with about ATTENTION_CHUNK_ELEMENTS scores each (a multiple of 16 rows)."""
    B, H, T, _ = q.shape
    rows = max(16, ATTENTION_CHUNK_ELEMENTS // max(1, B * H * T) // 16 * 16)
    return [(t0, min(T, t0 + rows)) for t0 in range(0, T, rows)]


def _scores(q: torch.Tensor, k: torch.Tensor, t0: int, t1: int, scale: float) -> torch.Tensor:
    """Scaled causal scores of query rows t0..t1-1 against keys 0..t1-1, fp32 (B, H, t1-t0, t1)."""
    s = torch.matmul(q[:, :, t0:t1], k[:, :, :t1].transpose(-2, -1)).float().mul_(scale)
    n = t1 - t0
    if n > 1:  # row i (absolute t0 + i) sees keys <= t0 + i: mask the upper triangle of the last n columns
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        s[..., t0:].masked_fill_(upper, float("-inf"))
    return s


class _CausalAttentionDropout(torch.autograd.Function):
    """softmax(q k^T * scale + causal) with dropout p, @ v; q, k, v (B, H, T, hd) of one dtype."""

    @staticmethod
    def forward(ctx, q, k, v, p: float, scale: float):
        B, H, T, _ = q.shape
        inv_kept = 1.0 / kept_fraction(p)
        chunks = _chunks(q)
        single = len(chunks) == 1
        out = torch.empty_like(q)
        # One chunk (short sequences): keep its probabilities for backward, as autograd would.
        # Several: keep the log-sum-exp per row (B, H, T) and recompute them chunk by chunk.
        lse = torch.empty(B, H, 0 if single else T, dtype=torch.float32, device=q.device)
        saved = []
        for t0, t1 in chunks:
            s = _scores(q, k, t0, t1, scale)
            if single:
                probs = torch.softmax(s, dim=-1)  # (B, H, T, T)
                saved.append(probs)
                keep = dropout_keep_mask(probs, p)
                dropped = probs * keep
            else:
                lse[:, :, t0:t1] = torch.logsumexp(s, dim=-1)
                dropped = s.sub_(lse[:, :, t0:t1, None]).exp_()  # (B, H, n, t1) probabilities, in place
                keep = dropout_keep_mask(dropped, p)
                dropped.mul_(keep)
            saved.append(keep)
            out[:, :, t0:t1] = torch.matmul(dropped.mul_(inv_kept).to(v.dtype), v[:, :, :t1])
        ctx.p, ctx.scale, ctx.single = p, scale, single
        ctx.save_for_backward(q, k, v, lse, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _CausalAttentionDropout._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, lse, *saved = ctx.saved_tensors
        inv_kept = 1.0 / kept_fraction(ctx.p)
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i, (t0, t1) in enumerate(_chunks(q)):
            g = grad_out[:, :, t0:t1]  # (B, H, n, hd)
            if ctx.single:
                probs, keep = saved[0].clone(), saved[1]
            else:
                keep = saved[i]
                probs = _scores(q, k, t0, t1, ctx.scale).sub_(lse[:, :, t0:t1, None]).exp_()  # (B, H, n, t1)
            scaled_keep = keep * inv_kept  # fp32 (B, H, n, t1): 0 or 1 / kept
            dv[:, :, :t1] += torch.matmul((probs * scaled_keep).to(v.dtype).transpose(-2, -1), g).float()
            dprobs = torch.matmul(g, v[:, :, :t1].transpose(-2, -1)).float().mul_(scaled_keep)
            del scaled_keep
            row_dot = (dprobs * probs).sum(dim=-1, keepdim=True)  # (B, H, n, 1)
            dscores = probs.mul_(dprobs.sub_(row_dot)).mul_(ctx.scale).to(q.dtype)  # softmax backward
            del dprobs
            dq[:, :, t0:t1] = torch.matmul(dscores, k[:, :, :t1])
            dk[:, :, :t1] += torch.matmul(dscores.transpose(-2, -1), q[:, :, t0:t1]).float()
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def causal_attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                             scale: float) -> torch.Tensor:
    """Causal attention with dropout p on the probabilities, in query chunks (see module docstring).

    q, k, v: (B, n_head, T, hd), one dtype (fp32, or bf16/fp16 under autocast: matmuls in that
    dtype, softmax in fp32). Returns (B, n_head, T, hd). Equals
    `dropout(softmax(q k^T * scale + causal mask)) @ v` with masks from `dropout_keep_mask`.
    """
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    with torch.autocast(q.device.type, enabled=False):  # the dtypes are chosen here, explicitly
        return _CausalAttentionDropout.apply(q.to(dtype), k.to(dtype), v.to(dtype), p, scale)
