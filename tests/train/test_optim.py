"""Tests for gpt2forge.train.optim: parameter groups, optimizers (LAMB parity), LR schedules."""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import pytest
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.train.optim import (
    OPTIMIZERS,
    SCHEDULES,
    Lamb,
    build_lr_schedule,
    build_optimizer,
    param_groups,
    resolve_warmup_steps,
)


class TiedLM(torch.nn.Module):
    """Embedding -> LayerNorm -> Linear -> output Linear whose weight is the embedding's."""

    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tie, as GPT-2 does

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.fc(self.ln(self.wte(ids))))


def _lm_loss(model: TiedLM, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (4, 5), generator=g)
    logits = model(ids)  # (B, T, vocab)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


# ---------------------------------------------------------------------------------------------
# param_groups
# ---------------------------------------------------------------------------------------------


def test_param_groups_split_by_ndim_with_tied_weights():
    model = TiedLM()
    model.fc.bias.requires_grad_(False)  # frozen parameters are left out
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0

    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)), "a parameter appears twice"
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 for p in no_decay["params"])
    # The tied embedding / lm_head weight is listed exactly once.
    assert sum(p is model.wte.weight for p in decay["params"]) == 1
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(ids) == expected
    assert {id(p) for p in no_decay["params"]} == {id(model.ln.weight), id(model.ln.bias)}
    assert {id(p) for p in decay["params"]} == {id(model.wte.weight), id(model.fc.weight)}


# ---------------------------------------------------------------------------------------------
# build_optimizer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_reduces_quadratic_loss(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    target_w, target_b = torch.randn(3, 4), torch.randn(3)

    def loss_fn():
        return ((model.weight - target_w) ** 2).sum() + ((model.bias - target_b) ** 2).sum()

    opt = build_optimizer(model, name, lr=0.05, weight_decay=0.01)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay_of == {id(model.weight): 0.01, id(model.bias): 0.0}
    start = loss_fn().item()
    for _ in range(50):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    assert loss_fn().item() < 0.5 * start


def test_optimizer_classes_and_fused_selection():
    model = torch.nn.Linear(4, 3)
    adamw = build_optimizer(model, "AdamW", lr=1e-3, weight_decay=0.1, device_type="cpu")
    adam = build_optimizer(model, "Adam", lr=1e-3, weight_decay=0.1, device_type="cpu")
    assert type(adamw) is torch.optim.AdamW and type(adam) is torch.optim.Adam
    assert adamw.defaults["fused"] is True and adam.defaults["fused"] is True
    # A device type without fused kernels falls back to foreach.
    other = build_optimizer(model, "AdamW", lr=1e-3, weight_decay=0.1, device_type="meta")
    assert not other.defaults["fused"] and other.defaults["foreach"] is True
    lamb = build_optimizer(model, "LAMB", lr=1e-3, weight_decay=0.1)
    lamb_nbc = build_optimizer(model, "LAMBNoBiasCorrection", lr=1e-3, weight_decay=0.1)
    assert isinstance(lamb, Lamb) and lamb.defaults["bias_correction"] is True
    assert isinstance(lamb_nbc, Lamb) and lamb_nbc.defaults["bias_correction"] is False
    assert lamb.defaults["max_weight_norm"] is None and lamb.defaults["eps"] == 1e-8


def test_adam_flags_reach_the_optimizer():
    cfg = parse_args(["--dataset", "generated"])
    assert (cfg.optim.adam_beta1, cfg.optim.adam_beta2, cfg.optim.adam_eps) == (0.9, 0.999, 1e-8)  # PyTorch's
    cfg = parse_args(["--dataset", "generated", "--adam-eps", "1e-6", "--adam-beta1", "0.8", "--adam-beta2", "0.95"])
    for name in ("AdamW", "LAMB"):
        opt = build_optimizer(torch.nn.Linear(2, 2), name, lr=1e-3, weight_decay=0.0, eps=cfg.optim.adam_eps,
                              betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2))
        assert opt.defaults["eps"] == 1e-6 and opt.defaults["betas"] == (0.8, 0.95)
    for bad in (["--adam-eps", "-1"], ["--adam-beta2", "1.0"]):
        with pytest.raises(UsageError, match=bad[0]):
            parse_args(["--dataset", "generated", *bad])


def test_unknown_optimizer_names_flag():
    with pytest.raises(UsageError, match="--optimizer SGD .*AdamW, Adam, LAMB, LAMBNoBiasCorrection"):
        build_optimizer(torch.nn.Linear(2, 2), "SGD", lr=1e-3, weight_decay=0.0)


def test_negative_lr_or_decay_names_flag():
    with pytest.raises(UsageError, match="--learning-rate"):
        build_optimizer(torch.nn.Linear(2, 2), "AdamW", lr=-1.0, weight_decay=0.0)
    with pytest.raises(UsageError, match="--weight-decay"):
        build_optimizer(torch.nn.Linear(2, 2), "AdamW", lr=1e-3, weight_decay=-0.1)


