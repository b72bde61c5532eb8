"""Running a model over the protocols' windows and examples, in batches, with no wasted logits.

The LM head (a (C, vocab) matmul, about a third of GPT-2 small's forward FLOPs per token) and the
fp32 log-softmax run only on the positions a protocol scores: the transformer's hidden states are
gathered at those positions first, then projected in chunks of `HEAD_CHUNK` rows so memory stays
bounded whatever the batch. Sequences in a batch are right-padded; with causal attention padding
after a position never changes its output.

Any model works: ours (`transformer` + `logits`, the fast path above), or any module whose output
(or its `.logits`) is (B, T, vocab) logits, e.g. `transformers.GPT2LMHeadModel` or a test's mock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.core.precision import autocast
from gpt2forge.evaluation.protocol import (
    ClozeExample,
    ClozeResult,
    PageResult,
    PerplexityResult,
    Window,
    WindowPlan,
    lm_eval_words,
    rolling_windows,
)

HEAD_CHUNK = 1024  # scored positions per LM-head matmul: 1024 x 50304 fp32 logits = 206 MB at most


@dataclass
class BatchScores:
    """Per-row sums over the scored positions of a batch (CPU tensors)."""

    nll: torch.Tensor  # (B,) float64, nats
    correct: torch.Tensor  # (B,) int64, positions whose argmax is the target
    scored: torch.Tensor  # (B,) int64


def _scored_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Iterator[torch.Tensor]:
    """Logits (n, vocab) of the positions where `mask` (B, T) is True, in row-major order, in chunks."""
    if hasattr(model, "transformer") and hasattr(model, "logits"):
        # Only the columns from the batch's first scored one on need final hidden states: with
        # overlapping windows (stride 32 of 1024) the last block then runs its MLP for 32 rows.
        first = int(mask.any(dim=0).int().argmax())
        hidden = model.transformer(ids, last=ids.shape[1] - first)[mask[:, first:]]  # (B, T', C) -> (n, C)
        for i in range(0, hidden.shape[0], HEAD_CHUNK):
            yield model.logits(hidden[i:i + HEAD_CHUNK])
        return
    out = model(ids)
    yield getattr(out, "logits", out)[mask]  # (B, T, V) -> (n, V)


@torch.no_grad()
def score_batch(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                precision: str = "fp32") -> BatchScores:
    """Sum of target NLL, argmax hits and scored count per row.

    ids (B, T) int64 on the model's device; targets (B, T) int64, IGNORE_INDEX where not scored.
    The head runs under autocast in `precision`; log-softmax and argmax are taken in fp32.
    """
    mask = targets != IGNORE_INDEX
    tgt = targets[mask]  # (n,)
    nll, hits, done = [], [], 0
    with autocast(ids.device, precision):
        for logits in _scored_logits(model, ids, mask):
            logits = logits.float()
            t = tgt[done:done + logits.shape[0]]
            done += logits.shape[0]
            nll.append(F.cross_entropy(logits, t, reduction="none"))
            hits.append(logits.argmax(-1) == t)
    rows = mask.nonzero()[:, 0].cpu()  # row of each scored position, row-major like the gather
    B = ids.shape[0]
    nll_rows = torch.zeros(B, dtype=torch.float64).index_add_(0, rows, torch.cat(nll).double().cpu())
    hit_rows = torch.zeros(B, dtype=torch.int64).index_add_(0, rows, torch.cat(hits).long().cpu())
    return BatchScores(nll_rows, hit_rows, mask.sum(1).cpu())


def _pad_batch(inputs: Sequence[np.ndarray], targets: Sequence[np.ndarray], device: torch.device,
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ragged rows to one (B, T_max) batch: inputs with pad_id, targets with IGNORE_INDEX."""
    T = max(len(x) for x in inputs)
    ids = np.full((len(inputs), T), pad_id, dtype=np.int64)
    tgt = np.full((len(inputs), T), IGNORE_INDEX, dtype=np.int64)
    for b, (x, y) in enumerate(zip(inputs, targets)):
        ids[b, :len(x)] = x
        tgt[b, :len(y)] = y
    return torch.from_numpy(ids).to(device), torch.from_numpy(tgt).to(device)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def score_windows(model: torch.nn.Module, tokens: np.ndarray, windows: Sequence[Window], precision: str = "fp32",
                  pad_id: int = 0) -> BatchScores:
    """One batch: each window's scored targets (its last `scored`; the rest of it is context only)."""
    inputs = [tokens[w.start:w.start + w.length] for w in windows]
    targets = []
    for w in windows:
        t = tokens[w.start + 1:w.start + w.length + 1].copy()
        t[: w.length - w.scored] = IGNORE_INDEX
        targets.append(t)
    return score_batch(model, *_pad_batch(inputs, targets, _device(model), pad_id), precision=precision)


