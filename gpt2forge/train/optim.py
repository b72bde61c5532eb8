"""Optimizers and learning-rate schedules (reference section 5.2 and 5.3).

What `--optimizer` builds:

| name                   | class                        | weight decay             |
|------------------------|------------------------------|--------------------------|
| `AdamW` (default)      | `torch.optim.AdamW`          | decoupled                |
| `Adam`                 | `torch.optim.Adam`           | coupled L2 (as PopTorch) |
| `LAMB`                 | `Lamb(bias_correction=True)` | decoupled, inside trust  |
| `LAMBNoBiasCorrection` | `Lamb(bias_correction=False)`| decoupled, inside trust  |
| `Muon`                 | `MuonAdamW`                  | decoupled                |

`Muon` updates the 2-D weights of the transformer blocks (attention qkv and output projection, MLP in
and out) with torch.optim.Muon's algorithm (`MuonAdamW`: Nesterov momentum `--muon-momentum`, five
Newton-Schulz steps that orthogonalize the update, batched over the matrices of one shape and run in
the run's precision, its RMS matched to AdamW's so that `--muon-learning-rate` is in AdamW's units:
Moonshot's "match_rms_adamw") and everything else (token and position embeddings, the LM head,
LayerNorms, biases) with AdamW at `--learning-rate`, as modded-nanogpt and Moonshot's Moonlight split
them. The orthogonalization needs whole matrices, and the checkpoint keeps one process's groups: one
process and DDP replicas only (`build_optimizer` and the trainer refuse the rest by name).

The reference's PopTorch AdamW ran with `bias_correction=False`; torch's AdamW always corrects the
bias. The two differ early in training only: the correction fades over ~1/(1-beta2) = 1000 updates.

Weight decay applies to parameters with two or more dimensions only; biases and LayerNorm
parameters are never decayed. Gradient clipping is not the optimizer's: `--max-grad-norm` clips the
global gradient norm before the update (gpt2forge.train.step, through the strategy's `clip_grad_norm`);
off by default, as in the reference (Megatron's front end sets Megatron's 1.0).

Where the update runs on the host (`--optimizer-state-offchip`: one process, DDP, ZeRO-1 shards,
FSDP2 shards offloaded to the CPU), AdamW and LAMB use the C++ ops of gpt2forge.ops.host_optim
(`HostAdamW`, `HostLamb`: same state layout, same math to fp32 rounding) when the custom ops
library is built, and the PyTorch classes above otherwise. Runs without offload are unchanged.

LR schedules live in `gpt2forge.train.schedule` (re-exported here).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, MutableMapping

import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.ops import host_optim
from gpt2forge.parallel.optimizer_state import param_groups
from gpt2forge.train.schedule import SCHEDULES, build_lr_schedule, resolve_warmup_steps

__all__ = ["OPTIMIZERS", "SCHEDULES", "HostLamb", "Lamb", "MuonAdamW", "OffloadedOptimizer", "build_lr_schedule",
           "build_optimizer", "muon_param_groups", "param_groups", "resolve_warmup_steps", "scheduled_lrs"]

OPTIMIZERS = ("AdamW", "Adam", "LAMB", "LAMBNoBiasCorrection", "Muon")

# Device types with fused Adam/AdamW kernels in torch 2.x; anything else uses foreach.
_FUSED_DEVICE_TYPES = ("cpu", "cuda")


# ---------------------------------------------------------------------------------------------
# Parameter groups and optimizer construction
# ---------------------------------------------------------------------------------------------


def _can_fuse(params: Iterable[torch.Tensor], device_type: str) -> bool:
    """True when torch's fused Adam/AdamW kernel accepts every parameter."""
    if device_type not in _FUSED_DEVICE_TYPES:
        return False
    return all(p.device.type in _FUSED_DEVICE_TYPES and torch.is_floating_point(p) for p in params)