# ---------------------------------------------------------------------------------------------
# Lamb vs a per-tensor reference
# ---------------------------------------------------------------------------------------------


def _reference_lamb_step(p, g, state, lr, betas, eps, wd, bias_correction, max_weight_norm=None):
    """Textbook LAMB on one tensor, in float64, written without foreach."""
    b1, b2 = betas
    state["t"] = state.get("t", 0) + 1
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).add_(g * g, alpha=1 - b2)
    m_hat, v_hat = (m / (1 - b1 ** state["t"]), v / (1 - b2 ** state["t"])) if bias_correction else (m, v)
    u = m_hat / (v_hat.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm().item(), u.norm().item()
    if max_weight_norm is not None:
        w_norm = min(w_norm, max_weight_norm)
    r = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    p.sub_(lr * r * u)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("max_weight_norm", [None, 0.5])
def test_lamb_matches_reference(bias_correction, max_weight_norm):
    torch.manual_seed(0)
    model = TiedLM()
    ref_params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ref_state = {n: {} for n in ref_params}
    groups = param_groups(model, weight_decay=0.1)
    wd_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6)
    opt = Lamb(groups, bias_correction=bias_correction, max_weight_norm=max_weight_norm, **kw)

    for step in range(5):
        opt.zero_grad()
        _lm_loss(model, seed=step).backward()
        for n, p in model.named_parameters():
            _reference_lamb_step(
                ref_params[n], p.grad.double(), ref_state[n], wd=wd_of[id(p)],
                bias_correction=bias_correction, max_weight_norm=max_weight_norm, **kw,
            )
        opt.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach().double(), ref_params[n], rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        assert opt.state[p]["step"].item() == 5.0


def test_lamb_bias_correction_changes_the_update():
    # Guards the parity test above: the two settings must give different weights.
    results = []
    for bc in (True, False):
        torch.manual_seed(0)
        model = TiedLM()
        opt = Lamb(model.parameters(), lr=0.01, bias_correction=bc)
        for step in range(3):
            opt.zero_grad()
            _lm_loss(model, seed=step).backward()
            opt.step()
        results.append(model.fc.weight.detach().clone())
    assert not torch.allclose(results[0], results[1])


def test_lamb_trust_ratio_is_one_for_zero_weight():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.999), eps=1e-6, bias_correction=True)
    p.grad = torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, -0.25]])
    opt.step()
    # Step 1 with bias correction: u = g / (|g| + eps) = sign(g) (0 where g == 0), r = 1.
    expected = -0.1 * p.grad / (p.grad.abs() + 1e-6)
    torch.testing.assert_close(p.detach(), expected)


def test_lamb_state_dict_round_trip():
    torch.manual_seed(0)
    model = TiedLM()
    opt = build_optimizer(model, "LAMB", lr=0.01, weight_decay=0.1)
    for step in range(3):
        opt.zero_grad()
        _lm_loss(model, seed=step).backward()
        opt.step()

    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = TiedLM()
    resumed.load_state_dict(saved_model)
    resumed_opt = build_optimizer(resumed, "LAMB", lr=0.01, weight_decay=0.1)
    resumed_opt.load_state_dict(saved_opt)

    for step in range(3, 6):
        for m, o in ((model, opt), (resumed, resumed_opt)):
            o.zero_grad()
            _lm_loss(m, seed=step).backward()
            o.step()
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert resumed_opt.state[resumed.fc.weight]["step"].item() == 6.0


def test_lamb_skips_params_without_grad():
    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    opt = Lamb([a, b], lr=0.1)
    a.grad = torch.ones(2, 2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2)) and b not in opt.state
    assert not torch.equal(a.detach(), torch.ones(2, 2))


# ---------------------------------------------------------------------------------------------
# LR schedules
# ---------------------------------------------------------------------------------------------


