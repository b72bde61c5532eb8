"""The inputs of tests/ops/test_isa_paths.py, and the custom ops' outputs on them on this process's
instruction-set path: that test runs this file as a script once per path, GPT2FORGE_OPS_ISA set, and compares
what each run saved (`python tests/ops/isa_path_outputs.py OUT.pt`). The inputs are the same in every process
(fixed seeds); the test builds its references from them.
"""

from __future__ import annotations

import sys

import torch

from gpt2forge.ops import library as custom_ops

NAN, INF = float("nan"), float("inf")

GEMV_SHAPES = [(1, 1, 5), (1, 7, 9), (1, 17, 33), (1, 771, 129), (2, 19, 7), (3, 37, 101), (5, 8, 16),
               (8, 64, 70), (13, 100, 45), (16, 33, 20)]  # (M, K, N): stream and packed loops, K's tails
ATTENTION_CASES = [  # (B, H, S, D, slot, pad, dtype, q scale): D = 64 is the hand-written AVX2 kernel
    (2, 3, 48, 64, 0, [0, 0], torch.float32, 1.0), (2, 3, 48, 64, 6, [0, 2], torch.float32, 1.0),
    (2, 3, 48, 64, 44, [0, 5], torch.float32, 2.0), (2, 2, 24, 64, 5, [0, 10], torch.float32, 1.0),
    (3, 2, 24, 20, 23, [0, 3, 9], torch.float32, 1.0), (2, 2, 16, 13, 15, [1, 0], torch.float32, 1.0),
    (2, 3, 40, 64, 33, [0, 4], torch.bfloat16, 1.0), (2, 2, 20, 20, 17, [2, 0], torch.bfloat16, 1.0),
    (1, 2, 24, 64, 19, [0], torch.float32, 0.0), (2, 2, 40, 64, 37, [0, 1], torch.float32, 20.0)]
ARGMAX_V = [1, 7, 31, 32, 63, 64, 65, 100, 8191, 8193, 20000]
LM_HEAD_CASES = [  # (N, C, V, V_pad, token_chunk, vocab_chunks, compute dtype, h scale)
    (37, 16, 67, 72, 37, 1, torch.float32, 1.0), (37, 19, 203, 208, 10, 3, torch.float32, 1.0),
    (21, 16, 67, 72, 21, 1, torch.bfloat16, 1.0), (21, 17, 131, 136, 8, 2, torch.bfloat16, 1.0),
    (9, 16, 67, 72, 9, 1, torch.float32, 0.0), (13, 16, 99, 104, 13, 2, torch.float32, 30.0)]
MINHASH_SIZES = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 100, 1001]  # shingles a document: every tail of 4 and 8 lanes
MINHASH_PERMS = [1, 3, 4, 7, 100]  # signature rows: every tail of the 4 rows a pass
OPTIM_SIZES = [1, 7, 17, 1023, 4099]
OPTIM_STEPS = 10
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LAMB = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


def gemv_inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    cases = {}
    for M, K, N in GEMV_SHAPES:
        g = _gen(M, K, N)
        x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        cases[f"{M}x{K}x{N}"] = (x, w, b)
        if M in (1, 3, 13):
            cases[f"bf16 {M}x{K}x{N}"] = (x.bfloat16(), w.bfloat16(), b.bfloat16())
    x, w, b = cases["3x37x101"]
    cases["zeros"] = (torch.zeros_like(x), w, b)
    cases["large"] = (x * 1e15, w * 1e15, b * 1e30)
    for M in (1, 4):  # NaN and inf in the vector loop and in the tail (K = 21: one 16-step, a 5-value tail)
        g = _gen(M, 21)
        x, w = torch.randn(M, 21, generator=g), torch.randn(9, 21, generator=g)
        x[0, 20] = INF
        if M > 1:
            x[1, 3], x[2, 5], x[3, 19] = NAN, -INF, NAN
        cases[f"special {M}"] = (x, w.masked_fill(w == 0, 1.0), torch.randn(9, generator=g))
    return cases


def attention_inputs() -> list[tuple]:
    cases = []
    for i, (B, H, S, D, slot, pad, dtype, q_scale) in enumerate(ATTENTION_CASES):
        g = _gen(i, 7)
        q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (1, S, S))
        k[:, :, slot + 1:] = NAN  # slots not written yet must never be read
        v[:, :, slot + 1:] = NAN
        cases.append(((q * q_scale).to(dtype), k.to(dtype), v.to(dtype), torch.tensor(pad), slot, D ** -0.5))
    return cases


