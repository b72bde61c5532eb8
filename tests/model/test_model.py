"""Parity of our GPT-2 with transformers.GPT2LMHeadModel, both directions, and checkpoint loading."""

import pytest
import torch
import transformers

from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model.checkpoint import from_hf_state_dict, load_weights, to_hf_state_dict
from gpt2forge.model.config import MODEL_FILES, ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel, head_loss
from gpt2forge.train.run_folder import save_checkpoint


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=2, vocab_pad_multiple=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base.update(kw)
    return ModelConfig(**base)


def ours(cfg: ModelConfig, seed: int = 0) -> GPT2LMHeadModel:
    m = GPT2LMHeadModel(cfg)
    m.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-trivial biases and LayerNorms, so layout mistakes show up
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return m.eval()


def hf_model(cfg: ModelConfig) -> transformers.GPT2LMHeadModel:
    hf_cfg = transformers.GPT2Config(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(hf_cfg).eval()


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
@pytest.mark.parametrize("inverse_layer_scale", [False, True])
def test_logits_match_transformers(act, inverse_layer_scale):
    cfg = tiny(activation_function=act, scale_attn_by_inverse_layer_idx=inverse_layer_scale)
    model = ours(cfg)
    hf = hf_model(cfg)
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    hf.tie_weights()
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids)
    assert got.shape == (3, 17, cfg.padded_vocab_size)
    torch.testing.assert_close(got[..., : cfg.vocab_size], ref, rtol=1e-5, atol=1e-5)


def test_hf_weights_load_into_ours():
    cfg = tiny()
    hf = hf_model(cfg)
    model = GPT2LMHeadModel(cfg).eval()
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg), strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., : cfg.vocab_size], hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_padded_vocab_never_gets_mass_or_predicted():
    cfg = tiny()
    model = ours(cfg)
    assert cfg.padded_vocab_size == 112 and cfg.vocab_size == 101
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    logits = model(ids)
    probs = torch.softmax(logits, -1)
    assert torch.all(probs[..., cfg.vocab_size:] == 0)
    assert int(logits.argmax(-1).max()) < cfg.vocab_size


def test_loss_equals_plain_cross_entropy_and_ignores_padding():
    cfg = tiny()
    model = ours(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    labels = torch.randint(0, cfg.vocab_size, (2, 10))
    labels[1, 6:] = IGNORE_INDEX
    out = model(ids, labels)
    logits = model(ids)[..., : cfg.vocab_size]
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                            reduction="sum")
    torch.testing.assert_close(out.loss_sum, ref)
    assert int(out.tokens) == 16
    mask = labels != IGNORE_INDEX
    assert int(out.correct) == int(((logits.argmax(-1) == labels) & mask).sum())


def test_lm_loss_gradient_reaches_only_real_rows():
    cfg = tiny()
    model = ours(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model(ids, ids).loss_sum.backward()
    grad = model.transformer.wte.weight.grad
    assert torch.all(grad[cfg.vocab_size:] == 0)
    assert grad[: cfg.vocab_size].abs().sum() > 0


def test_checkpoint_loads_in_transformers_with_same_logits(tmp_path):
    cfg = tiny()
    model = ours(cfg)
    path = save_checkpoint(tmp_path, "step_1", model, {"step": 1}, {"seed": 1})
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[..., : cfg.vocab_size], rtol=1e-5, atol=1e-5)
    # and back into a fresh model of ours
    again = GPT2LMHeadModel(cfg).eval()
    load_weights(again, path)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), model(ids))
    assert (tmp_path / "latest").read_text().strip() == "step_1"


def test_hf_save_pretrained_directory_loads(tmp_path):
    cfg = tiny()
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    model = GPT2LMHeadModel(cfg).eval()
    load_weights(model, tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., : cfg.vocab_size], hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(MODEL_FILES))
def test_shipped_configs_parse_and_count_parameters(name):
    cfg = ModelConfig.preset(name)
    hf_cfg = transformers.GPT2Config(**cfg.to_hf_dict())
    assert hf_cfg.n_layer == cfg.n_layer and cfg.eos_token_id == 50256
    if name == "gpt2":  # the 124M model (117M in the paper's count)
        assert cfg.num_params() == 124_439_808


