"""The fused LM head's CUDA path, forced on the CPU (gpt2forge.core.capability): the reference with
its cross-entropy pass torch.compile'd inside the custom op, forward and backward, equal to plain
full-logits cross-entropy, called eagerly and from a compiled model."""

import pytest
import torch
import torch.nn.functional as F

import gpt2forge.ops.lm_head_loss as lhl
from gpt2forge.core.capability import forced
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops.lm_head_loss import LossChunking, fused_lm_head_loss


@pytest.fixture()
def compiled_rows(monkeypatch) -> list:
    """The CUDA path on the CPU: the reference (not the C++ kernel), its row pass compiled; returns
    the list of the compiled pass's calls."""
    monkeypatch.setattr(lhl, "_use_kernel", lambda hidden: False)
    compiled, calls = lhl._compiled_xent_rows(), []

    def counted(*args):
        calls.append(args[0].shape)
        return compiled(*args)

    monkeypatch.setattr(lhl, "_compiled_xent_rows", lambda: counted)
    with forced(compiled_xent_rows=True):
        yield calls


def plain_loss(h, W, y, V, dtype):
    """Full logits in `dtype` (as autocast computes them), fp32 cross-entropy; with the logits."""
    logits = (h.to(dtype) @ W[:V].to(dtype).T).float()
    return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum"), logits


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_row_pass_inside_the_op_equals_plain_cross_entropy(compiled_rows, dtype):
    g = torch.Generator().manual_seed(0)
    N, C, V, V_pad = 37, 16, 67, 80
    h, W = torch.randn(N, C, generator=g), torch.randn(V_pad, C, generator=g) * 0.5
    W[V:] = 0.0
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = IGNORE_INDEX
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    want, logits = plain_loss(hh, WW, y, V, dtype)
    want.backward()
    want_gh, want_gw = hh.grad, WW.grad
    hh.grad = WW.grad = None
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss, correct, tokens = fused_lm_head_loss(hh, WW, y, V, IGNORE_INDEX, LossChunking(16, 1))
    loss.backward()
    # every row chunk went through the compiled pass, its logits V rounded up to 8 columns (72: cuBLAS's alignment)
    assert compiled_rows == [(16, 72), (16, 72), (5, 72)]
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, want, **tol)
    keep = y != IGNORE_INDEX
    assert int(tokens) == int(keep.sum())
    if dtype == torch.float32:  # in bf16 near-ties may flip the argmax
        assert int(correct) == int(((logits.argmax(1) == y) & keep).sum())
    torch.testing.assert_close(hh.grad, want_gh.float(), **tol)
    torch.testing.assert_close(WW.grad, want_gw.float(), **tol)


@pytest.mark.slow
def test_compiled_row_pass_under_a_compiled_model_equals_the_plain_loss(compiled_rows):
    """As a compiled CUDA training step runs it: the custom op is opaque to the model's graph, and
    its reference calls the compiled pass when the graph runs."""
    cfg = ModelConfig(vocab_size=67, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(2))
    want = model(ids, ids)
    want.loss_sum.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.fused_loss = LossChunking(8, 1)
    out = torch.compile(model, fullgraph=True)(ids, ids)
    out.loss_sum.backward()
    assert len(compiled_rows) == 4  # 32 rows in chunks of 8
    torch.testing.assert_close(out.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-5)
    assert int(out.correct) == int(want.correct) and int(out.tokens) == int(want.tokens)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-6, msg=n)
