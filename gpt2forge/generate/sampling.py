"""Choosing the next token from logits: greedy, or sampling with repetition penalty, temperature,
top-k and top-p, applied in that order (the order of Hugging Face's logits processors).

Unlike the reference (which picked one of the top k uniformly), sampling draws from the
renormalised probabilities. Ids at or above `vocab_size` (embedding padding) are cut off before
anything else, so they are never chosen.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from gpt2forge.core.errors import UsageError, collect
from gpt2forge.ops import library as custom_ops


@dataclasses.dataclass
class SamplingConfig:
    """How the next token is chosen."""

    greedy: bool = False
    """Always take the most likely token (after the repetition penalty)."""
    temperature: float = 1.0
    """Divide the logits by this (> 0); below 1 sharpens, above 1 flattens."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1 = all)."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in the sequence by this (1 = off)."""

    def __post_init__(self) -> None:
        problems = []
        if not 0 < self.temperature < math.inf:
            problems.append(f"--temperature must be a finite number > 0 (got {self.temperature}); use --greedy for "
                            "argmax")
        if self.top_k < 0:
            problems.append(f"--topk must be >= 0 (got {self.top_k}); 0 keeps every token")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not 0 < self.repetition_penalty < math.inf:
            problems.append(f"--repetition-penalty must be a finite number > 0 (got {self.repetition_penalty}); "
                            "1 is off")
        collect(problems)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (B, V); seen (B, V) bool marks tokens already in each row's sequence (HF/CTRL rule)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the most likely tokens until their probability mass reaches p.

    A token is dropped when the tokens ranked above it already hold at least p; the most likely
    token is always kept.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) probability of the better-ranked tokens
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of (B, V) logits: on CPU fp32 through gpt2forge::argmax_rows
    (custom_ops/argmax.cpp), faster than ATen's for a GPT-2 row straight after the LM head's call
    (measured: docs/benchmarks.md, Design measurements), with the same indices, NaN and ties
    included."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and custom_ops.has_op("argmax_rows"):
        return torch.ops.gpt2forge.argmax_rows(logits)
    return logits.argmax(dim=-1)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, vocab_size: int, seen: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next id of each row, (B,) int64, from logits (B, >= vocab_size) in any float dtype.

    `seen` (B, vocab_size) bool feeds the repetition penalty; `generator` makes sampling
    reproducible (it may live on another device than the logits: the draw happens there).
    """
    logits = logits[:, :vocab_size].float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if cfg.greedy:
        return argmax_rows(logits)
    logits = filter_top_p(filter_top_k(logits / cfg.temperature, cfg.top_k), cfg.top_p)
    probs = logits.softmax(dim=-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator)[:, 0].to(logits.device)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    """UsageError when a token id is outside [0, vocab_size)."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"{what}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size}); "
                         "use the tokenizer the checkpoint was trained with")