def test_cpu_attention_dropout_path_equals_sdpa_without_drops():
    cfg = tiny(attn_pdrop=1e-12)  # the explicit dropout path, but (almost surely) nothing dropped
    model = ours(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        ref = model(ids)  # eval: SDPA
        model.train()
        got = model(ids)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dropout_keeps_expectation_and_rate():
    from gpt2forge.model.gpt2 import Dropout
    torch.manual_seed(0)
    drop = Dropout(0.25).train()
    y = drop(torch.ones(200_000))
    assert abs(float((y == 0).float().mean()) - 0.25) < 0.01
    assert abs(float(y.mean()) - 1.0) < 0.02
    assert torch.equal(drop.eval()(torch.ones(5)), torch.ones(5))


def test_fused_loss_over_several_logits_tiles_equals_plain_loss_and_gradients():
    # 700 vocabulary columns: the C++ kernel computes its logits in tiles (custom_ops/lm_head_ce.cpp,
    # kLogitsTile = 256), so this crosses two tile edges and ends on a partial tile.
    from gpt2forge.ops.lm_head_loss import LossChunking

    cfg = tiny(vocab_size=700)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    results = []
    for chunking in (None, LossChunking(), LossChunking(token_chunk=5, vocab_chunks=3)):
        model = ours(cfg).train()
        model.fused_loss = chunking
        out = model(ids, ids)
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), out.correct, model.transformer.wte.weight.grad,
                        model.transformer.h["0"].attn.c_attn.weight.grad))
    for got in results[1:]:
        for x, ref in zip(got, results[0]):
            torch.testing.assert_close(x.float(), ref.float(), rtol=1e-5, atol=1e-5)


def test_dropout_off_the_cpu_is_torchs_own(monkeypatch):
    # A CUDA tensor's dropout is F.dropout (exact p; inductor fuses its mask into the kernel), never the
    # opaque mask op; the meta device stands in for CUDA (any device but the CPU takes the branch).
    from gpt2forge.model import dropout as dropout_mod

    def refused(x, p):
        raise AssertionError("dropout_keep_mask called off the CPU")

    monkeypatch.setattr(dropout_mod, "dropout_keep_mask", refused)
    called = []
    real = torch.nn.functional.dropout
    monkeypatch.setattr(torch.nn.functional, "dropout", lambda x, p, training: called.append(p) or real(x, p, training))
    x = torch.ones(64, 64, device="meta")
    assert dropout_mod.dropout(x, 0.1, True).shape == x.shape and called == [0.1]
    assert dropout_mod.dropout(x, 0.1, False) is x
    with pytest.raises(AssertionError, match="off the CPU"):  # the CPU still draws with the op
        dropout_mod.dropout(torch.ones(8, 8), 0.1, True)


def _attention_with_recorded_masks(monkeypatch, q, k, v, p, rows):
    """Run causal_attention_dropout in `rows`-row query chunks, recording the chunk masks it draws
    and assembling them into one (B, H, T, T) mask for the spelled-out reference."""
    from gpt2forge.model import dropout as dropout_mod
    B, H, T, _ = q.shape
    monkeypatch.setattr(dropout_mod, "ATTENTION_CHUNK_ELEMENTS", B * H * T * rows)
    drawn = []
    real = dropout_mod.dropout_keep_mask

    def recording(x, prob):
        drawn.append(real(x, prob))
        return drawn[-1]

    monkeypatch.setattr(dropout_mod, "dropout_keep_mask", recording)
    out = dropout_mod.causal_attention_dropout(q, k, v, p, 0.3)
    full = torch.zeros(B, H, T, T, dtype=torch.bool)
    t0 = 0
    for keep in drawn:
        full[:, :, t0:t0 + keep.shape[2], :keep.shape[3]] = keep
        t0 += keep.shape[2]
    assert t0 == T and len(drawn) == len(dropout_mod._chunks(q))
    return out, full


def _math_attention(q, k, v, keep, p):
    from gpt2forge.model.dropout import kept_fraction
    T = q.shape[2]
    s = (q.float() @ k.float().transpose(-2, -1)) * 0.3
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return (s * keep / kept_fraction(p)) @ v.float()


@pytest.mark.parametrize("dtype,tol,rows", [(torch.float32, 1e-5, 16), (torch.bfloat16, 2e-2, 16),
                                            (torch.float32, 1e-5, 48)])
