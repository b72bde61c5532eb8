"""The host optimizer ops (custom_ops/host_optim.cpp) against their references, torch.optim.AdamW
and gpt2forge.train.optim.Lamb, the multi-tensor ops against the one-tensor ops (bit for bit), and
their wiring into --optimizer-state-offchip.

Tolerances: the op repeats torch's fused CPU AdamW operation by operation (its vector lanes agree
bit for bit; torch computes the last size % 8 elements partly in double), and torch's default
single-tensor AdamW divides in another order (addcdiv): values agree to a few fp32 ulps, rtol
1e-6, atol 1e-7 after 20 steps. LAMB's two norms are summed in another order than torch._foreach_norm: its
trust ratio, hence each update, agrees to ~1e-6 relative: rtol 1e-5, atol 1e-6.

The tests use the library `make` built (library_path(): build/custom_ops, or $GPT2FORGE_OPS_LIB) and skip when it
is absent or predates these ops; building it here would cost minutes on two cores.
"""

from __future__ import annotations

import functools

import pytest
import torch

from gpt2forge.ops import host_optim
from gpt2forge.ops import library as custom_ops
from gpt2forge.ops.library import LIBRARY_ENV, LIBRARY_NAME
from gpt2forge.train.optim import HostLamb, Lamb, OffloadedOptimizer, build_optimizer

