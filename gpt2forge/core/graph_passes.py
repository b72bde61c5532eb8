"""Graph passes that torch.compile runs on the training step (inductor's post-grad custom pass).

`scatter_into_sum`: a tied embedding's gradient is the LM head's dense (V, C) gradient plus the
input embedding's, which autograd builds as a scatter-add of the B*T token gradients into a fresh
zero (V, C) tensor, then adds the two. Inductor then zero-fills and re-reads 154 MB (GPT-2's table)
every step. The pass scatters the token gradients straight into the dense term instead (also when
the dense term is a matmul that addmm would add to the scatter, as with the plain LM loss): the same
sum (only the order of additions into a row changes), and the zero tensor is never made.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

try:  # inductor's hook for custom passes is private (torch._inductor): present in torch 2.11-2.13
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # a torch without it compiles the step without the passes (compile_options)
    CustomGraphPass = None

aten = torch.ops.aten
_SCATTER_ADDS = (aten._unsafe_masked_index_put_accumulate.default, aten.index_put.default)


def _unshared_zeros(node: torch.fx.Node) -> bool:
    """`node` is aten.full(shape, 0), used only by its one scatter."""
    return (node.op == "call_function" and node.target is aten.full.default and node.args[1] == 0
            and len(node.users) == 1)


def _accumulating_scatter(node) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _SCATTER_ADDS:
        return False
    if node.target is aten.index_put.default:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if not accumulate:
            return False
    return len(node.users) == 1 and _unshared_zeros(node.args[0])


def _same_tensor_type(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device)


def _dense_term(node: torch.fx.Node):
    """For add(a, b) / addmm(b, m1, m2) (unit scales): (scatter operand b, how to build the other term)."""
    if node.op != "call_function":
        return None
    if node.target is aten.add.Tensor and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2:
        for b, a in (node.args, node.args[::-1]):
            if _accumulating_scatter(b) and isinstance(a, torch.fx.Node) and _same_tensor_type(a, node):
                return b, lambda graph, a=a: a
    if (node.target is aten.addmm.default and len(node.args) == 3 and _accumulating_scatter(node.args[0])
            and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1):
        m1, m2 = node.args[1:]
        return node.args[0], lambda graph: graph.call_function(aten.mm.default, (m1, m2))
    return None


def scatter_into_sum(graph: torch.fx.Graph) -> int:
    """Rewrite add(dense, scatter_add(zeros, ...)) and addmm(scatter_add(zeros, ...), m1, m2) as
    scatter_add(dense, ...) and scatter_add(mm(m1, m2), ...); returns how many were rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        found = _dense_term(node)
        if found is None or not _same_tensor_type(found[0], node):
            continue
        scatter, dense = found
        zeros = scatter.args[0]
        with graph.inserting_before(node):
            base = dense(graph)
            if base.meta.get("val") is None:
                base.meta.update(node.meta)
            fused = graph.call_function(scatter.target, (base, *scatter.args[1:]), dict(scatter.kwargs))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        graph.erase_node(scatter)
        graph.erase_node(zeros)
        rewritten += 1
    return rewritten


class TrainingGraphPasses(CustomGraphPass or object):
    """The passes above, as inductor's `post_grad_custom_post_pass` (its uuid: this file's hash, so a
    change here invalidates inductor's cached graphs)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        scatter_into_sum(graph)

    def uuid(self) -> str:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def compile_options() -> dict:
    """torch.compile's `options` for the training step: the passes as inductor's post-grad custom pass,
    or none where this torch lacks that private hook (the same step, without the rewrite)."""
    from torch._inductor import config

    if CustomGraphPass is None or not hasattr(config, "post_grad_custom_post_pass"):
        return {}
    return {"post_grad_custom_post_pass": TrainingGraphPasses()}
