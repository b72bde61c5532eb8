"""K-FAC (gpt2forge.train.kfac): the factors equal per-example gradients from autograd, the
preconditioned gradient equals the dense formulas, gradient accumulation equals one batch, a tiny
run learns and resumes exactly, and layouts with split gradients are refused in one line."""

import math
import re
import types

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.parallel.data_parallel import DataParallelStrategy
from gpt2forge.parallel.fsdp import ShardedStrategy
from gpt2forge.parallel.pipeline_strategy import PipelineStrategy
from gpt2forge.parallel.tensor_parallel import TensorParallelStrategy
from gpt2forge.train.config import KfacArgs
from gpt2forge.train.kfac import GRAM_BLOCK, KfacPreconditioner, build_preconditioner, gram

STEP_LINE = re.compile(r"^step (\d+) of epoch (\d+), loss: (\S+), acc: (\S+), lr: (\S+), ")


def kfac_args(**changes) -> KfacArgs:
    """Every Linear preconditioned, factors and decompositions every update, no KL clipping, unless changed."""
    fields = dict(kfac=True, kfac_factor_update_steps=1, kfac_inv_update_steps=1, kfac_kl_clip=0.0,
                  kfac_skip_layers=["no-module-has-this-name"])
    return KfacArgs(**{**fields, **changes})


def tiny_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def row_losses(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(x), y, reduction="none")


def captured_step(kfac: KfacPreconditioner, net: nn.Module, batches: list, rows: int, lr: float = 0.1) -> None:
    """One update over `batches` as train_step does it: the mean row loss, then kfac.step."""
    with kfac.capturing(1.0 / rows):
        for x, y in batches:
            (row_losses(net, x, y).sum() / rows).backward()
    kfac.step(lr)


def data(rows: int = 8):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (rows,), generator=gen)


def test_factors_equal_per_example_gradients_from_autograd():
    net, (x, y) = tiny_net(), data()
    decay = 0.75
    kfac = KfacPreconditioner(net, kfac_args(kfac_factor_decay=decay))
    captured_step(kfac, net, [(x, y)], len(x))

    # Per-example gradients: for row r, dℓ_r/db = δ_r and dℓ_r/dW = δ_r a_r^T, so a_r = (dℓ_r/dW)^T δ_r / |δ_r|^2.
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss_of_row(p, xr, yr):
        return row_losses(lambda inp: functional_call(net, p, (inp,)), xr[None], yr[None])[0]

    per_row = vmap(grad(loss_of_row), in_dims=(None, 0, 0))(params, x, y)
    for i, name in ((0, "0"), (1, "2")):
        delta, dw = per_row[f"{name}.bias"], per_row[f"{name}.weight"]  # (R, out), (R, out, in)
        a = torch.einsum("roi,ro->ri", dw, delta) / (delta**2).sum(1, keepdim=True)
        a_bar = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        A = a_bar.T @ a_bar / len(x)
        G = delta.T @ delta / len(x)
        layer = kfac.layers[i]
        eye_a, eye_g = torch.eye(A.shape[0], dtype=A.dtype), torch.eye(G.shape[0], dtype=G.dtype)
        torch.testing.assert_close(layer.A.double(), decay * eye_a + (1 - decay) * A, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.G.double(), decay * eye_g + (1 - decay) * G, rtol=1e-5, atol=1e-7)


def spd(n: int, seed: int) -> torch.Tensor:
    m = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    return m @ m.T / n + 0.1 * torch.eye(n)


