"""The optimizer update on the host: the C++ ops `gpt2forge::multi_tensor_adamw_` / `multi_tensor_lamb_`
(and their one-tensor forms `adamw_step_` / `lamb_step_`) and `HostAdamW`.

With `--optimizer-state-offchip` the fp32 master weights and Adam moments live in host memory and
the update runs on the CPU, where it is bound by memory bandwidth (28 bytes of fp32 state move per
parameter). custom_ops/host_optim.cpp updates a whole param group in one call: one multithreaded
region over pieces of every tensor, each piece one vectorized (AVX-512 / AVX2 / portable, chosen at
run time) pass that can write the bf16/fp16 copy for the device too; benchmarks/host_optimizer.py
measures it against torch.optim.AdamW and DeepSpeed.

`HostAdamW` is a `torch.optim.AdamW` (same param groups, same `state` and `state_dict` layout:
`step`, `exp_avg`, `exp_avg_sq`), so checkpoints move freely between the two. Its `step` sends the
CPU fp32 tensors of each group through one op call and everything else (amsgrad, maximize, other
devices or dtypes, the library not built) through torch's own AdamW, which is the reference of
tests/ops/test_host_optim.py. DTensor parameters (FSDP2 shards offloaded to the CPU) are updated
through their local tensors. The LAMB counterpart, `HostLamb`, lives beside its reference in
gpt2forge.train.optim.

May import: gpt2forge.core.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as torch_adam

from gpt2forge.core import log
from gpt2forge.ops import library as custom_ops

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COPY_DTYPES = (torch.bfloat16, torch.float16)


def kernel_available() -> bool:
    """Whether the library is loaded and has the host optimizer ops (one notice line if not)."""
    if not custom_ops.load_custom_ops():
        return False  # load_custom_ops printed why
    if hasattr(torch.ops.gpt2forge, "multi_tensor_adamw_"):
        return True
    log.notice("the custom ops library predates gpt2forge::multi_tensor_adamw_ (rebuild it with `make`); "
               "the host optimizer update runs in PyTorch")
    return False


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (same storage: in-place updates reach the DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def kernel_accepts(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   device_copy: torch.Tensor | None = None) -> bool:
    """Whether the ops take these (local) tensors: CPU, contiguous, one size; param and moments
    fp32, grad fp32/bf16/fp16, the device copy absent or bf16/fp16."""
    # Called for every tensor of every step: plain attribute tests, no generator.
    n = param.numel()
    return (param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32 and grad.dtype in _GRAD_DTYPES
            and param.is_cpu and grad.is_cpu and exp_avg.is_cpu and exp_avg_sq.is_cpu
            and param.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous()
            and exp_avg_sq.is_contiguous() and grad.numel() == n and exp_avg.numel() == n and exp_avg_sq.numel() == n
            and (device_copy is None or (device_copy.dtype in _COPY_DTYPES and device_copy.is_cpu
                                         and device_copy.is_contiguous() and device_copy.numel() == n)))


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                device_copy: torch.Tensor | None = None) -> None:
    """One AdamW update of one tensor in place (torch.optim.AdamW's math, `step` = the count after
    this update); writes `device_copy` (bf16/fp16) from the new param when given. Tensors as
    `kernel_accepts`."""
    torch.ops.gpt2forge.adamw_step_(param, grad, exp_avg, exp_avg_sq, device_copy, float(lr), beta1, beta2,
                                    eps, weight_decay, float(step))


def multi_tensor_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                        exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, steps: list[float],
                        device_copies: list[torch.Tensor | None] | None = None) -> None:
    """`adamw_step_` of every tensor i of the lists in one op call (one parallel region), with its
    own step count `steps[i]` and copy `device_copies[i]` (None: no copy); bit for bit the same
    values as one `adamw_step_` per tensor."""
    torch.ops.gpt2forge.multi_tensor_adamw_(params, grads, exp_avgs, exp_avg_sqs, device_copies or [], float(lr),
                                            beta1, beta2, eps, weight_decay, steps)


def lamb_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
               bias_correction: bool, max_weight_norm: float | None,
               device_copy: torch.Tensor | None = None) -> None:
    """One LAMB update of one tensor in place (gpt2forge.train.optim.Lamb's math, trust ratio per
    tensor); `device_copy` as in `adamw_step_`."""
    torch.ops.gpt2forge.lamb_step_(param, grad, exp_avg, exp_avg_sq, device_copy, float(lr), beta1, beta2, eps,
                                   weight_decay, float(step), bias_correction, max_weight_norm)


def multi_tensor_lamb_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, steps: list[float], bias_correction: bool, max_weight_norm: float | None,
                       device_copies: list[torch.Tensor | None] | None = None) -> None:
    """`lamb_step_` of every tensor of the lists (each its own trust ratio) in one op call: two
    parallel regions, the norms between them; the same values as one `lamb_step_` per tensor."""
    torch.ops.gpt2forge.multi_tensor_lamb_(params, grads, exp_avgs, exp_avg_sqs, device_copies or [], float(lr),
                                           beta1, beta2, eps, weight_decay, steps, bias_correction, max_weight_norm)


def kernel_split(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], device_copies: dict[torch.Tensor, torch.Tensor]
                 ) -> tuple[list[int], list[int], list[list]]:
    """Which tensors of a group the ops take: (their indices, the others' indices, the ops' lists
    [params, grads, exp_avgs, exp_avg_sqs, device_copies] of local tensors, in index order;
    device_copies holds None for a tensor without a copy, and is empty when `device_copies` is)."""
    taken, rest = [], []
    lists: list[list] = [[], [], [], [], []]
    ps, gs, ms, vs, cs = lists
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        copy = device_copies.get(p)
        p, g, m, v = local(p), local(g), local(m), local(v)
        if kernel_accepts(p, g, m, v, copy):
            taken.append(i)
            ps.append(p)
            gs.append(g)
            ms.append(m)
            vs.append(v)
            cs.append(copy)
        else:
            rest.append(i)
    if not device_copies:
        lists[4] = []
    return taken, rest, lists


class HostAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose update of CPU fp32 tensors runs in `gpt2forge::multi_tensor_adamw_`
    (one call per param group).

    `device_copies` maps a parameter to a bf16/fp16 tensor of its size that each step fills with
    the updated weights, rounded (in the same pass when the op runs). `foreach` / `fused` choose
    torch's implementation for the tensors the op does not take, and appear in the param groups
    (hence checkpoints) exactly as the plain optimizer's.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach, fused=fused)
        self.device_copies: dict[torch.Tensor, torch.Tensor] = {}
        self.use_kernel = kernel_available()

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            kernel = self.use_kernel and not (has_complex or group["amsgrad"] or group["maximize"]
                                              or group["capturable"] or group["differentiable"])
            taken, rest, lists = (kernel_split(params, grads, exp_avgs, exp_avg_sqs, self.device_copies) if kernel
                                  else ([], list(range(len(params))), []))
            if taken:
                self._kernel_step(group, lists, [steps[i] for i in taken])
            if rest:
                self._reference_step(group, [[xs[i] for i in rest] for xs in (params, grads, exp_avgs, exp_avg_sqs,
                                                                              steps)],
                                     [max_exp_avg_sqs[i] for i in rest] if group["amsgrad"] else [], has_complex)
        return loss

    def _kernel_step(self, group: dict, lists: list[list], steps: list[torch.Tensor]) -> None:
        """Update the tensors of `kernel_split`'s lists with one op call; advances their steps."""
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = group["betas"]
        multi_tensor_adamw_(*lists[:4], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"], steps=[s.item() for s in steps],
                            device_copies=lists[4])

    def _reference_step(self, group: dict, lists: list[list[torch.Tensor]], max_exp_avg_sqs: list,
                        has_complex: bool) -> None:
        """torch's AdamW (the functional form its class calls) over the tensors the op does not take."""
        params, grads, exp_avgs, exp_avg_sqs, steps = lists
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
        beta1, beta2 = group["betas"]
        torch_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=group["foreach"],
             capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
             has_complex=has_complex, decoupled_weight_decay=True, amsgrad=group["amsgrad"], beta1=beta1,
             beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=group["maximize"])
        for p in params:
            if p in self.device_copies:
                self.device_copies[p].copy_(local(p))