def _formula(schedule: str, u: int, warmup: int, total: int) -> float:
    if u < warmup:
        return u / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total - u) / max(1, total - warmup))
    progress = (u - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def _multipliers(schedule: str, total: int, warmup: int, n: int, form: str = "transformers") -> list[float]:
    """LR / peak seen by updates 0..n-1, stepping the scheduler after each update."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = build_lr_schedule(opt, schedule, total_steps=total, warmup_steps=warmup, warmup_form=form)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("total,warmup", [(10, 3), (10, 0), (7, 7), (1, 0)])
def test_schedule_matches_formula(schedule, total, warmup):
    got = _multipliers(schedule, total, warmup, n=total + 3)  # run past the end too
    want = [_formula(schedule, u, warmup, total) for u in range(total + 3)]
    assert got == pytest.approx(want, abs=1e-12)


def test_schedule_spot_values():
    # Hand-computed: warm-up 2 of 6 updates.
    assert _multipliers("constant", 6, 2, 4) == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert _multipliers("linear", 6, 2, 7) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])
    c = 0.5 * (1 + math.cos(math.pi / 4))
    assert _multipliers("cosine", 6, 2, 7) == pytest.approx([0.0, 0.5, 1.0, c, 0.5, 1 - c, 0.0])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_transformers(schedule):
    transformers = pytest.importorskip("transformers")
    total, warmup = 20, 5
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    hf = {
        "constant": lambda: transformers.get_constant_schedule_with_warmup(opt, warmup),
        "linear": lambda: transformers.get_linear_schedule_with_warmup(opt, warmup, total),
        "cosine": lambda: transformers.get_cosine_schedule_with_warmup(opt, warmup, total),
    }[schedule]()
    want = [hf.lr_lambdas[0](u) for u in range(total + 2)]
    assert _multipliers(schedule, total, warmup, n=total + 2) == pytest.approx(want, abs=1e-12)


NANOGPT_TRAIN = Path(__file__).resolve().parents[3] / "shared" / "reference" / "nanogpt" / "train.py"


@pytest.mark.skipif(not NANOGPT_TRAIN.is_file(), reason=f"no nanoGPT checkout at {NANOGPT_TRAIN.parent}")
@pytest.mark.parametrize("total,warmup,floor", [(300, 20, 0.0), (30, 7, 0.1), (12, 0, 0.0)])
def test_the_nanogpt_warmup_form_is_nanogpts_own_get_lr(total, warmup, floor):
    """nanoGPT's get_lr, taken from its train.py unmodified, is the oracle of `--lr-warmup-form nanogpt`
    with cosine decay to --min-lr, over the run's updates and the one after (further on, with --min-lr 0,
    ours is transformers' cosine, which rises again)."""
    tree = ast.parse(NANOGPT_TRAIN.read_text())
    get_lr = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "get_lr")
    scope = {"math": math, "warmup_iters": warmup, "lr_decay_iters": total, "learning_rate": 1.0, "min_lr": floor}
    exec(compile(ast.Module(body=[get_lr], type_ignores=[]), str(NANOGPT_TRAIN), "exec"), scope)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_schedule(opt, "cosine", total, warmup, min_lr_ratio=floor, warmup_form="nanogpt")
    got = []
    for _ in range(total + 1):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx([scope["get_lr"](u) for u in range(total + 1)], abs=1e-12)


def test_the_warmup_forms_differ_only_in_the_warmup_and_the_default_learns_from_the_first_update():
    nano, hf = (_multipliers("linear", 10, 4, 12, form) for form in ("nanogpt", "transformers"))
    assert nano[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and hf[:4] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert nano[4:] == pytest.approx(hf[4:])
    assert parse_args(["--dataset", "generated"]).optim.lr_warmup_form == "nanogpt"
    with pytest.raises(UsageError, match="--lr-warmup-form gpt3 is not one of nanogpt, transformers"):
        build_lr_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), "linear", 10, 4,
                          warmup_form="gpt3")


def test_schedule_state_dict_round_trip():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_schedule(opt, "cosine", total_steps=10, warmup_steps=2)
    for _ in range(4):
        opt.step()
        sched.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_lr_schedule(opt2, "cosine", total_steps=10, warmup_steps=2)
    sched2.load_state_dict(sched.state_dict())
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(_formula("cosine", 5, 2, 10))


def test_schedule_errors_name_flags():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UsageError, match="--lr-schedule step .*constant, linear, cosine"):
        build_lr_schedule(opt, "step", total_steps=10, warmup_steps=0)
    with pytest.raises(UsageError, match="--lr-decay-steps"):
        build_lr_schedule(opt, "linear", total_steps=0, warmup_steps=0)
    with pytest.raises(UsageError, match="--lr-warmup-steps"):
        build_lr_schedule(opt, "linear", total_steps=10, warmup_steps=11)


# ---------------------------------------------------------------------------------------------
# Warm-up resolution
# ---------------------------------------------------------------------------------------------


def test_resolve_warmup_steps():
    assert resolve_warmup_steps(1000, 0.01, None) == 10
    assert resolve_warmup_steps(99, 0.1, None) == 9  # int() truncates, as the reference
    assert resolve_warmup_steps(1000, 0.5, 7) == 7  # explicit steps win over the fraction
    assert resolve_warmup_steps(1000, 0.0, None) == 0
    assert resolve_warmup_steps(10, 1.0, 10) == 10


@pytest.mark.parametrize(
    "args,flag",
    [
        ((100, -0.1, None), "--lr-warmup "),
        ((100, 1.5, None), "--lr-warmup "),
        ((100, 0.1, -1), "--lr-warmup-steps"),
        ((100, 0.1, 101), "--lr-warmup-steps"),
    ],
)
def test_resolve_warmup_steps_errors(args, flag):
    with pytest.raises(UsageError, match=flag):
        resolve_warmup_steps(*args)