def build_optimizer(
    model: torch.nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    device_type: str = "cpu",
    offload: bool = False,
    shard: bool = False,
    shard_group=None,
    host_update: bool = False,
    muon_lr: float | None = None,
    muon_momentum: float = 0.95,
    muon_dtype: torch.dtype = torch.bfloat16,
) -> torch.optim.Optimizer:
    """Build the optimizer named by `--optimizer` over `param_groups(model, weight_decay)`
    (`muon_param_groups` for Muon).

    Args:
        model: the (already placed) model whose trainable parameters are optimized.
        name: one of `OPTIMIZERS`.
        lr: peak learning rate (`--learning-rate`); schedules scale it.
        weight_decay: `--weight-decay`, applied to `ndim >= 2` parameters only.
        betas, eps: Adam moment decay rates and denominator epsilon (`--adam-beta1/2`, `--adam-eps`;
            the reference used eps 1e-6).
        device_type: `"cpu"`, `"cuda"`, ...; Adam/AdamW use the fused kernel when the device
            type and every parameter dtype support it, else the foreach implementation.
        offload: keep the state and run the update in host memory (`OffloadedOptimizer`).
        shard: shard the state across the data-parallel ranks (ZeRO-1, needs torch.distributed).
        shard_group: the process group of those ranks (default: all ranks).
        host_update: the parameters live in host memory (FSDP2's CPU offload, the strategy's
            `OptimizerPlacement.host_update`): the update runs there with the host kernels.
        muon_lr: Muon's peak learning rate (`--muon-learning-rate`; None: `lr`), in AdamW's units.
        muon_momentum: Muon's Nesterov momentum (`--muon-momentum`).
        muon_dtype: the dtype of Muon's Newton-Schulz steps: the run's compute precision (`orthogonalize`).

    Raises:
        UsageError: unknown `name`, negative `lr` or `weight_decay`, Muon with a placement it cannot run.
    """
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer {name} is not supported; choose one of {', '.join(OPTIMIZERS)}")
    if lr < 0:
        raise UsageError(f"--learning-rate {lr} is negative; pass a value >= 0")
    if weight_decay < 0:
        raise UsageError(f"--weight-decay {weight_decay} is negative; pass a value >= 0")

    if name == "Muon":
        placed = [flag for flag, on in (("--offload", offload or host_update), ("ZeRO-1", shard)) if on]
        if placed:
            raise UsageError(f"--optimizer Muon cannot run with {' or '.join(placed)}: it updates whole matrices in "
                             "one process's memory; use --optimizer AdamW there")
        groups = muon_param_groups(model, weight_decay, lr if muon_lr is None else muon_lr)
        return MuonAdamW(groups, lr=lr, momentum=muon_momentum, betas=betas, eps=eps, ns_dtype=muon_dtype,
                         fused=_can_fuse((p for g in groups for p in g["params"]), device_type))
    if name in ("AdamW", "Adam"):
        cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    else:
        cls = Lamb
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=name == "LAMB")

    def make(groups: list[dict], device_type: str, on_host: bool = False) -> torch.optim.Optimizer:
        impl = {}
        if cls is not Lamb:  # fused and foreach are mutually exclusive in torch; pass exactly one of them
            fused = _can_fuse((p for g in groups for p in g["params"]), device_type)
            impl = {"fused": True} if fused else {"foreach": True}
        if on_host and cls in _HOST_CLASSES and host_optim.kernel_available():
            return _HOST_CLASSES[cls](groups, **hyper, **impl)  # the same groups, hence checkpoints
        return cls(groups, **hyper, **impl)

    def local(groups: list[dict], **_hyper) -> torch.optim.Optimizer:
        """The optimizer of the parameters this process updates (ZeRO-1 passes its shard's groups)."""
        if offload:
            return OffloadedOptimizer(groups, lambda host_groups: make(host_groups, "cpu", on_host=True))
        return make(groups, device_type, on_host=host_update)

    groups = param_groups(model, weight_decay)
    if shard:  # ZeRO-1: each replica keeps and updates the state of its shard only (on the host with offload)
        return _zero1(groups, local, shard_group, hyper)
    return local(groups)


