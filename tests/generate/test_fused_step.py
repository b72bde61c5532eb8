"""The fused CPU decode step (custom_ops/decode_step.cpp, gpt2forge.generate.fused_step) against
CachedLM's own forward, and its place in Generator(compile=True)."""

from __future__ import annotations

import pytest
import torch

from gpt2forge.generate.fused_step import ACTIVATIONS, FusedDecodeStep, _decode_model_class
from gpt2forge.generate.generator import Generator
from gpt2forge.generate.kv_cache import CachedLM
from gpt2forge.generate.sampling import SamplingConfig
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel

pytestmark = pytest.mark.skipif(_decode_model_class() is None,
                                reason="custom ops library not built (run `make`)")

PROMPTS = [[5, 17, 3, 99, 42, 8, 61], [12], [7, 7, 30, 2]]


def model_of(n_head: int = 2, n_embd: int = 32, seed: int = 0, **kw) -> GPT2LMHeadModel:
    cfg = ModelConfig(vocab_size=101, n_positions=48, n_embd=n_embd, n_layer=2, n_head=n_head,
                      vocab_pad_multiple=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    m = GPT2LMHeadModel(cfg)
    m.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # a large spread: every op's error shows in the logits
        gen = torch.Generator().manual_seed(seed + 1)
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return m.eval()


def run_both(model: GPT2LMHeadModel, steps: int = 6):
    """Prefill two caches with the same left-padded prompts, then feed both the same tokens: CachedLM's
    forward on one, the fused step on the other. Yields (reference logits, fused logits, both LMs, slot)."""
    B, P = len(PROMPTS), max(len(p) for p in PROMPTS)
    ref, fused_lm = CachedLM(model, B, P + steps), CachedLM(model, B, P + steps)
    step = FusedDecodeStep.of(fused_lm)
    assert step is not None
    ids = torch.zeros(B, P, dtype=torch.long)
    pad = torch.tensor([P - len(p) for p in PROMPTS])
    for b, p in enumerate(PROMPTS):
        ids[b, P - len(p):] = torch.tensor(p)
    feed = torch.randint(0, 101, (steps, B, 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref(ids, torch.arange(P), pad)
        fused_lm(ids, torch.arange(P), pad)
        for t in range(steps):
            slot = torch.tensor([P + t])
            yield ref(feed[t], slot, pad), step(feed[t], slot, pad), ref, fused_lm, P + t


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("n_head,n_embd", [(2, 32), (2, 128)])  # head sizes 16 and 64 (the AVX2 attention)
def test_fused_step_matches_the_cached_forward(activation: str, n_head: int, n_embd: int):
    model = model_of(n_head, n_embd, activation_function=activation)
    for want, got, ref, fused_lm, slot in run_both(model):
        assert got.dtype == torch.float32 and got.shape == want.shape == (3, 101)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for i in range(2):  # this token's keys and values, written into the fused step's own cache
            for kind in "kv":
                torch.testing.assert_close(getattr(fused_lm, f"{kind}{i}")[:, :, slot],
                                           getattr(ref, f"{kind}{i}")[:, :, slot], rtol=1e-5, atol=1e-5)


def test_fused_step_in_bf16_is_the_bf16_forward_within_bf16_rounding():
    # The fused step keeps activations in fp32 where the eager bf16 forward rounds after every op.
    model = model_of(2, 128).to(torch.bfloat16)
    for want, got, *_ in run_both(model, steps=3):
        scale = want.float().abs().max()
        assert (got - want.float()).abs().max() <= 0.03 * scale


def test_generator_uses_the_fused_step_on_cpu_and_generates_what_the_eager_one_does():
    model = model_of(2, 128)
    eager, fused = Generator(model, 3, 40), Generator(model, 3, 40, compile=True)
    assert eager.fused is None and fused.fused is not None
    greedy = SamplingConfig(greedy=True)
    for prompts in (PROMPTS, PROMPTS[1:], PROMPTS[::-1]):
        assert fused.generate(prompts, 12, greedy).tokens == eager.generate(prompts, 12, greedy).tokens
    with torch.no_grad():  # weights updated in place are seen
        model.transformer.ln_f.weight.mul_(-1.0)
    assert fused.generate(PROMPTS, 12, greedy).tokens == eager.generate(PROMPTS, 12, greedy).tokens


def test_models_the_fused_step_does_not_take_get_none():
    model, no_final_norm = model_of(), model_of()
    no_final_norm.transformer.ln_f = None  # a pipeline stage without the final LayerNorm
    assert FusedDecodeStep.of(CachedLM(no_final_norm, 1, 8)) is None
    assert FusedDecodeStep.of(CachedLM(model, 17, 8)) is None  # more rows than the matmul kernel serves
    assert FusedDecodeStep.of(CachedLM(model, 16, 8)) is not None
    assert FusedDecodeStep.of(CachedLM(model.double(), 1, 8)) is None  # neither fp32 nor bf16


@pytest.mark.parametrize("case,match", [
    ("params", "parameters for 2 layers"),
    ("shape", r"layer 1: parameter 2 has shape \[32, 96\], expected \[96, 32\]"),
    ("activation", "unknown activation 'tanh'"),
    ("token", "token id 500 in row 0 outside the embedding's 112 rows"),
    ("slot", "slot 8 outside the caches' 8 slots"),
    ("rows", r"expected ids \(1, 1\)"),
])
def test_the_decode_model_refuses_bad_arguments(case: str, match: str):
    args = FusedDecodeStep.arguments(CachedLM(model_of(), 1, 8))
    step = FusedDecodeStep(**args)
    ids, slot, pad = torch.tensor([[3]]), torch.tensor([2]), torch.tensor([0])
    with pytest.raises(RuntimeError, match=match):
        if case == "params":
            FusedDecodeStep(**{**args, "params": args["params"][:-2]})
        elif case == "shape":  # layer 1's c_attn weight transposed
            params = list(args["params"])
            params[2 + 12 + 2] = params[2 + 12 + 2].t().contiguous()
            FusedDecodeStep(**{**args, "params": params})
        elif case == "activation":
            FusedDecodeStep(**{**args, "activation": "tanh"})
        elif case == "token":
            step(torch.tensor([[500]]), slot, pad)
        elif case == "slot":
            step(ids, torch.tensor([8]), pad)
        else:
            step(torch.tensor([[3], [4]]), slot, torch.tensor([0, 0]))
