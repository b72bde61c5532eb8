"""Optimizer state keyed by parameter name, so checkpoints do not depend on the parallel layout.

A torch optimizer's `state_dict()` keys parameters by their position in its param groups, which
differ between a pipeline stage, an FSDP shard and the whole model. The *named* form (the same as
torch.distributed.checkpoint's full optimizer state dict) keys them by the full model's parameter
names: `{"state": {name: {...}}, "param_groups": [{hyper-parameters..., "params": [name, ...]}]}`.
Checkpoints keep the whole model's indexed form, so a single process resumes with a plain
`optimizer.load_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Split the trainable parameters of `model` into a decayed and a non-decayed group.

    Args:
        model: any module; tied parameters (e.g. `lm_head.weight is transformer.wte.weight`)
            are listed once, because `named_parameters()` de-duplicates by identity.
        weight_decay: decay for parameters with `ndim >= 2` (matmul and embedding weights).

    Returns:
        `[{"params": [ndim >= 2 ...], "weight_decay": weight_decay},
          {"params": [ndim < 2 ...], "weight_decay": 0.0}]`, both always present (possibly empty)
        so group 0 is always the decayed one. Parameters with `requires_grad=False` are left out.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def model_group_names(model: torch.nn.Module) -> list[list[str]]:
    """Parameter names per optimizer group of the whole model (the checkpoint's index order)."""
    names = _module_names(model, None)
    return [[names[id(p)] for p in g["params"]] for g in param_groups(model, 0.0)]


def _group_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def to_named(indexed: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """Indexed state dict (groups list positions 0..n-1 in order) -> named form."""
    order = [name for group in group_names for name in group]
    groups = []
    for group, names in zip(indexed["param_groups"], group_names):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(names)})
    return {"state": {order[i]: s for i, s in indexed["state"].items()}, "param_groups": groups}


def to_indexed(named: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """Named form -> the indexed state dict of an optimizer whose groups hold `group_names`.
    Names absent from `named` (no state yet) are left without state; hyper-parameters come from
    the named group at the same position."""
    groups, state, index = [], {}, 0
    for group, names in zip(named["param_groups"], group_names):
        ids = []
        for name in names:
            if name in named["state"]:
                state[index] = named["state"][name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _module_names(module: torch.nn.Module, aliases: dict[str, str] | None) -> dict[int, str]:
    aliases = aliases or {}
    return {id(p): aliases.get(n, n) for n, p in module.named_parameters()}


def named_state(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """The named form of `optimizer` (built over `module`'s parameters). `aliases` renames module
    names to the full model's (e.g. a pipeline stage's copy of the tied embedding)."""
    return to_named(optimizer.state_dict(), _group_names(optimizer, _module_names(module, aliases)))


def load_named_state(optimizer: torch.optim.Optimizer, module: torch.nn.Module, named: dict[str, Any],
                     aliases: dict[str, str] | None = None) -> None:
    """Load the named form into an optimizer over (part of) the model; inverse of `named_state`."""
    optimizer.load_state_dict(to_indexed(named, _group_names(optimizer, _module_names(module, aliases))))


def merge_named(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Union of several named states (pipeline stages); the first part holding a name wins, and
    groups keep the whole model's parameter order given by the parts' order."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        for name, s in part["state"].items():
            state.setdefault(name, s)
        for i, group in enumerate(part["param_groups"]):
            if i == len(groups):
                groups.append({**group, "params": []})
            groups[i]["params"] += [n for n in group["params"] if n not in groups[i]["params"]]
    return {"state": state, "param_groups": groups}


def to_cpu(obj: Any) -> Any:
    """A copy of a nested state with every tensor on the CPU (for gathering and saving)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