def preconditioned(method: str, damping: float, kl_clip: float = 0.0, lr: float = 0.1):
    """A 3-in, 4-out layer with set factors and gradient: (kfac's result, A, G, the raw gradient [∇W, ∇b])."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 4)
    kfac = KfacPreconditioner(layer, kfac_args(kfac_compute_method=method, kfac_damping=damping,
                                               kfac_kl_clip=kl_clip))
    A, G = spd(4, 1), spd(4, 2)
    kfac.layers[0].A, kfac.layers[0].G = A, G
    layer.weight.grad, layer.bias.grad = torch.randn(4, 3), torch.randn(4)
    raw = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    kfac.steps = 1  # not a factor update: the set factors are decomposed and used as they are
    kfac.step(lr)
    return torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1), A, G, raw


def test_inverse_method_equals_dense_damped_inverses():
    lam = 0.01
    v, A, G, raw = preconditioned("inverse", lam)
    dense = torch.linalg.inv(G + lam * torch.eye(4)) @ raw @ torch.linalg.inv(A + lam * torch.eye(4))
    torch.testing.assert_close(v, dense, rtol=1e-4, atol=1e-5)


def test_eigen_method_solves_the_damped_kronecker_system():
    lam = 0.01
    v, A, G, raw = preconditioned("eigen", lam)
    # (A ⊗ G + λI)^-1 ∇ with row-major vec: vec(G V A) = (G ⊗ A) vec(V) for symmetric A.
    dense = torch.linalg.solve(torch.kron(G, A).double() + lam * torch.eye(16, dtype=torch.float64),
                               raw.double().reshape(-1)).reshape(4, 4)
    torch.testing.assert_close(v.double(), dense, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(G @ v @ A + lam * v, raw, rtol=1e-4, atol=1e-5)


def test_kl_clip_scales_every_preconditioned_gradient():
    lam, lr, kl_clip = 0.01, 0.5, 1e-3
    plain, *_, raw = preconditioned("inverse", lam, lr=lr)
    clipped, *_ = preconditioned("inverse", lam, kl_clip=kl_clip, lr=lr)
    vg = float((plain * raw).sum())
    nu = min(1.0, math.sqrt(kl_clip / abs(lr**2 * vg)))
    assert nu < 1  # the bound is active
    torch.testing.assert_close(clipped, nu * plain, rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_gives_the_factors_of_one_batch():
    (x, y), results = data(8), []
    for batches in ([(x, y)], [(x[:4], y[:4]), (x[4:], y[4:])]):
        net = tiny_net()
        kfac = KfacPreconditioner(net, kfac_args())
        captured_step(kfac, net, batches, len(x))
        results.append([t for layer in kfac.layers for t in (layer.A, layer.G)] + [p.grad for p in net.parameters()])
    # The factors are kept in fp32, so the preconditioned (float64) gradients carry fp32 rounding: summing
    # the factor in two halves may move its last bit (seen on an AVX-512 Xeon: 1.2e-7, relative 2.5e-6).
    for one, accumulated in zip(*results):
        torch.testing.assert_close(one, accumulated, rtol=1e-5, atol=1e-6)


def test_hooks_count_nothing_outside_a_factor_update_or_without_gradients():
    net, (x, y) = tiny_net(), data()
    kfac = KfacPreconditioner(net, kfac_args(kfac_factor_update_steps=2))
    with torch.no_grad(), kfac.capturing(1.0):
        net(x)
    row_losses(net, x, y).sum().backward()  # not capturing
    assert all(layer.rows == 0 for layer in kfac.layers)
    kfac.steps = 1  # an update between factor updates: capturing is off
    with kfac.capturing(1.0):
        row_losses(net, x, y).sum().backward()
    assert all(layer.rows == 0 for layer in kfac.layers)


def step_lines(text: str) -> list[tuple[str, ...]]:
    return [m.groups() for line in text.splitlines() if (m := STEP_LINE.match(line))]


def run_args(cfg, out, *extra: str) -> list[str]:
    return ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--gradient-accumulation", "2", "--device-iterations", "1", "--epochs", "3", "--num-workers", "0",
            "--learning-rate", "3e-3", "--max-grad-norm", "1.0", "--checkpoint-output-dir", str(out),
            "--kfac", "--kfac-factor-update-steps", "2", "--kfac-inv-update-steps", "3", *extra]


def test_training_with_kfac_learns_and_resumes_exactly(make_tiny_config, tmp_path, capsys):
    cfg = make_tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main(run_args(cfg, full, "--save-per-steps", "5")) == 0
    out = capsys.readouterr().out
    assert "K-FAC: 8 nn.Linear layers (transformer.h.0.attn.c_attn ... transformer.h.1.mlp.c_proj), eigen" in out
    lines = step_lines(out)
    assert len(lines) == 12 and float(lines[-1][2]) < float(lines[0][2])
    state = torch.load(full / "step_5" / "training_state.pt", weights_only=True)["kfac"]
    assert state["steps"] == 5 and {"A", "G", "QA", "dA", "QG", "dG"} <= set(
        state["layers"]["transformer.h.0.mlp.c_fc"])

    # Step 5 sits between decompositions (at 3 and 6) and factor updates (at 4 and 6): the resumed
    # run needs the saved factors and decompositions to continue exactly.
    assert train_main(run_args(cfg, part, "--checkpoint-input-dir", str(full / "step_5"),
                               "--resume-training-from-checkpoint", "true")) == 0
    assert step_lines(capsys.readouterr().out) == lines[5:]


def test_kfac_changes_the_updates(make_tiny_config, tmp_path, capsys):
    cfg = make_tiny_config()
    args = run_args(cfg, tmp_path / "a", "--epochs", "1")
    assert train_main(args) == 0
    with_kfac = step_lines(capsys.readouterr().out)
    assert train_main(args[:args.index("--kfac")] + ["--epochs", "1"]) == 0
    without = step_lines(capsys.readouterr().out)
    assert with_kfac[0] == without[0] and with_kfac[1:] != without[1:]  # same first loss, other updates


def test_layouts_with_split_gradients_are_refused_in_one_line():
    class Sharded:  # a strategy whose processes hold parts of the gradients (FSDP2, pipeline stages)
        whole_gradients = False

    with pytest.raises(UsageError) as err:
        build_preconditioner(KfacArgs(kfac=True), Sharded())
    assert "\n" not in str(err.value) and "FSDP2" in str(err.value) and "pipeline" in str(err.value)
    assert build_preconditioner(KfacArgs(), Sharded()) is None


def test_only_unsplit_strategies_say_their_gradients_are_whole():
    whole = {name: cls.whole_gradients.fget(types.SimpleNamespace(processes_per_replica=1))
             for name, cls in ((c.__name__, c) for c in (DataParallelStrategy, ShardedStrategy, PipelineStrategy,
                                                         TensorParallelStrategy))}
    assert whole == {"DataParallelStrategy": True, "ShardedStrategy": False, "PipelineStrategy": False,
                     "TensorParallelStrategy": False}


@pytest.mark.parametrize("flags, problem", [
    (["--kfac-damping", "0"], "--kfac-damping must be > 0"),
    (["--kfac-factor-decay", "1.5"], "--kfac-factor-decay must be in (0, 1]"),
    (["--kfac-inv-update-steps", "0"], "--kfac-inv-update-steps must be >= 1"),
    (["--kfac-skip-layers", "("], "--kfac-skip-layers '(': not a regular expression"),
])
def test_bad_kfac_flags_are_one_line(flags, problem, capsys):
    assert train_main(["--dataset", "generated", "--kfac", *flags]) == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("n", [40, 2 * GRAM_BLOCK, 3 * GRAM_BLOCK + 5])
def test_gram_by_blocks_equals_the_full_product(n):
    # From 2 GRAM_BLOCK columns on, only the blocks on and above the diagonal are multiplied.
    x = torch.randn(64, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    out = gram(x)
    torch.testing.assert_close(out, x.T @ x, rtol=1e-12, atol=1e-10)
    if n >= 2 * GRAM_BLOCK:
        assert torch.equal(out[:GRAM_BLOCK, GRAM_BLOCK:], out[GRAM_BLOCK:, :GRAM_BLOCK].T)  # mirrored
