"""Sampling from a trained model (the short sample printed after training).

A plain loop that re-runs the (cropped) context each step; the interactive generator with a
pre-allocated KV cache is `text_generate_gpt2.py`'s job.
"""

from __future__ import annotations

import torch

from .model import GPT2LMHeadModel


@torch.no_grad()
def sample(model: GPT2LMHeadModel, prompt_ids: list[int], new_tokens: int, temperature: float = 0.8,
           top_k: int = 40, generator: torch.Generator | None = None, stop_id: int | None = None) -> list[int]:
    """Append up to `new_tokens` ids drawn from softmax(logits / temperature) over the top_k ids.

    Returns only the generated ids (stops early at stop_id, which is not included).
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    out: list[int] = []
    n_ctx = model.config.n_positions
    for _ in range(new_tokens):
        logits = model(ids[:, -n_ctx:])[0, -1].float()  # (padded_vocab,), padded ids at -inf
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1)
            next_id = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        if next_id == stop_id:
            break
        out.append(next_id)
        ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
    model.train(was_training)
    return out
