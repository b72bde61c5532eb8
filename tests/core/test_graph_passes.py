"""The training step's inductor graph pass: the tied embedding's scatter goes into the dense sum."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gpt2forge.core.graph_passes import compile_options, scatter_into_sum

aten = torch.ops.aten


def _graph(fn, *args):
    return make_fx(fn)(*args)


def _tied_grad(dense, ids, rows):
    """What autograd builds for a tied embedding: the head's dense term + scatter into zeros."""
    zeros = aten.full.default(list(dense.shape), 0, dtype=dense.dtype)
    return aten.add.Tensor(dense * 2.0, aten.index_put.default(zeros, [ids], rows, True))


def _inputs():
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(50, 8, generator=gen)
    ids = torch.tensor([3, 7, 3, 49, 0, 7, 7])  # repeated ids: their rows add up
    rows = torch.randn(len(ids), 8, generator=gen)
    return dense, ids, rows


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_scatter_goes_into_the_dense_term_and_the_sum_is_unchanged():
    args = _inputs()
    gm = _graph(_tied_grad, *args)
    expected = gm(*args)
    assert scatter_into_sum(gm.graph) == 1
    gm.recompile()
    assert aten.full.default not in _ops(gm) and aten.add.Tensor not in _ops(gm)
    torch.testing.assert_close(gm(*args), expected)


def test_scatter_goes_into_a_matmul_that_addmm_added_to_it():
    def addmm_form(dense, ids, rows):
        zeros = aten.full.default(list(dense.shape), 0, dtype=dense.dtype)
        return aten.addmm.default(aten.index_put.default(zeros, [ids], rows, True), dense, dense.t()[:, :8])

    args = _inputs()
    gm = _graph(addmm_form, *args)
    expected = gm(*args)
    assert scatter_into_sum(gm.graph) == 1
    gm.recompile()
    assert aten.addmm.default not in _ops(gm) and aten.mm.default in _ops(gm)
    torch.testing.assert_close(gm(*args), expected)


def test_left_alone_when_the_zeros_are_used_elsewhere_or_the_add_is_scaled():
    def zeros_reused(dense, ids, rows):
        zeros = aten.full.default(list(dense.shape), 0, dtype=dense.dtype)
        scattered = aten.index_put.default(zeros, [ids], rows, True)
        return aten.add.Tensor(dense, scattered), zeros

    def scaled(dense, ids, rows):
        zeros = aten.full.default(list(dense.shape), 0, dtype=dense.dtype)
        return aten.add.Tensor(dense, aten.index_put.default(zeros, [ids], rows, True), alpha=2)

    def overwriting(dense, ids, rows):  # accumulate=False: a put, not a sum
        zeros = aten.full.default(list(dense.shape), 0, dtype=dense.dtype)
        return aten.add.Tensor(dense, aten.index_put.default(zeros, [ids], rows, False))

    for fn in (zeros_reused, scaled, overwriting):
        gm = _graph(fn, *_inputs())
        assert scatter_into_sum(gm.graph) == 0, fn.__name__


@pytest.mark.slow
def test_compiled_tied_embedding_grads_equal_eager(monkeypatch):
    from torch._inductor.utils import fresh_inductor_cache

    from gpt2forge.core import graph_passes

    rewrites = []
    monkeypatch.setattr(graph_passes, "scatter_into_sum",
                        lambda graph, rewrite=scatter_into_sum: rewrites.append(rewrite(graph)))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(64, 16)
    ids = torch.randint(0, 64, (2, 12))

    def loss(weight):
        return torch.nn.functional.cross_entropy(
            (torch.nn.functional.embedding(ids, weight).tanh() @ weight.t()).flatten(0, 1), ids.flatten())

    eager = torch.func.grad(loss)(emb.weight.detach())
    w = emb.weight.detach().clone().requires_grad_(True)
    with fresh_inductor_cache():  # the pass runs when inductor compiles, not on a cache hit
        torch.compile(loss, options=compile_options())(w).backward()
    torch.testing.assert_close(w.grad, eager, rtol=1e-5, atol=1e-6)
    assert sum(rewrites) == 1  # in the backward graph


def test_a_torch_without_the_custom_pass_hook_compiles_without_the_passes(monkeypatch):
    from gpt2forge.core import graph_passes

    assert isinstance(compile_options()["post_grad_custom_post_pass"], graph_passes.TrainingGraphPasses)
    monkeypatch.setattr(graph_passes, "CustomGraphPass", None)
    assert compile_options() == {}
