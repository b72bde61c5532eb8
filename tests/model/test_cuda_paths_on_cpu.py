"""The model's CUDA-only attention paths, forced on the CPU (gpt2forge.core.capability) and run on CPU
inductor: FlexAttention's block mask for packed documents, and attention dropout inside SDPA under
activation recomputation. Each is checked against a path the CPU runs anyway."""

import functools

import pytest
import torch
from test_document_masks import EOD, packed_text, tiny
from test_model import ours  # non-trivial biases and LayerNorms

import gpt2forge.model.gpt2 as gpt2
from gpt2forge.core.capability import forced
from gpt2forge.model.documents import document_layout, flex_available
from gpt2forge.train.memory_features import apply_activation_checkpointing, checkpointed_layers

needs_flex = pytest.mark.skipif(not flex_available(), reason=f"torch {torch.__version__} has no FlexAttention")


# torch 2.11's CPU lowering of FlexAttention (inductor/kernel/flex/flex_attention.py, lower_cpu); gone in 2.13
CPU_FLEX_SHARED_QKV = "Unsupported for now if query, key, value are the same buffer"


def packed_batch():
    """Two packed rows of 32 input tokens (documents of 9 + 23 and 4 + 4 + 24), their labels and layout."""
    text = torch.stack([packed_text([9, 24], seed=3)[0], packed_text([4, 4, 25], seed=4)[0]])
    x, y = text[:, :-1], text[:, 1:]
    return x, y, document_layout(x, EOD, True, True)


def flex_backward_refusal() -> str | None:
    """torch's reason for not differentiating FlexAttention on the CPU, or None when it does."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, 16, 8, requires_grad=True)
    try:
        flex_attention(q, q, q)
    except NotImplementedError as exc:
        return str(exc)
    return None


@needs_flex
@pytest.mark.slow
def test_flex_block_mask_forward_equals_the_dense_mask():
    """Hidden states of packed documents through the block mask, compiled (as a trainer's compiled
    model traces it) and eager (documents.flex_attention compiles the call alone)."""
    transformer = ours(tiny()).transformer
    x, _, layout = packed_batch()
    with torch.no_grad():
        assert transformer._document_mask(layout.document_ids).block is None  # the CPU's default
        want = transformer(x, layout.position_ids, document_ids=layout.document_ids)  # (B, T, C)
        with forced(flex_attention=True):
            assert transformer._document_mask(layout.document_ids).dense is None
            for forward in (transformer, torch.compile(transformer, fullgraph=True)):
                try:
                    got = forward(x, layout.position_ids, document_ids=layout.document_ids)
                except Exception as exc:  # only torch 2.11's CPU lowering refusal is skipped
                    if CPU_FLEX_SHARED_QKV not in str(exc):
                        raise
                    pytest.skip(f"torch {torch.__version__}: CPU inductor's FlexAttention lowering refuses q, k, v "
                                f"split from one c_attn output ('{CPU_FLEX_SHARED_QKV}'; CUDA's Triton lowering "
                                "takes them); the eager block mask was checked")
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_flex
@pytest.mark.slow
def test_flex_block_mask_compiled_forward_and_backward_equal_the_dense_mask():
    refusal = flex_backward_refusal()
    if refusal is not None:
        pytest.skip(f"torch {torch.__version__}: {refusal}")
    model = ours(tiny()).train()
    x, y, layout = packed_batch()
    results = []
    for forward, flex in ((model, False), (torch.compile(model, fullgraph=True), True)):
        model.zero_grad()
        with forced(flex_attention=flex):
            out = forward(x, y, *layout)
            out.loss_sum.backward()
        results.append((out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_grads), (got, grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def _chunked_path_is_not_taken(*args, **kwargs):
    raise AssertionError("the chunked CPU attention dropout ran where SDPA's dropout was forced")


@pytest.mark.slow
@pytest.mark.parametrize("sdpa_dropout", [True, False])
def test_attention_dropout_compiled_with_recomputation(sdpa_dropout, monkeypatch, request):
    """Training with attention dropout, compiled, every block recomputed in backward (as
    --recompute-checkpoint-every-layer does): SDPA's own dropout (CUDA's path), or the chunked CPU
    path. A seeded step is repeatable, depends on the seed, and equals the step without
    recomputation: the recomputed forward draws the masks forward drew."""
    if sdpa_dropout:
        monkeypatch.setattr(gpt2, "causal_attention_dropout", _chunked_path_is_not_taken)
    # One intra-op thread: the repeat is compared bit for bit, and a 2-thread run once summed a gradient in
    # another order (CI, the chunked path: loss equal, one gradient 1 ulp apart).
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(1)
    x = torch.randint(EOD + 1, 101, (2, 16), generator=torch.Generator().manual_seed(4))

    def step(model, forward, seed):
        model.zero_grad()
        torch.manual_seed(seed)
        with forced(sdpa_dropout=sdpa_dropout):
            out = forward(x, x)
            out.loss_sum.backward()
        return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    recomputed = ours(tiny(attn_pdrop=0.1)).train()
    apply_activation_checkpointing(recomputed, checkpointed_layers(recomputed.config.n_layer, True, None))
    compiled = torch.compile(recomputed, fullgraph=True)
    loss, grads = step(recomputed, compiled, seed=5)
    assert all(torch.isfinite(g).all() for g in grads.values())
    again, grads_again = step(recomputed, compiled, seed=5)
    other, _ = step(recomputed, compiled, seed=6)
    assert torch.equal(again, loss) and all(torch.equal(grads_again[n], g) for n, g in grads.items())
    assert not torch.equal(other, loss)  # dropout ran: another seed, other masks

    stored = ours(tiny(attn_pdrop=0.1)).train()
    want, want_grads = step(stored, torch.compile(stored, fullgraph=True), seed=5)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=1e-4, atol=1e-5, msg=n)


@needs_flex
@pytest.mark.slow
def test_flex_sliding_window_forward_equals_the_dense_window_mask():
    """GPT-Neo's local layers (window 5) through FlexAttention's sliding-window block mask: the hidden
    states of the dense window mask, one sequence per row and packed documents."""
    cfg = tiny(model_type="gpt_neo", attention_layers=["local", "global"], window_size=5, scale_attn_weights=False)
    transformer = ours(cfg).transformer
    x, _, layout = packed_batch()
    with torch.no_grad():
        assert transformer._local_block_mask(x, None) is None  # the CPU's default
        want = [transformer(x), transformer(x, layout.position_ids, document_ids=layout.document_ids)]
        with forced(flex_attention=True):
            assert transformer._local_block_mask(x, None) is not None
            try:
                got = [transformer(x), transformer(x, layout.position_ids, document_ids=layout.document_ids)]
            except Exception as exc:  # only torch 2.11's CPU lowering refusal is skipped
                if CPU_FLEX_SHARED_QKV not in str(exc):
                    raise
                pytest.skip(f"torch {torch.__version__}: CPU inductor's FlexAttention lowering refuses q, k, v "
                            f"split from one c_attn output ('{CPU_FLEX_SHARED_QKV}')")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