def test_chunked_attention_dropout_equals_math_with_the_same_masks(monkeypatch, dtype, tol, rows):
    # 16 rows: chunks 0-15, 16-31, 32-36 of growing causal width, probabilities recomputed in
    # backward from the log-sum-exp; 48 rows: a budget for the whole matrix, so the probabilities
    # are kept instead, the chunks the same (T / CAUSAL_CHUNKS rounded up to 16 rows).
    from gpt2forge.model import dropout as dropout_mod
    torch.manual_seed(0)
    B, H, T, hd, p = 2, 3, 37, 8, 0.3
    q, k, v = (torch.randn(B, H, T, hd).to(dtype).requires_grad_() for _ in range(3))
    out, keep = _attention_with_recorded_masks(monkeypatch, q, k, v, p, rows)
    assert dropout_mod._keeps_probabilities(q) == (rows == 48) and len(dropout_mod._chunks(q)) == 3
    assert out.dtype == dtype
    assert 0.6 < keep[..., torch.ones(T, T, dtype=torch.bool).tril()].float().mean() < 0.8
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _math_attention(qf, kf, vf, keep, p)
    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), grad.float())
    for got, want in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_last_positions_only_equal_the_full_forward():
    # Evaluation asks for the final hidden states of the scored positions only: the last block then
    # attends and runs its MLP for those rows alone (lower-right causal mask over all keys).
    cfg = tiny(n_layer=3)
    model = ours(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 13))
    with torch.no_grad():
        full = model.transformer(ids)
        for last in (1, 5, 13):
            torch.testing.assert_close(model.transformer(ids, last=last), full[:, -last:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="last=14"):
        model.transformer(ids, last=14)


def _without(model: GPT2LMHeadModel, blocks: list[int], embeddings: bool, head: bool) -> GPT2LMHeadModel:
    """A deep copy of `model` with the embeddings, the blocks not in `blocks`, and ln_f + lm_head removed."""
    import copy

    part = copy.deepcopy(model)
    t = part.transformer
    if not embeddings:
        t.wte = t.wpe = None
    for i in [k for k in t.h if int(k) not in blocks]:
        del t.h[i]
    if not head:
        t.ln_f = part.lm_head = None
    return part


def test_model_with_parts_removed_chains_to_the_whole_forward_and_loss():
    # What a pipeline stage relies on: stages are the model minus what they do not own, chained by hand.
    cfg = tiny(n_layer=4)
    model = ours(cfg)
    hf_names = [n for n in hf_model(cfg).state_dict() if not n.endswith((".attn.bias", ".attn.masked_bias"))]
    assert list(model.state_dict()) == hf_names  # `transformer.h.{i}...` as Hugging Face names them
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    labels = torch.randint(0, cfg.vocab_size, (2, 9))
    labels[0, :3] = IGNORE_INDEX
    first, middle, last = _without(model, [0], True, False), _without(model, [1, 2], False, False), \
        _without(model, [3], False, True)
    assert list(middle.transformer.h) == ["1", "2"] and "transformer.h.2.mlp.c_fc.weight" in middle.state_dict()
    assert first.transformer.ln_f is None and middle.transformer.wte is None
    with torch.no_grad():
        hidden = middle(first(ids))  # (B, T, C) between the parts
        assert hidden.shape == (2, 9, cfg.n_embd)
        torch.testing.assert_close(last(hidden), model(ids), rtol=1e-5, atol=1e-5)
        final = last.transformer(hidden)
        torch.testing.assert_close(final, model.transformer(ids), rtol=1e-5, atol=1e-5)
        got = head_loss(final, last.lm_head.weight, labels, cfg.vocab_size, None)
        want = model(ids, labels)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last(hidden, labels).loss_sum, want.loss_sum, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last.transformer(hidden, last=4), final[:, -4:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="without lm_head"):
        first(ids, labels)


@pytest.mark.slow
def test_compiled_gelu_new_is_the_tanh_gelu_and_its_gradient():
    # Under torch.compile gelu_new is written x * sigmoid(2z) (an exp where inductor's tanh costs
    # more); it must be the eager tanh form's function and gradient to fp32 rounding, tails included.
    from gpt2forge.model.gpt2 import _ACTIVATIONS

    gelu_new = _ACTIVATIONS["gelu_new"]
    x = torch.cat([torch.linspace(-12, 12, 2001), torch.randn(4000) * 3]).requires_grad_()

    def value_and_grad(fn):
        y = fn(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        return y.detach(), g

    compiled = value_and_grad(torch.compile(gelu_new, fullgraph=True))
    eager = value_and_grad(lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
