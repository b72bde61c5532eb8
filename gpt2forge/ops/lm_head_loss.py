"""The tied LM head and its loss, fused and chunked: the logits (N, V) are never held.

GPT-2's largest training buffer is its logits: B x T x 50,257 values plus their gradient (1.6 GB
in fp32 at B=8, T=1024). `fused_lm_head_loss` computes the summed cross-entropy, the number of
correct argmax predictions and the number of scored tokens chunk by chunk (rows in chunks of
`token_chunk`, the vocabulary in `vocab_chunks` pieces) and produces the gradients for the hidden
states and the embedding inside the same pass, so backward only scales them.

Two implementations share one contract:
- the C++ op `gpt2forge::lm_head_ce` (custom_ops/lm_head_ce.cpp, CPU, OpenMP), used when the
  custom ops library is built;
- `lm_head_ce_reference`, the same algorithm in PyTorch: the fallback (CUDA tensors, library
  absent: one notice line) and the oracle of tests/ops/test_lm_head_loss.py.

Both are wrapped in one opaque `torch.library.custom_op`, so torch.compile leaves it alone and
autograd sees a single node whose backward is a multiplication.

Flag mapping (reference §2.6): `--embedding-serialization-factor F` -> `vocab_chunks = F`;
`--enable-sequence-serialized --serialized-seq-len S` -> `token_chunk = S` rows of the flattened
(B*T) tokens, which is right for every micro-batch size (the reference's chunked loss only
covered the first sequence of a batch).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from gpt2forge.core.capability import capabilities
from gpt2forge.ops import library as custom_ops

LOGITS_CHUNK_ELEMENTS = 1 << 25
"""Default rows per chunk on the CPU = this / vocabulary-chunk width: about 128 MB of fp32 logits
at a time (667 rows at V = 50,257; fewer, smaller chunks cost more passes over the weight gradient)."""

GPU_LOGITS_CHUNK_ELEMENTS = 1 << 26
"""The same on a GPU, where each chunk also adds a (V, C) weight-gradient term into fp32 and launches
its kernels from Python: 1,280 rows at V = 50,257 (256 MB of fp32 logits, 13 chunks for B=16 x 1,024
tokens), a multiple of GPU_ROW_MULTIPLE. On an H200 chunks of 2,624 rows took less time than the
plain path at about a quarter of its memory (bf16, N=8,192; measured: docs/benchmarks.md, Design
measurements); the quarter is what the fused loss is for."""

GPU_ROW_MULTIPLE = 64
"""A GPU chunk's rows are a multiple of this: the matmuls' M and K dimensions stay tile-aligned."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ALIGN = 8
"""The reference computes logits rows (and vocabulary chunks) a multiple of this many columns
wide, 16 bytes of bf16, over the weight's padding rows, whose columns are masked: cuBLAS runs its
fast kernels only on 16-byte aligned leading dimensions, and GPT-2's odd 50,257 columns sent every
logits matmul of a training step to its legacy kernels (an H200's profile: cutlass_75 s1688 GEMMs)."""