def argmax_inputs() -> dict[int, torch.Tensor]:
    cases = {}
    for V in ARGMAX_V:
        x = torch.randn(7, V, generator=_gen(V))
        x[1, [V // 3, 2 * V // 3]] = 10.0  # a tie: the first index wins
        x[2] = 0.0
        x[3, [V // 2, V - 1]] = NAN  # the first NaN wins (torch takes NaN as the largest)
        x[4, V - 1] = INF
        x[4, 0] = -INF
        x[5] = -INF
        x[6] *= 1e30
        cases[V] = x
    return cases


def lm_head_inputs() -> list[tuple]:
    cases = []
    for i, (N, C, V, V_pad, token_chunk, vocab_chunks, dtype, scale) in enumerate(LM_HEAD_CASES):
        g = _gen(i, 11)
        h, w = torch.randn(N, C, generator=g) * scale, torch.randn(V_pad, C, generator=g)
        labels = torch.randint(0, V, (N,), generator=g)
        labels[::5] = -100  # not scored
        cases.append((h, w, labels, V, token_chunk, vocab_chunks, dtype))
    return cases


def minhash_inputs(perms: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hashes, offsets, a, b) of gpt2forge::minhash_signatures, int64 holding uint64 bits: documents of
    MINHASH_SIZES shingles (any 64-bit value, so the top bit, products that wrap and sums that carry all occur;
    one document holds only the largest value), and `perms` odd multipliers."""
    g = _gen(perms, 64)
    draw = lambda n: torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64, generator=g)  # noqa: E731
    docs = [draw(n) for n in MINHASH_SIZES] + [torch.full((9,), -1, dtype=torch.int64)]
    offsets = torch.tensor([0] + [len(d) for d in docs]).cumsum(0)
    return torch.cat(docs), offsets, draw(perms) | 1, draw(perms)


def optim_inputs() -> list[tuple[str, torch.Tensor, list[torch.Tensor]]]:
    cases = []
    for n in OPTIM_SIZES:
        g = _gen(n, 13)
        p, grads = torch.randn(n, generator=g), [torch.randn(n, generator=g) for _ in range(OPTIM_STEPS)]
        cases.append((f"{n}", p, grads))
        cases.append((f"{n} bf16", p, [x.bfloat16() for x in grads]))
        cases.append((f"{n} fp16", p, [x.half() for x in grads]))
    p, grads = cases[-3][1], cases[-3][2]
    cases.append(("zeros", p, [torch.zeros_like(x) for x in grads]))
    cases.append(("large", p, [x * 1e15 for x in grads]))
    return cases


def decode_model():
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    models = []
    for n_head, n_embd in ((2, 128), (3, 33)):  # head sizes 64 (the AVX2 attention) and 11; MLP 512 and 132 wide
        cfg = ModelConfig(vocab_size=101, n_positions=32, n_embd=n_embd, n_layer=2, n_head=n_head,
                          vocab_pad_multiple=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          activation_function="gelu_new")
        model = GPT2LMHeadModel(cfg)
        model.init_weights(torch.Generator().manual_seed(n_embd))
        with torch.no_grad():  # a large spread, so that every op's error shows in the logits
            g = torch.Generator().manual_seed(n_embd + 1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        models.append(model.eval())
    return models


DECODE_IDS = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(5))
DECODE_PROMPT = 7  # prefill 7 tokens, then one fused step per token


def outputs() -> dict[str, object]:
    """Every op with more than one path, on this process's path, on the inputs above."""
    from gpt2forge.generate.fused_step import FusedDecodeStep
    from gpt2forge.generate.kv_cache import CachedLM
    from gpt2forge.ops import host_optim
    ops = torch.ops.gpt2forge
    assert custom_ops.load_custom_ops()
    out: dict[str, object] = {"isa": custom_ops.ops_isa(), "host_optim": ops.host_optim_isa()}
    lanes = [8]
    try:
        ops.gemv_set_lanes(16)
        ops.gemv_set_lanes(8)
        lanes.append(16)
    except RuntimeError:
        pass
    out["lanes"] = lanes
    for perms in MINHASH_PERMS:
        out[f"minhash {perms}"] = ops.minhash_signatures(*minhash_inputs(perms))
    for width in lanes:
        ops.gemv_set_lanes(width)
        for name, (x, w, b) in gemv_inputs().items():
            out[f"gemv {width} {name}"] = ops.gemv_linear(x, w, b)
    ops.gemv_set_lanes(8)
    for i, (q, k, v, pad, slot, scale) in enumerate(attention_inputs()):
        out[f"attention {i}"] = ops.decode_attention(q, k, v, pad, torch.tensor([slot]), scale)
    for V, x in argmax_inputs().items():
        out[f"argmax {V}"] = ops.argmax_rows(x)
    for i, (h, w, labels, V, token_chunk, vocab_chunks, dtype) in enumerate(lm_head_inputs()):
        out[f"lm_head {i}"] = ops.lm_head_ce(h, w, labels, V, -100, token_chunk, vocab_chunks, dtype, True)
    for name, p0, grads in optim_inputs():
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        copy = torch.empty_like(p0, dtype=grads[0].dtype) if grads[0].dtype != torch.float32 else None
        for t, g in enumerate(grads, 1):
            host_optim.adamw_step_(p, g, m, v, lr=ADAMW["lr"], beta1=ADAMW["betas"][0], beta2=ADAMW["betas"][1],
                                   eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], step=t, device_copy=copy)
        out[f"adamw {name}"] = (p, copy)
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for t, g in enumerate(grads, 1):
            host_optim.lamb_step_(p, g, m, v, lr=LAMB["lr"], beta1=LAMB["betas"][0], beta2=LAMB["betas"][1],
                                  eps=LAMB["eps"], weight_decay=LAMB["weight_decay"], step=t, bias_correction=True,
                                  max_weight_norm=None)
        out[f"lamb {name}"] = p
    for model in decode_model():
        lm = CachedLM(model, 2, DECODE_IDS.shape[1])
        step, pad = FusedDecodeStep.of(lm), torch.zeros(2, dtype=torch.long)
        assert step is not None
        with torch.no_grad():
            lm(DECODE_IDS[:, :DECODE_PROMPT], torch.arange(DECODE_PROMPT), pad)
            steps = range(DECODE_PROMPT, DECODE_IDS.shape[1])
            out[f"decode {model.config.n_embd}"] = torch.stack([
                step(DECODE_IDS[:, s:s + 1], torch.tensor([s]), pad) for s in steps])
    return out


if __name__ == "__main__":
    torch.save(outputs(), sys.argv[1])