def evaluate_stream(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, stride: int, *,
                    batch_size: int = 8, precision: str = "fp32", num_original_tokens: int | None = None,
                    max_windows: int | None = None, pad_id: int = 0, progress: bool = True,
                    desc: str = "perplexity") -> PerplexityResult:
    """Perplexity of `tokens` (1-D ids) under the overlapping-window protocol (see protocol.WindowPlan).

    max_windows: score only the first windows (a quick look; the result then covers fewer tokens and
    num_tokenized_tokens is the scored count + 1, so its perplexities describe exactly what was scored).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    plan = WindowPlan(len(tokens), seq_len, stride)
    n = len(plan) if max_windows is None else min(len(plan), max_windows)
    loss_sum, correct, scored = 0.0, 0, 0
    bar = tqdm(total=n, desc=desc, unit="win", disable=not progress, dynamic_ncols=True)
    for first in range(0, n, batch_size):
        windows = [plan[i] for i in range(first, min(first + batch_size, n))]
        scores = score_windows(model, tokens, windows, precision=precision, pad_id=pad_id)
        loss_sum += float(scores.nll.sum())
        correct += int(scores.correct.sum())
        scored += int(scores.scored.sum())
        bar.update(len(windows))
        bar.set_postfix(loss=f"{loss_sum / max(scored, 1):.4f}")
    bar.close()
    if max_windows is None:
        assert scored == plan.scored_tokens, (scored, plan.scored_tokens)
    return PerplexityResult(loss_sum, scored, scored + 1 if max_windows is not None else len(tokens),
                            num_original_tokens if max_windows is None else None, correct, n)


def evaluate_pages(model: torch.nn.Module, pages: Sequence[str], encode, eot_id: int, seq_len: int, *,
                   detokenize=lambda text: text, batch_size: int = 8, precision: str = "fp32", pad_id: int = 0,
                   progress: bool = True) -> PageResult:
    """lm-eval's `wikitext` protocol: each page detokenized, encoded after `eot_id` and scored with
    `rolling_windows`; words and bytes are counted on the page before detokenization."""
    loss_sum, scored = 0.0, 0
    bar = tqdm(total=len(pages), desc="pages", unit="page", disable=not progress, dynamic_ncols=True)
    for page in pages:
        tokens = np.asarray([eot_id, *encode(detokenize(page))], dtype=np.int64)
        windows = rolling_windows(len(tokens), seq_len)
        for first in range(0, len(windows), batch_size):
            scores = score_windows(model, tokens, windows[first:first + batch_size], precision=precision,
                                   pad_id=pad_id)
            loss_sum += float(scores.nll.sum())
            scored += int(scores.scored.sum())
        bar.update(1)
    bar.close()
    return PageResult(loss_sum, scored, sum(lm_eval_words(p) for p in pages),
                      sum(len(p.encode("utf-8")) for p in pages), len(pages))


def evaluate_cloze(model: torch.nn.Module, examples: Sequence[ClozeExample], strict: bool, *,
                   batch_size: int = 8, precision: str = "fp32", pad_id: int = 0, progress: bool = True,
                   desc: str = "lambada") -> ClozeResult:
    """Cloze accuracy and target NLL over `examples` (already fitted to the window length).

    Examples are batched in order of length (less padding); the result does not depend on the order.
    """
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].context) + len(examples[i].target))
    device = _device(model)
    correct = target_tokens = 0
    loss_sum = 0.0
    bar = tqdm(total=len(examples), desc=desc, unit="ex", disable=not progress, dynamic_ncols=True)
    for chunk in _chunks(order, batch_size):
        inputs, targets = [], []
        for i in chunk:
            ex = examples[i]
            seq = np.asarray(ex.context + ex.target, dtype=np.int64)
            t = seq[1:].copy()
            t[: len(t) - len(ex.target)] = IGNORE_INDEX
            inputs.append(seq[:-1])
            targets.append(t)
        scores = score_batch(model, *_pad_batch(inputs, targets, device, pad_id), precision=precision)
        correct += int((scores.correct == scores.scored).sum())  # every target token greedy-correct
        loss_sum += float(scores.nll.sum())
        target_tokens += int(scores.scored.sum())
        bar.update(len(chunk))
        bar.set_postfix(acc=f"{correct / max(bar.n, 1):.4f}")
    bar.close()
    truncated = sum(1 for ex in examples if ex.truncated)
    return ClozeResult(correct, len(examples), loss_sum, target_tokens, truncated, strict)


def _chunks(items: Sequence[int], size: int) -> Iterable[Sequence[int]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