def _zero1(groups: list[dict], local, group, hyper: dict) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer whose `load_state_dict` leaves fused Adam's step counters on the
    parameters' device (it moves every 0-dim state tensor to the CPU, which fused CUDA Adam refuses
    on the next step: pytorch/pytorch#124133)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ZeroOptimizer(ZeroRedundancyOptimizer):
        def load_state_dict(self, state_dict) -> None:
            super().load_state_dict(state_dict)
            for g in self.optim.param_groups:
                if not g.get("fused"):
                    continue
                for p in g["params"]:
                    step = self.optim.state.get(p, {}).get("step")
                    if torch.is_tensor(step) and step.device != p.device:
                        self.optim.state[p]["step"] = step.to(p.device, torch.float32)

    return ZeroOptimizer(groups, optimizer_class=local, process_group=group, **hyper)


# ---------------------------------------------------------------------------------------------
# Muon for the blocks' matrices, AdamW for the rest
# ---------------------------------------------------------------------------------------------

BLOCK_PARAMETER = re.compile(r"(?:^|\.)h\.\d+\.")
"""Names of the transformer blocks' parameters (`transformer.h.3.mlp.c_fc.weight`)."""


def muon_param_groups(model: torch.nn.Module, weight_decay: float, muon_lr: float) -> list[dict]:
    """`param_groups(model, weight_decay)` with the blocks' 2-D weights moved to a Muon group first.

    Returns `[Muon: the blocks' 2-D weights (lr muon_lr), AdamW decayed: the other ndim >= 2 parameters
    (embeddings, an untied LM head), AdamW not decayed: ndim < 2]`, each tagged `"muon"`; all three are
    present, possibly empty.
    """
    muon_ids = {id(p) for name, p in model.named_parameters() if p.ndim == 2 and BLOCK_PARAMETER.search(name)}
    decay, no_decay = param_groups(model, weight_decay)
    matrices = [p for p in decay["params"] if id(p) in muon_ids]
    rest = [p for p in decay["params"] if id(p) not in muon_ids]
    return [{"params": matrices, "weight_decay": weight_decay, "lr": muon_lr, "muon": True},
            {**decay, "params": rest, "muon": False}, {**no_decay, "muon": False}]


def scheduled_lrs(optimizer: torch.optim.Optimizer) -> tuple[float, float | None]:
    """The learning rates the schedule has set for this update: `--learning-rate`'s groups' and, with
    Muon, its matrices' (`--muon-learning-rate`; None without Muon)."""
    groups = optimizer.param_groups
    muon = next((g["lr"] for g in groups if g.get("muon")), None)
    return next((g["lr"] for g in groups if not g.get("muon")), groups[0]["lr"]), muon


MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Keller Jordan's Muon (torch.optim.Muon's defaults)."""


def orthogonalize(updates: list[torch.Tensor], dtype: torch.dtype, steps: int = 5,
                  coefficients: tuple[float, float, float] = MUON_COEFFICIENTS, eps: float = 1e-7
                  ) -> list[torch.Tensor]:
    """torch.optim.Muon's Newton-Schulz orthogonalization of each 2-D update, in `dtype`, batched.

    The same iteration as torch's `_zeropower_via_newtonschulz` (each matrix transposed to be wide,
    divided by its Frobenius norm, then `steps` quintic steps X <- aX + (bA + cA^2)X with A = XX^T),
    with the matrices of one shape stacked into batched matmuls (the blocks' matrices share four
    shapes: one product a shape instead of one a matrix). torch's runs in bf16 always; `dtype` is
    the run's compute precision, because bf16 matmuls are emulated, and far slower, where the CPU
    has no bf16 kernels (docs/benchmarks.md, Design measurements). Returns `dtype` tensors in the
    updates' order and shapes.
    """
    a, b, c = coefficients
    out: list[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    by_shape: dict[tuple, list[int]] = defaultdict(list)
    for i, u in enumerate(updates):
        by_shape[(tuple(u.shape), u.device)].append(i)
    for (shape, _), indices in by_shape.items():
        x = torch.stack([updates[i] for i in indices]).to(dtype)  # (k, rows, cols)
        tall = shape[0] > shape[1]
        if tall:
            x = x.mT  # (k, cols, rows): the Gram matrix below is the smaller one
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT  # (k, r, r), r = min(rows, cols)
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        for j, i in enumerate(indices):
            out[i] = x[j].mT if tall else x[j]
    return out


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer whose `"muon"` groups take torch.optim.Muon's update and the others AdamW's.

    Muon (torch.optim.Muon's algorithm and state names, so the update is torch's): per matrix W with
    gradient G, momentum buffer M <- lerp(M, G, 1 - momentum); U = lerp(G, M, momentum) (Nesterov);
    O = orthogonalize(U); W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O. The last factor matches
    O's RMS to AdamW's update (torch's `adjust_lr_fn="match_rms_adamw"`, Moonshot's), so a Muon group's
    `lr` is in AdamW's units. The Newton-Schulz steps run in `ns_dtype` (see `orthogonalize`).

    The groups and the state are this optimizer's own (one `state_dict`, indexed over all groups in
    order, so checkpoints, resuming and LR schedules work as for AdamW); a torch AdamW inside runs its
    update over the other groups.
    """

    def __init__(self, groups: list[dict], lr: float, momentum: float, betas: tuple[float, float], eps: float,
                 fused: bool, ns_dtype: torch.dtype = torch.bfloat16):
        for g in groups:
            if g["muon"]:
                for key, value in (("lr", lr), ("momentum", momentum), ("nesterov", True), ("ns_steps", 5),
                                   ("ns_coefficients", MUON_COEFFICIENTS), ("eps", 1e-7)):
                    g.setdefault(key, value)
        impl = {"fused": True} if fused else {"foreach": True}
        self._adamw = torch.optim.AdamW([g for g in groups if not g["muon"]], lr=lr, betas=betas, eps=eps, **impl)
        super().__init__(groups, {})  # the same group dicts, the AdamW ones now holding AdamW's defaults
        self.ns_dtype = ns_dtype
        self._share()

    def _share(self) -> None:
        """Point the inner AdamW at this optimizer's groups and state (again after a load replaced them)."""
        self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW does not take a closure"
        for group in self.param_groups:
            if group["muon"]:
                self._muon_update(group)
        self._adamw.step()

    def _muon_update(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
        buffers = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, buffers, group["momentum"]) if group["nesterov"] else buffers
        lr = group["lr"]
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        for p, o in zip(params, orthogonalize(updates, self.ns_dtype, group["ns_steps"], group["ns_coefficients"],
                                              group["eps"])):
            p.add_(o, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._share()


HOST = torch.device("cpu")


class OffloadedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state and update live on `host` while the model lives on its device.

    Each step copies the gradients to fp32 host copies of the parameters, runs the wrapped
    optimizer there (its state is created on the host), and copies the updated values back. The
    device then holds only parameters and gradients: for AdamW that saves 8 bytes per parameter
    (the two moments), the ZeRO-offload use case of training a model bigger than device memory.

    Outside it looks like an optimizer of the device parameters: `param_groups` hold them (LR
    schedules set their hyper-parameters, copied to the host optimizer at each step), `state` is
    keyed by them, and `state_dict` / `load_state_dict` are the host optimizer's (same indices),
    so schedules, ZeRO-1 sharding (`ZeroRedundancyOptimizer` builds one per shard) and
    checkpoints work unchanged; a checkpoint's optimizer state is host tensors.
    """

    def __init__(self, params: list[dict], build, host: torch.device = HOST):
        """params: param groups as for torch.optim; build: host groups -> the wrapped optimizer."""
        host_groups = []
        pin = torch.cuda.is_available() and host.type == "cpu"
        self.host_of: dict[torch.Tensor, torch.nn.Parameter] = {}
        for group in params:
            copies = []
            for p in group["params"]:
                h = p.detach().to(host, torch.float32, copy=True)
                copies.append(torch.nn.Parameter(h.pin_memory() if pin else h))
                self.host_of[p] = copies[-1]
            host_groups.append({**group, "params": copies})
        self.inner = build(host_groups)
        self.host = host
        # bf16/fp16 device parameters: the host optimizer writes their rounded copy in its update pass.
        copies = getattr(self.inner, "device_copies", None)
        for p, h in self.host_of.items() if copies is not None else ():
            if p.dtype in (torch.bfloat16, torch.float16):
                staging = torch.empty(h.shape, dtype=p.dtype)
                copies[h] = staging.pin_memory() if pin else staging
        # Optimizer.__init__ is not called: the groups mirror the host optimizer's, with device params.
        self.defaults = self.inner.defaults
        self.param_groups = [{**g, "params": list(src["params"])} for g, src in zip(self.inner.param_groups, params)]
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def state(self) -> _HostState:
        return _HostState(self)

    def _sync_hyper_parameters(self, src: list[dict], dst: list[dict]) -> None:
        for s, d in zip(src, dst):
            d.update({k: v for k, v in s.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "OffloadedOptimizer does not take a closure"
        self._sync_hyper_parameters(self.param_groups, self.inner.param_groups)
        pairs = list(self.host_of.items())
        for p, h in pairs:
            h.grad = None if p.grad is None else p.grad.to(h.device, torch.float32, non_blocking=True)
        for device in {p.device for p, _ in pairs if p.device.type == "cuda"}:
            torch.cuda.synchronize(device)  # the non-blocking copies must land before the host update
        self.inner.step()
        copies = getattr(self.inner, "device_copies", {})
        for p, h in pairs:
            p.copy_(copies.get(h, h), non_blocking=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.host_of:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self):
        self._sync_hyper_parameters(self.param_groups, self.inner.param_groups)
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
        self._sync_hyper_parameters(self.inner.param_groups, self.param_groups)


class _HostState(MutableMapping):
    """`OffloadedOptimizer.state`: the host optimizer's state, keyed by the device parameters;
    values set here (ZeRO-1 loading a shard's state) move to the host."""

    def __init__(self, optimizer: OffloadedOptimizer):
        self.opt = optimizer

    def __getitem__(self, p):
        return self.opt.inner.state[self.opt.host_of[p]]

    def __setitem__(self, p, value) -> None:
        host = self.opt.host
        self.opt.inner.state[self.opt.host_of[p]] = {
            k: v.to(host) if torch.is_tensor(v) else v for k, v in value.items()}

    def __delitem__(self, p) -> None:
        del self.opt.inner.state[self.opt.host_of[p]]

    def __iter__(self):
        return (p for p, h in self.opt.host_of.items() if h in self.opt.inner.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


# ---------------------------------------------------------------------------------------------
# LAMB
# ---------------------------------------------------------------------------------------------


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), as PopTorch's.

    Per parameter w with gradient g at step t (1-based):

        m = b1*m + (1-b1)*g                 v = b2*v + (1-b2)*g^2
        m_hat = m / (1-b1^t)                v_hat = v / (1-b2^t)      (only if bias_correction)
        u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
        r = min(||w||, max_weight_norm) / ||u||,  or 1 when either norm is 0
        w = w - lr * r * u

    Norms are per tensor, L2, computed in fp32. Parameters without a gradient are skipped and
    their step counter does not advance. State per parameter: `step` (fp32 scalar tensor on the
    CPU, as torch's own optimizers keep it), `exp_avg`, `exp_avg_sq` (parameter dtype/device),
    so `state_dict()` / `load_state_dict()` round-trip exactly.

    Updates use `torch._foreach_*` kernels over each group, bucketed by (device, dtype) so
    parameters spread over several pipeline-stage devices still take the fast path.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_weight_norm: float | None = None,
    ):
        if lr < 0.0:
            raise ValueError(f"Lamb: invalid lr {lr}; must be >= 0")
        if eps < 0.0:
            raise ValueError(f"Lamb: invalid eps {eps}; must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: invalid betas {betas}; each must be in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"Lamb: invalid weight_decay {weight_decay}; must be >= 0")
        if max_weight_norm is not None and max_weight_norm <= 0.0:
            raise ValueError(f"Lamb: invalid max_weight_norm {max_weight_norm}; must be > 0 or None")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_weight_norm=max_weight_norm,
        )
        super().__init__(params, defaults)

    def _bucket(self, group: dict) -> dict[tuple, dict[str, list]]:
        """Collect (param, grad, state) lists of one group per (device, dtype); init state."""
        buckets: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            b = buckets[(p.device, p.dtype)]
            b["params"].append(p)
            b["grads"].append(p.grad)
            b["exp_avgs"].append(state["exp_avg"])
            b["exp_avg_sqs"].append(state["exp_avg_sq"])
            b["steps"].append(state["step"])
        return buckets

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one update of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for bucket in self._bucket(group).values():
                self._update(group, **bucket)
        return loss

    def _update(self, group, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        """Apply one LAMB step to tensors that share a device and dtype."""
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)  # steps live on the CPU: no device sync below

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)  # m = b1*m + (1-b1)*g
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        denom = torch._foreach_sqrt(exp_avg_sqs)
        if group["bias_correction"]:
            ts = [s.item() for s in steps]
            # sqrt(v / bc2) = sqrt(v) / sqrt(bc2); the bias correction of m divides u below.
            torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**t) for t in ts])
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        if group["bias_correction"]:
            torch._foreach_div_(updates, [1.0 - beta1**t for t in ts])
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        # Trust ratio per tensor, kept on the device as one vector of len(params).
        w_norm = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
        u_norm = torch.stack(torch._foreach_norm(updates, 2, dtype=torch.float32))
        if group["max_weight_norm"] is not None:
            w_norm = w_norm.clamp(max=group["max_weight_norm"])
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        torch._foreach_mul_(updates, list(ratio.to(params[0].dtype).unbind(0)))
        torch._foreach_add_(params, updates, alpha=-group["lr"])