def _columns(weight: torch.Tensor, vocab_size: int) -> int:
    """How many logits columns the reference computes: `vocab_size` rounded up to ALIGN where the
    weight has that many (padding) rows, else `vocab_size`."""
    aligned = -(-vocab_size // ALIGN) * ALIGN
    return aligned if weight.shape[0] >= aligned else vocab_size


@dataclass(frozen=True)
class LossChunking:
    """How `fused_lm_head_loss` splits its work; see the module docstring for the flag mapping."""

    token_chunk: int | None = None
    """Rows (tokens) per chunk; None picks LOGITS_CHUNK_ELEMENTS / vocabulary-chunk width."""
    vocab_chunks: int = 1
    """Vocabulary pieces per row chunk; > 1 trades one extra logits matmul for 1/F the buffer."""

    def rows(self, vocab_size: int, device_type: str = "cpu") -> int:
        """Rows per chunk on a device of `device_type` ("cpu", "cuda", ...)."""
        if self.token_chunk is not None:
            return self.token_chunk
        width = math.ceil(vocab_size / self.vocab_chunks)
        if device_type == "cpu":
            return max(1, LOGITS_CHUNK_ELEMENTS // width)
        return max(GPU_ROW_MULTIPLE, GPU_LOGITS_CHUNK_ELEMENTS // width // GPU_ROW_MULTIPLE * GPU_ROW_MULTIPLE)


def lm_head_ce_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         ignore_index: int, token_chunk: int, vocab_chunks: int,
                         compute_dtype: torch.dtype | None, compute_grad: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch version of `gpt2forge::lm_head_ce`, same arguments and results.

    hidden (N, C), weight (V_pad, C), labels (N,) int64 with ignore_index where not scored.
    Returns stats (3,) fp32 = [loss sum, correct, scored], grad_hidden (N, C) like hidden and
    grad_weight (V_pad, C) fp32, the last two empty without compute_grad.
    """
    cdt = compute_dtype or hidden.dtype
    N, C = hidden.shape
    V = vocab_size
    bad = ((labels != ignore_index) & ((labels < 0) | (labels >= V))).any()
    message = f"gpt2forge::lm_head_ce: a label is outside [0, {V}) and is not ignore_index {ignore_index}"
    if labels.is_cuda:  # checked on the device: no host sync per call
        torch._assert_async(~bad, message)
    elif bool(bad):
        raise ValueError(message)
    Vc = _columns(weight, V)  # logits columns computed: V, or V aligned with the columns >= V masked
    width = -(-math.ceil(V / vocab_chunks) // ALIGN) * ALIGN  # columns per vocabulary chunk
    W = weight[:Vc].to(cdt)  # (Vc, C): padding rows past Vc are never computed
    f32 = dict(device=hidden.device, dtype=torch.float32)
    stats = torch.zeros(3, **f32)
    grad_hidden = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, **f32) if compute_grad else weight.new_empty(0, dtype=torch.float32)
    for t0 in range(0, N, token_chunk):
        h = hidden[t0:t0 + token_chunk].to(cdt)  # (n, C)
        y = labels[t0:t0 + token_chunk]
        n = h.shape[0]
        gh = torch.zeros(n, C, **f32) if compute_grad else None
        if width >= V:
            # One vocabulary chunk: the logits are computed once and turned into their gradient
            # (3 matmuls in all, as the plain path); on CUDA by one compiled kernel pass.
            loss, correct, scored, d = _xent_rows_fn(h.device)(h @ W.T, y, ignore_index, compute_grad, V)
            stats += torch.stack((loss, correct, scored))
            if compute_grad:
                _add_grads(d, h, W, gh, grad_weight[:Vc])
                grad_hidden[t0:t0 + n] = gh
            continue
        keep = y != ignore_index
        row_max = torch.full((n,), float("-inf"), **f32)
        row_sum = torch.zeros(n, **f32)
        best = torch.full((n,), float("-inf"), **f32)
        argmax = torch.zeros(n, dtype=torch.long, device=h.device)
        label_logit = torch.zeros(n, **f32)
        for v0 in range(0, Vc, width):
            logits = (h @ W[v0:v0 + width].T).float()  # (n, vlen)
            logits[:, V - v0:] = float("-inf")  # the padding columns of the last chunk, if any
            chunk_max, chunk_arg = logits.max(dim=1)
            better = chunk_max > best  # earlier chunks win ties, as torch.argmax does
            best = torch.where(better, chunk_max, best)
            argmax = torch.where(better, chunk_arg + v0, argmax)
            new_max = torch.maximum(row_max, chunk_max)
            row_sum = row_sum * torch.exp(row_max - new_max) + torch.exp(logits - new_max[:, None]).sum(1)
            row_max = new_max
            inside = (y >= v0) & (y < v0 + logits.shape[1])
            col = (y - v0).clamp(0, logits.shape[1] - 1)
            label_logit = torch.where(inside, logits.gather(1, col[:, None]).squeeze(1), label_logit)
        lse = row_max + torch.log(row_sum)
        stats[0] += torch.where(keep, lse - label_logit, 0.0).sum()
        stats[1] += ((argmax == y) & keep).sum()
        stats[2] += keep.sum()
        if not compute_grad:
            continue
        for v0 in range(0, Vc, width):  # several vocabulary chunks: recompute each one's logits
            Wv = W[v0:v0 + width]
            probs = (h @ Wv.T).float().sub_(lse[:, None]).exp_()  # (n, vlen) softmax
            probs[:, V - v0:] = 0.0  # padding columns
            inside = keep & (y >= v0) & (y < v0 + Wv.shape[0])
            rows = inside.nonzero().squeeze(1)
            probs[rows, y[rows] - v0] -= 1.0
            probs *= keep[:, None]
            _add_grads(probs.to(cdt), h, Wv, gh, grad_weight[v0:v0 + Wv.shape[0]])
        grad_hidden[t0:t0 + n] = gh
    return stats, grad_hidden, grad_weight


def _add_grads(d: torch.Tensor, h: torch.Tensor, Wv: torch.Tensor, gh: torch.Tensor, gw: torch.Tensor) -> None:
    """gh (n, C) += d @ Wv and gw (vlen, C) += d.T @ h for d (n, vlen), h (n, C), Wv (vlen, C) of
    one dtype; gh and gw are fp32 (in place: no (vlen, C) temporary when the inputs are fp32; in
    bf16/fp16 the products are widened element by element as they are added, with no fp32 copy of
    them: the same sums)."""
    if d.dtype == torch.float32:
        gh.addmm_(d, Wv)
        gw.addmm_(d.T, h)
    else:
        gh.add_(d @ Wv)
        gw.add_(d.T @ h)


def xent_rows(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, compute_grad: bool,
              vocab_size: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cross-entropy of logits (n, V) (any float dtype; fp32 math) against labels (n,); with
    `vocab_size` < V, the columns from `vocab_size` on are padding: no probability, zero gradient.

    Returns the loss sum, the number of rows whose argmax is the label and the number of scored
    rows (fp32 scalars), and with compute_grad d(loss sum)/d(logits) = (softmax - one-hot) on the
    scored rows, (n, V) in the logits' dtype (else None).
    """
    x = logits.float()
    if vocab_size is not None and vocab_size < x.shape[1]:
        x = x.masked_fill(torch.arange(x.shape[1], device=x.device) >= vocab_size, float("-inf"))
    keep = labels != ignore_index
    label = torch.where(keep, labels, 0)
    lse = torch.logsumexp(x, dim=1)  # (n,)
    loss = torch.where(keep, lse - x.gather(1, label[:, None]).squeeze(1), 0.0).sum()
    correct = ((x.argmax(dim=1) == labels) & keep).sum().float()
    scored = keep.sum().float()
    if not compute_grad:
        return loss, correct, scored, None
    grad = torch.exp(x - lse[:, None])  # (n, V) softmax
    grad.scatter_add_(1, label[:, None], -keep[:, None].float())  # minus the one-hot of scored rows
    return loss, correct, scored, grad.mul_(keep[:, None]).to(logits.dtype)


@functools.cache
def _compiled_xent_rows():
    return torch.compile(xent_rows, dynamic=True)


def _xent_rows_fn(device: torch.device):
    """`xent_rows` compiled where the device's `capabilities` say so, CUDA (one fused reduction and
    one pointwise kernel instead of ~6 passes over the logits chunk); eager elsewhere, where it is
    the reference."""
    return _compiled_xent_rows() if capabilities(device).compiled_xent_rows else xent_rows


def _use_kernel(hidden: torch.Tensor) -> bool:
    return hidden.device.type == "cpu" and custom_ops.has_op("lm_head_ce")


@torch.library.custom_op("gpt2forge_py::fused_lm_head_ce", mutates_args=())
def _fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int,
           token_chunk: int, vocab_chunks: int, compute_dtype: str, compute_grad: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cdt = _DTYPES[compute_dtype]
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen explicitly
        if _use_kernel(hidden):
            return torch.ops.gpt2forge.lm_head_ce(hidden, weight, labels, vocab_size, ignore_index, token_chunk,
                                                  vocab_chunks, cdt, compute_grad)
        return lm_head_ce_reference(hidden, weight, labels, vocab_size, ignore_index, token_chunk, vocab_chunks,
                                    cdt, compute_grad)


@_fused.register_fake
def _(hidden, weight, labels, vocab_size, ignore_index, token_chunk, vocab_chunks, compute_dtype, compute_grad):
    stats = hidden.new_empty(3, dtype=torch.float32)
    if not compute_grad:
        return stats, hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return stats, torch.empty_like(hidden), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    ctx.weight_dtype = inputs[1].dtype  # (hidden, weight, labels, ...)
    ctx.save_for_backward(output[1], output[2])


def _backward(ctx, grad_stats, _grad_gh, _grad_gw):
    gh, gw = ctx.saved_tensors
    if gh.numel() == 0:
        raise RuntimeError("fused_lm_head_loss was called without compute_grad but is being differentiated")
    g = grad_stats[0]  # only the loss sum is differentiable; correct and scored are counts
    return (gh * g.to(gh.dtype), (gw * g).to(ctx.weight_dtype), None, None, None, None, None, None, None)


_fused.register_autograd(_backward, setup_context=_setup_context)


def fused_lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                       ignore_index: int = -100, chunking: LossChunking = LossChunking()
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of `hidden @ weight[:vocab_size].T` against `labels`, chunked.

    Args:
        hidden: (N, C) final hidden states, any float dtype (the fp32 LayerNorm output under autocast).
        weight: (V_pad, C) the tied embedding; rows >= vocab_size (padding) never get probability.
        labels: (N,) int64, `ignore_index` where a position is not scored.
    Returns:
        loss_sum (fp32 scalar, differentiable), correct (fp32 count of argmax == label), tokens
        (fp32 count of scored rows). Under autocast the matmuls run in the autocast dtype.
    Raises:
        ValueError: a label outside [0, vocab_size) other than ignore_index.
    """
    device = hidden.device.type
    cdt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    stats, _, _ = _fused(hidden, weight, labels, vocab_size, ignore_index, chunking.rows(vocab_size, device),
                         chunking.vocab_chunks, str(cdt).removeprefix("torch."), compute_grad)
    # The loss is a copy, not the view stats[0]: FSDP2 hooks a wrapped module's outputs for backward,
    # and a view's in-place use would drop that hook (torch warns once per forward under --offload full).
    return stats[0].clone(), stats[1].detach(), stats[2].detach()
