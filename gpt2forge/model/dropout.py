"""Dropout: cheap keep-masks, and causal attention with dropout computed in query chunks.

On CUDA, SDPA's flash kernel applies attention dropout inside the kernel. On CPU no fused SDPA
kernel takes a dropout probability, and the spelled-out math holds several (B, n_head, T, T) fp32
tensors per layer (403 MB each at B=8, T=1024, 12 heads). `causal_attention_dropout` computes the
same function a block of query rows at a time (the flash-attention recurrence: backward
recomputes the probabilities from the saved log-sum-exp), skips the keys a causal row never sees
(about half the matmul work at long T), and keeps only the bool masks and the row log-sum-exp
between forward and backward. A sequence whose whole score matrix fits one chunk's budget keeps
its probabilities instead (recomputing them would cost more time than the memory is worth), still
in a few query chunks so that most of the causal upper triangle is skipped. With packed documents
(--reset-attention-mask) the mask is block-causal and a chunk also skips the keys before the
earliest document start of its rows, so short documents cost less than one long one.
"""

from __future__ import annotations

import torch

from gpt2forge.ops.library import has_op

DROP_BITS = 15
"""Random bits per dropout decision: p is rounded to a multiple of 2**-15 (0.1 -> 0.100006)."""

ATTENTION_CHUNK_ELEMENTS = 1 << 23
"""Score elements per query chunk (B * n_head * rows * keys): 32 MB of fp32 at a time."""

CAUSAL_CHUNKS = 4
"""Query chunks of a sequence whose probabilities are kept (GPT-2 small, B=4, T=256: 64 rows each)."""