class HostLamb(Lamb):
    """Lamb whose update of CPU fp32 tensors runs in the C++ op `gpt2forge::multi_tensor_lamb_` (one
    call per bucket, a trust ratio per tensor); other tensors, and all of them when the library is
    absent, take Lamb's own update, the reference. Same state and `state_dict` as Lamb;
    `device_copies` as in host_optim.HostAdamW."""

    def __init__(self, params, **hyper):
        super().__init__(params, **hyper)
        self.device_copies: dict[torch.Tensor, torch.Tensor] = {}
        self.use_kernel = host_optim.kernel_available()

    def _update(self, group, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        taken, rest, lists = (host_optim.kernel_split(params, grads, exp_avgs, exp_avg_sqs, self.device_copies)
                              if self.use_kernel else ([], list(range(len(params))), []))
        if taken:
            self._kernel_update(group, lists, [steps[i] for i in taken])
        if not rest:
            return
        super()._update(group, *([xs[i] for i in rest] for xs in (params, grads, exp_avgs, exp_avg_sqs, steps)))
        for i in rest:
            if params[i] in self.device_copies:
                self.device_copies[params[i]].copy_(host_optim.local(params[i]))

    def _kernel_update(self, group: dict, lists: list[list], steps: list[torch.Tensor]) -> None:
        """Update the tensors of `host_optim.kernel_split`'s lists with one op call; advances their steps."""
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = group["betas"]
        host_optim.multi_tensor_lamb_(*lists[:4], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                      weight_decay=group["weight_decay"], steps=[s.item() for s in steps],
                                      bias_correction=group["bias_correction"],
                                      max_weight_norm=group["max_weight_norm"], device_copies=lists[4])


# The host-side classes of the optimizers that have a C++ update (the others stay PyTorch's).
_HOST_CLASSES = {torch.optim.AdamW: host_optim.HostAdamW, Lamb: HostLamb}