SIZES = [1, 7, 1023, 4099, 40_003]  # odd tails of every vector width; the last spans several parallel chunks
STEPS = 20


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The ops, loaded; counts the calls that reach them so a test knows the kernel ran."""
    custom_ops.load_custom_ops.cache_clear()
    if not host_optim.kernel_available():
        pytest.skip("custom ops library without the host optimizer ops: run `make`")
    calls = {"adamw": 0, "lamb": 0}
    for name in ("adamw", "lamb"):
        for attr in (f"{name}_step_", f"multi_tensor_{name}_"):
            op = getattr(host_optim, attr)

            def counted(*args, _op=op, _name=name, **kwargs):
                calls[_name] += 1
                return _op(*args, **kwargs)
            monkeypatch.setattr(host_optim, attr, counted)
    return calls


@pytest.fixture
def no_library(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "missing" / LIBRARY_NAME))
    monkeypatch.setattr(custom_ops, "_ops_registered", lambda: False)
    custom_ops.load_custom_ops.cache_clear()
    yield
    custom_ops.load_custom_ops.cache_clear()


def run(make_opt, p0: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(p0.clone())
    opt = make_opt([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


def data(n: int, steps: int = STEPS, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + n)
    return torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_op_equals_torch_adamw(kernel, n: int, weight_decay: float):
    p0, grads = data(n)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    ours, ours_opt = run(lambda ps: host_optim.HostAdamW(ps, **hyper), p0, grads)
    assert kernel["adamw"] == STEPS
    fused, fused_opt = run(lambda ps: torch.optim.AdamW(ps, **hyper, fused=True), p0, grads)
    plain, plain_opt = run(lambda ps: torch.optim.AdamW(ps, **hyper), p0, grads)
    torch.testing.assert_close(ours, fused, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours_opt.state[ours][key], fused_opt.state[fused][key], rtol=1e-6, atol=1e-9)
    assert ours_opt.state[ours]["step"].item() == STEPS


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, 4099])
def test_device_copy_is_the_rounded_update_and_low_precision_grads_widen(kernel, copy_dtype, n: int):
    p0, grads = data(n, steps=5)
    grads = [g.to(copy_dtype) for g in grads]  # representable in copy_dtype: widening them is exact
    hyper = dict(lr=1e-2, weight_decay=0.1)
    expected, _ = run(lambda ps: torch.optim.AdamW(ps, **hyper, fused=True), p0, [g.float() for g in grads])
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    copy = torch.full((n,), float("nan"), dtype=copy_dtype)
    for step, g in enumerate(grads, 1):  # a bf16/fp16 gradient of an fp32 master weight
        host_optim.adamw_step_(p, g, m, v, beta1=0.9, beta2=0.999, eps=1e-8, step=step, device_copy=copy, **hyper)
    assert kernel["adamw"] == len(grads)
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(copy, p.to(copy_dtype))  # rounded to nearest even, as torch rounds


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bias_correction,weight_decay,max_weight_norm",
                         [(True, 0.0, None), (False, 0.1, None), (True, 0.1, 1.0)])
def test_lamb_op_equals_project_lamb(kernel, n, bias_correction, weight_decay, max_weight_norm):
    p0, grads = data(n)
    hyper = dict(lr=1e-2, weight_decay=weight_decay, bias_correction=bias_correction,
                 max_weight_norm=max_weight_norm)
    ours, ours_opt = run(lambda ps: HostLamb(ps, **hyper), p0, grads)
    assert kernel["lamb"] == STEPS
    ref, ref_opt = run(lambda ps: Lamb(ps, **hyper), p0, grads)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours_opt.state[ours][key], ref_opt.state[ref][key], rtol=1e-5, atol=1e-7)


def multi_tensor_case(seed: int = 0):
    """Tensors of every odd size plus two spanning several pieces, fp32 and bf16 grads, a bf16 copy
    on every other one, and step counts that differ per tensor (a tensor can miss a step)."""
    sizes = [*SIZES, 3 * (1 << 15) + 13, 1 << 17]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16 if i % 3 == 1 else torch.float32)
             for i, n in enumerate(sizes)]
    moments = [[torch.rand(n, generator=gen) * 1e-2 for n in sizes] for _ in range(2)]
    copies = [torch.empty(n, dtype=torch.bfloat16) if i % 2 else None for i, n in enumerate(sizes)]
    steps = [float(3 + i % 4) for i in range(len(sizes))]
    return params, grads, *moments, copies, steps


@pytest.mark.parametrize("name", ["adamw", "lamb"])
@pytest.mark.parametrize("threads", [1, 2])
def test_multi_tensor_op_equals_one_tensor_op_bit_for_bit(kernel, name, threads):
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    if name == "lamb":
        hyper.update(bias_correction=True, max_weight_norm=None)
    params, grads, exp_avgs, exp_avg_sqs, copies, steps = multi_tensor_case()
    one = [[t.clone() if t is not None else None for t in xs] for xs in (params, exp_avgs, exp_avg_sqs, copies)]
    for p, g, m, v, c, step in zip(one[0], grads, one[1], one[2], one[3], steps):
        getattr(host_optim, f"{name}_step_")(p, g, m, v, step=step, device_copy=c, **hyper)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # pieces, not threads, fix each element's path and each norm's order
    try:
        getattr(host_optim, f"multi_tensor_{name}_")(params, grads, exp_avgs, exp_avg_sqs, steps=steps,
                                                      device_copies=copies, **hyper)
    finally:
        torch.set_num_threads(previous)
    assert kernel[name] == len(params) + 1
    for ours, ref in zip((params, exp_avgs, exp_avg_sqs, copies), one):
        for i, (x, y) in enumerate(zip(ours, ref)):
            assert (x is None and y is None) or torch.equal(x, y), f"tensor {i} of {params[i].numel()} elements"


def test_host_adamw_updates_a_group_in_one_call_and_leaves_the_rest_to_torch(kernel):
    gen = torch.Generator().manual_seed(0)
    p0 = [torch.randn(n, generator=gen) for n in SIZES] + [torch.randn(9, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in p0] for _ in range(STEPS)]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    results = []
    for cls in (host_optim.HostAdamW, functools.partial(torch.optim.AdamW, fused=True)):
        params = [torch.nn.Parameter(p.clone()) for p in p0]
        opt = cls([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], **hyper)
        for step, gs in enumerate(grads):
            for i, (p, g) in enumerate(zip(params, gs)):
                p.grad = None if (i == 0 and step % 5 == 4) else g.clone()  # tensor 0 misses some steps
            opt.step()
        results.append((params, opt))
    assert kernel["adamw"] == 2 * STEPS  # one call per param group per step, the fp64 tensor in torch
    (ours, ours_opt), (ref, ref_opt) = results
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert ours_opt.state[p]["step"].item() == ref_opt.state[q]["step"].item()
    assert ours_opt.state[ours[0]]["step"].item() == STEPS - STEPS // 5


def test_tensors_the_op_does_not_take_use_torch(kernel):
    p0, grads = data(33, steps=3)
    for hyper, dtype in [(dict(amsgrad=True), torch.float32), (dict(maximize=True), torch.float32),
                         ({}, torch.float64)]:
        cast = [g.to(dtype) for g in grads]
        ours, _ = run(functools.partial(host_optim.HostAdamW, lr=1e-2, **hyper), p0.to(dtype), cast)
        ref, _ = run(functools.partial(torch.optim.AdamW, lr=1e-2, **hyper), p0.to(dtype), cast)
        assert torch.equal(ours, ref), hyper
    assert kernel["adamw"] == 0
    strided = p0[:32].view(4, 8).t()  # not contiguous: the op refuses it, Lamb's own update runs
    ours, _ = run(lambda ps: HostLamb(ps, lr=1e-2), strided, [g[:32].view(4, 8).t() for g in grads])
    ref, _ = run(lambda ps: Lamb(ps, lr=1e-2), strided, [g[:32].view(4, 8).t() for g in grads])
    assert not ours.is_contiguous() and torch.equal(ours, ref) and kernel["lamb"] == 0


def test_without_library_host_optimizers_are_torch_with_one_notice(no_library, capsys):
    p0, grads = data(1023, steps=3)
    ours, ours_opt = run(lambda ps: host_optim.HostAdamW(ps, lr=1e-2, weight_decay=0.1), p0, grads)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), p0, grads)
    assert not ours_opt.use_kernel and torch.equal(ours, ref)
    ours, _ = run(lambda ps: HostLamb(ps, lr=1e-2), p0, grads)
    ref, _ = run(lambda ps: Lamb(ps, lr=1e-2), p0, grads)
    assert torch.equal(ours, ref)
    assert capsys.readouterr().err == custom_ops.NOT_BUILT_NOTICE + "\n"


def test_state_dict_is_interchangeable_with_torch_adamw(kernel):
    p0, grads = data(4099, steps=6)
    hyper = dict(lr=1e-2, weight_decay=0.1)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, **hyper, fused=True), p0, grads)
    # 3 steps with one, the state moved to the other, 3 more: both directions equal 6 plain steps.
    for first, second in [(host_optim.HostAdamW, torch.optim.AdamW), (torch.optim.AdamW, host_optim.HostAdamW)]:
        p, opt = run(functools.partial(first, **hyper, fused=True), p0, grads[:3])
        state = opt.state_dict()
        assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
        resumed = second([p], **hyper, fused=True)
        resumed.load_state_dict(state)
        for g in grads[3:]:
            p.grad = g.clone()
            resumed.step()
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7, msg=f"{first.__name__} -> {second.__name__}")


def tiny_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from gpt2forge.model.config import ModelConfig  # why: the model layer is above ops; only these tests need it
    from gpt2forge.model.gpt2 import GPT2LMHeadModel  # why: as above

    torch.manual_seed(0)
    return GPT2LMHeadModel(ModelConfig(vocab_size=67, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)).to(dtype)


def train(model, opt, steps: int = 3) -> None:
    for step in range(steps):
        ids = torch.randint(0, 67, (2, 12), generator=torch.Generator().manual_seed(step))
        model(ids, ids).loss_sum.float().div(ids.numel()).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name,host_cls", [("AdamW", host_optim.HostAdamW), ("LAMB", HostLamb)])
def test_offloaded_optimizer_uses_the_op_and_plain_runs_do_not(kernel, name, host_cls):
    model, plain_model = tiny_model(), tiny_model()
    opt = build_optimizer(model, name, 1e-2, 0.1, offload=True)
    assert isinstance(opt, OffloadedOptimizer) and type(opt.inner) is host_cls
    plain = build_optimizer(plain_model, name, 1e-2, 0.1)
    assert not isinstance(plain, (host_optim.HostAdamW, HostLamb))  # no offload: unchanged
    # One LAMB step only: the attention key bias gets a gradient of pure rounding noise (softmax
    # ignores it), which LAMB's u = g / (|g| + eps) amplifies once the weights differ by an ulp.
    steps = 3 if name == "AdamW" else 1
    train(model, opt, steps)
    train(plain_model, plain, steps)
    assert kernel["adamw" if name == "AdamW" else "lamb"] > 0
    for (key, p), q in zip(model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=key)


def test_offloaded_bf16_parameters_get_the_copy_written_by_the_op(kernel):
    model = tiny_model(torch.bfloat16)
    opt = build_optimizer(model, "AdamW", 1e-2, 0.1, offload=True)
    assert len(opt.inner.device_copies) == len(list(model.parameters()))
    train(model, opt, steps=2)
    for p in model.parameters():
        assert torch.equal(p.detach(), opt.host_of[p].detach().to(torch.bfloat16))


def test_fsdp2_cpu_offloaded_shards_use_the_op(kernel):
    """FSDP2 with CPU offload: the strategy's placement says the update runs on the host
    (OptimizerPlacement.host_update), and the host kernel updates the shards as torch's AdamW would."""
    import torch.distributed as dist

    from gpt2forge.parallel.distributed import shard_model  # why: the parallel layer is above ops

    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, plain_model = tiny_model(), tiny_model()
        shard_model(model, 3, offload=True, device=torch.device("cpu"))
        opt = build_optimizer(model, "AdamW", 1e-2, 0.1, host_update=True)
        assert type(opt) is host_optim.HostAdamW
        assert type(build_optimizer(model, "AdamW", 1e-2, 0.1)) is torch.optim.AdamW  # not on the host: torch's
        plain = build_optimizer(plain_model, "AdamW", 1e-2, 0.1)
        train(model, opt)
        train(plain_model, plain)
        assert kernel["adamw"] > 0
        for (key, p), q in zip(model.named_parameters(), plain_model.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=key)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_benchmark_quick_runs(kernel, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "host_optimizer.py"
    spec = importlib.util.spec_from_file_location("host_optimizer_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--bf16-copy"]) == 0
    out = capsys.readouterr().out
    assert "C++ op (HostAdamW)" in out and "GB/s" in out and "torch AdamW fused" in out