@torch.library.custom_op("gpt2forge::dropout_keep_mask", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def dropout_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Bool mask shaped like `x`, True (keep) with probability 1 - round(p * 2**15) / 2**15, drawn
    from torch's generator.

    On CPU with the custom ops library, the C++ op `gpt2forge::dropout_mask` draws them on every
    thread from one 63-bit seed taken from torch's generator (custom_ops/dropout_mask.cpp). Else each
    32-bit draw of torch's generator decides two elements (int32 `random_()` gives 31 uniform bits,
    viewed as two int16 of which the low 15 bits are used): half the draws of
    `torch.rand(x.shape) >= p`, whose mask drawing is a visible part of a GPT-2 small training step
    on a 2-core CPU (ATen's CPU generator runs on one thread) and shrinks with the halving. An
    opaque op on purpose: torch.compile then calls it instead of inlining its own per-element
    Philox generator, which on CPU costs several times more per element (measured:
    docs/benchmarks.md, Design measurements). Compiled and eager runs draw the same masks
    from the same seed.
    """
    n = x.numel()
    threshold = round(p * (1 << DROP_BITS))
    if x.device.type == "cpu" and has_op("dropout_mask"):
        seed = int(torch.empty((), dtype=torch.int64).random_())
        return torch.ops.gpt2forge.dropout_mask(n, threshold, seed).view(x.shape)
    bits = torch.empty((n + 1) // 2, dtype=torch.int32, device=x.device).random_().view(torch.int16)
    keep = (bits[:n] & ((1 << DROP_BITS) - 1)) >= threshold
    return keep.view(x.shape)


@dropout_keep_mask.register_fake
def _(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


def kept_fraction(p: float) -> float:
    """The probability that `dropout_keep_mask(x, p)` keeps an element."""
    return 1.0 - round(p * (1 << DROP_BITS)) / (1 << DROP_BITS)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """On the CPU, F.dropout with p rounded to a multiple of 2**-15 (`dropout_keep_mask`): zero with
    that probability, the rest scaled by 1 / (1 - it), so the expectation stays exactly x. On other
    devices F.dropout itself: compiled, inductor draws its Philox mask inside the fused pointwise
    kernel, where the opaque mask op would write and re-read a mask per call."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return torch.nn.functional.dropout(x, p, True)
    kept = kept_fraction(p)
    if kept <= 0.0:
        return torch.zeros_like(x)
    return x * dropout_keep_mask(x, p) * (1.0 / kept)


def _keeps_probabilities(q: torch.Tensor) -> bool:
    """Whether the whole (B, H, T, T) score matrix fits ATTENTION_CHUNK_ELEMENTS: then forward keeps
    the probabilities for backward (recomputing them would cost more time than the memory is worth)."""
    B, H, T, _ = q.shape
    return B * H * T * T <= ATTENTION_CHUNK_ELEMENTS


def _chunks(q: torch.Tensor) -> list[tuple[int, int]]:
    """Query row ranges [t0, t1), a multiple of 16 rows each: about ATTENTION_CHUNK_ELEMENTS scores
    each, or, when the probabilities are kept, CAUSAL_CHUNKS of them (chunk i needs the keys up to
    its last row only: 4 chunks compute 10/16 of the square)."""
    B, H, T, _ = q.shape
    if _keeps_probabilities(q):
        per = -(-T // CAUSAL_CHUNKS)
        rows = max(16, (per + 15) // 16 * 16)
    else:
        rows = max(16, ATTENTION_CHUNK_ELEMENTS // max(1, B * H * T) // 16 * 16)
    return [(t0, min(T, t0 + rows)) for t0 in range(0, T, rows)]


def _scores(q: torch.Tensor, k: torch.Tensor, t0: int, t1: int, scale: float, k0: int = 0,
            documents: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled causal scores of query rows t0..t1-1 against keys k0..t1-1, fp32 (B, H, t1-t0, t1-k0);
    with `documents` (B, T) document ids, keys of another document than the query's are -inf too."""
    s = torch.matmul(q[:, :, t0:t1], k[:, :, k0:t1].transpose(-2, -1)).float().mul_(scale)
    n = t1 - t0
    if n > 1:  # row i (absolute t0 + i) sees keys <= t0 + i: mask the upper triangle of the last n columns
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        s[..., t0 - k0:].masked_fill_(upper, float("-inf"))
    if documents is not None:  # (B, 1, n, t1-k0): True where the key is in another document
        other = documents[:, t0:t1, None] != documents[:, None, k0:t1]
        s.masked_fill_(other.unsqueeze(1), float("-inf"))
    return s


def _key_plan(chunks: list[tuple[int, int]], starts: torch.Tensor | None) -> list[tuple[int, bool]]:
    """Per query chunk: the first key it needs, and whether it needs the document mask.

    Without documents: (0, False). With them (`starts`: (B, T), each token's document start), the
    first key is the lowest document start of the chunk's first row over the batch (the keys before
    it are masked for every row: skipped), and the mask is needed unless every row's document
    starts at or before that key (then all the chunk's keys up to each row are in its document:
    causal alone is exact). Compiled: (0, True) for every chunk (static shapes, no host sync)."""
    if starts is None:
        return [(0, False)] * len(chunks)
    if torch.compiler.is_compiling():
        return [(0, True)] * len(chunks)
    first = starts[:, [t0 for t0, _ in chunks]].amin(dim=0).tolist()
    last = starts[:, [t1 - 1 for _, t1 in chunks]].amax(dim=0).tolist()
    return [(k0, latest > k0) for k0, latest in zip(first, last)]


class _CausalAttentionDropout(torch.autograd.Function):
    """softmax(q k^T * scale + causal) with dropout p, @ v; q, k, v (B, H, T, hd) of one dtype."""

    @staticmethod
    def forward(ctx, q, k, v, p: float, scale: float, documents=None, starts=None):
        B, H, T, _ = q.shape
        inv_kept = 1.0 / kept_fraction(p)
        chunks = _chunks(q)
        plan = _key_plan(chunks, starts)
        keeps = _keeps_probabilities(q)
        if keeps:  # every chunk from key 0 (keys it would skip are masked instead): eager then draws
            plan = [(0, masked or k0 > 0) for k0, masked in plan]  # the masks the compiled step draws
        out = torch.empty_like(q)
        # Short sequences: keep each chunk's probabilities for backward, as autograd would. Long
        # ones: keep the log-sum-exp per row (B, H, T) and recompute them chunk by chunk.
        lse = torch.empty(B, H, 0 if keeps else T, dtype=torch.float32, device=q.device)
        saved = []
        for (t0, t1), (k0, masked) in zip(chunks, plan):
            s = _scores(q, k, t0, t1, scale, k0, documents if masked else None)
            if keeps:
                probs = torch.softmax(s, dim=-1)  # (B, H, n, t1 - k0)
                saved.append(probs)
                keep = dropout_keep_mask(probs, p)
                dropped = probs * keep
            else:
                lse[:, :, t0:t1] = torch.logsumexp(s, dim=-1)
                dropped = s.sub_(lse[:, :, t0:t1, None]).exp_()  # (B, H, n, t1) probabilities, in place
                keep = dropout_keep_mask(dropped, p)
                dropped.mul_(keep)
            saved.append(keep)
            out[:, :, t0:t1] = torch.matmul(dropped.mul_(inv_kept).to(v.dtype), v[:, :, k0:t1])
        ctx.p, ctx.scale, ctx.keeps, ctx.plan = p, scale, keeps, plan
        ctx.has_documents = documents is not None
        ctx.save_for_backward(q, k, v, lse, *([documents] if documents is not None else []), *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _CausalAttentionDropout._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, lse, *saved = ctx.saved_tensors
        documents = saved.pop(0) if ctx.has_documents else None
        inv_kept = 1.0 / kept_fraction(ctx.p)
        grad_out = grad_out.contiguous()
        if ctx.keeps:
            return (*_kept_backward(q, k, v, saved, grad_out, ctx.scale, inv_kept), None, None, None, None)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i, ((t0, t1), (k0, masked)) in enumerate(zip(_chunks(q), ctx.plan)):
            probs = _scores(q, k, t0, t1, ctx.scale, k0, documents if masked else None)
            probs = probs.sub_(lse[:, :, t0:t1, None]).exp_()  # (B, H, n, t1 - k0)
            dq[:, :, t0:t1], dk_c, dv_c = _chunk_backward(probs, saved[i], grad_out[:, :, t0:t1], q[:, :, t0:t1],
                                                          k[:, :, k0:t1], v[:, :, k0:t1], ctx.scale, inv_kept)
            dk[:, :, k0:t1] += dk_c
            dv[:, :, k0:t1] += dv_c
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _chunk_backward(probs, keep, g, q, k, v, scale: float, inv_kept: float):
    """One query chunk's gradients: probs (B, H, n, m) fp32 (overwritten), keep its dropout mask,
    g (B, H, n, hd) the output's gradient, q (B, H, n, hd) its rows, k, v (B, H, m, hd) the keys it
    saw. Returns dq (B, H, n, hd) in q's dtype, and dk, dv (B, H, m, hd) in fp32."""
    scaled_keep = keep * inv_kept  # fp32 (B, H, n, m): 0 or 1 / kept
    dv = torch.matmul((probs * scaled_keep).to(v.dtype).transpose(-2, -1), g).float()
    dprobs = torch.matmul(g, v.transpose(-2, -1)).float().mul_(scaled_keep)
    del scaled_keep
    row_dot = (dprobs * probs).sum(dim=-1, keepdim=True)  # (B, H, n, 1)
    dscores = probs.mul_(dprobs.sub_(row_dot)).mul_(scale).to(q.dtype)  # softmax backward
    del dprobs
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-2, -1), q).float(), dv


def _kept_backward(q, k, v, saved, grad_out, scale: float, inv_kept: float):
    """Backward from the kept probabilities: every chunk saw keys 0 .. its last row (forward's plan
    starts each at key 0), so the key block of chunk j gets the gradients of chunks j, j+1, ...;
    each block is summed on its own and the blocks concatenated (accumulating into slices of zero
    tensors instead compiles, on CPU, to one masked kernel, several times slower than the sums and
    the concatenation in a profiled GPT-2 small step: docs/benchmarks.md, Design measurements)."""
    chunks = _chunks(q)
    dq, dk, dv = [], [], []
    for i, (t0, t1) in enumerate(chunks):
        probs, keep = saved[2 * i].clone(), saved[2 * i + 1]
        dq_c, dk_c, dv_c = _chunk_backward(probs, keep, grad_out[:, :, t0:t1], q[:, :, t0:t1], k[:, :, :t1],
                                           v[:, :, :t1], scale, inv_kept)
        dq.append(dq_c)
        dk.append(dk_c)
        dv.append(dv_c)

    def by_key_block(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        blocks = []
        for j, (a, b) in enumerate(chunks):
            block = parts[j][:, :, a:b]
            for part in parts[j + 1:]:
                block = block + part[:, :, a:b]
            blocks.append(block)
        return torch.cat(blocks, dim=2).to(dtype)

    return torch.cat(dq, dim=2), by_key_block(dk, k.dtype), by_key_block(dv, v.dtype)


def causal_attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                             scale: float, documents: torch.Tensor | None = None,
                             starts: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention with dropout p on the probabilities, in query chunks (see module docstring).

    q, k, v: (B, n_head, T, hd), one dtype (fp32, or bf16/fp16 under autocast: matmuls in that
    dtype, softmax in fp32). Returns (B, n_head, T, hd). Equals
    `dropout(softmax(q k^T * scale + causal mask)) @ v` with masks from `dropout_keep_mask`.
    `documents` (B, T) document ids: block-causal instead (a query sees its own document only);
    with `starts` (B, T), each token's document start, a query chunk skips the keys before the
    lowest start of its rows (short documents: most of the causal triangle).
    """
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    # Contiguous (B, H, T, hd) once: q, k, v arrive as strided views of the fused projection, and a
    # batched matmul of a view's query chunk or key block copies it first, the keys once per chunk
    # (measured on GPT-2 small's compiled training step: docs/benchmarks.md, Design measurements).
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):  # the dtypes are chosen here, explicitly
        return _CausalAttentionDropout.apply(q, k, v, p, scale, documents, starts)
