"""`--optimizer Muon`: which parameters Muon updates, its update against torch's own Muon and AdamW
applied separately, checkpoints and resuming, and the layouts it refuses."""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.train import setup
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.optim import MuonAdamW, build_lr_schedule, build_optimizer, orthogonalize

STEP_LINE = re.compile(r"^step (\d+) of epoch (\d+), loss: (\S+), acc: (\S+), lr: (\S+), ")


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0))


def lm_loss(model: GPT2LMHeadModel, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(seed))
    logits = model(ids[:, :-1])  # (B, T, V padded)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def train(model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        optimizer.zero_grad()
        lm_loss(model, seed).backward()
        optimizer.step()


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_model()
    opt = build_optimizer(model, "Muon", lr=1e-3, weight_decay=0.1, muon_lr=2e-2)
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert sorted(muon) == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                                  for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert sorted(decay) == ["transformer.wpe.weight", "transformer.wte.weight"]  # the LM head is tied to wte
    assert all(n.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for n in no_decay)
    assert [(g["muon"], g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (True, 2e-2, 0.1), (False, 1e-3, 0.1), (False, 1e-3, 0.0)]
    assert opt.param_groups[0]["nesterov"] is True and opt.param_groups[1]["fused"] is True


def fixed_gradients(model: torch.nn.Module, step: int) -> None:
    """Gradients that depend on the step only, so two models that drift apart still get the same ones."""
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_the_update_is_torchs_muon_and_adamw_each_on_its_own_parameters():
    """The oracle: torch.optim.Muon over the blocks' matrices and torch.optim.AdamW over the rest, two
    separate optimizers on a copy of the model, fed the same gradients for four updates. AdamW's
    parameters agree bit for bit; Muon's to bf16's rounding, which torch's Newton-Schulz steps run in
    one matrix at a time and ours batched."""
    ours_model, oracle_model = tiny_model(), tiny_model()
    ours = build_optimizer(ours_model, "Muon", lr=3e-3, weight_decay=0.1, muon_lr=1e-2, muon_momentum=0.9,
                           betas=(0.9, 0.95), muon_dtype=torch.bfloat16)
    by_name = dict(oracle_model.named_parameters())
    names = {id(p): n for n, p in ours_model.named_parameters()}
    groups = [[by_name[names[id(p)]] for p in g["params"]] for g in ours.param_groups]
    adamw_groups = [{"params": groups[1], "weight_decay": 0.1}, {"params": groups[2], "weight_decay": 0.0}]
    oracle = [torch.optim.Muon(groups[0], lr=1e-2, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW(adamw_groups, lr=3e-3, betas=(0.9, 0.95), fused=True)]
    start = {n: p.detach().clone() for n, p in ours_model.named_parameters()}
    for step in range(4):
        fixed_gradients(oracle_model, step)
        fixed_gradients(ours_model, step)
        for opt in (*oracle, ours):
            opt.step()
    muon_names = {names[id(p)] for p in ours.param_groups[0]["params"]}
    for name, p in ours_model.named_parameters():
        if name not in muon_names:
            assert torch.equal(p, by_name[name]), name
            continue
        moved, oracle_moved = p - start[name], by_name[name] - start[name]
        assert (moved - oracle_moved).norm() < 0.02 * oracle_moved.norm(), name


def newton_schulz_fp32(g: torch.Tensor) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz` transcribed with fp32 in place of its bf16."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if g.size(0) > g.size(1) else x


def test_orthogonalize_batches_torchs_iteration_in_the_runs_precision():
    from torch.optim._muon import _zeropower_via_newtonschulz as torchs

    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=g) for shape in ((48, 16), (16, 16), (16, 64), (48, 16), (64, 16))]
    fp32 = orthogonalize(updates, torch.float32)
    bf16 = orthogonalize(updates, torch.bfloat16)
    for u, ours32, ours16 in zip(updates, fp32, bf16):
        assert ours32.dtype == torch.float32 and ours16.dtype == torch.bfloat16 and ours32.shape == u.shape
        torch.testing.assert_close(ours32, newton_schulz_fp32(u), rtol=1e-5, atol=1e-5)
        reference = torchs(u, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert (ours16.float() - reference.float()).norm() < 0.02 * reference.float().norm()
        singular = torch.linalg.svdvals(ours32)
        assert singular.min() > 0.3 and singular.max() < 1.3  # near-orthogonal: Muon's US'V^T, S' ~ [0.5, 1.2]


def test_the_newton_schulz_steps_run_in_the_runs_precision():
    cfg = TrainConfig.from_flat({"dataset": "generated", "optimizer": "Muon"})
    model = tiny_model()
    strategy = types.SimpleNamespace(whole_gradients=True,
                                     optimizer_placement=lambda: types.SimpleNamespace(
                                         module=model, offload=False, shard=False, shard_group=None,
                                         host_update=False))
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp16", torch.float32)):
        assert setup._build_optimizer(cfg, strategy, torch.device("cpu"), precision).ns_dtype == dtype


def test_state_dict_round_trip_continues_exactly_with_the_schedule():
    model = tiny_model()
    opt = build_optimizer(model, "Muon", lr=1e-3, weight_decay=0.1, muon_lr=1e-2)
    schedule = build_lr_schedule(opt, "cosine", total_steps=10, warmup_steps=2)
    for seed in range(3):
        train(model, opt, range(seed, seed + 1))
        schedule.step()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), schedule.state_dict()))
    assert {k for s in saved[1]["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}

    resumed = tiny_model(seed=1)
    resumed.load_state_dict(saved[0])
    opt2 = build_optimizer(resumed, "Muon", lr=1e-3, weight_decay=0.1, muon_lr=1e-2)
    schedule2 = build_lr_schedule(opt2, "cosine", total_steps=10, warmup_steps=2)
    opt2.load_state_dict(saved[1])  # the trainer's order (train.state.resume)
    schedule2.load_state_dict(saved[2])
    for m, o, s in ((model, opt, schedule), (resumed, opt2, schedule2)):
        for seed in range(3, 6):
            train(m, o, range(seed, seed + 1))
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]
    assert opt.param_groups[0]["lr"] != opt.param_groups[1]["lr"]  # each group keeps its own peak under the schedule
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_a_resumed_muon_run_equals_the_uninterrupted_run(make_tiny_config, tmp_path, capsys):
    cfg = make_tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args = ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--gradient-accumulation", "1", "--device-iterations", "1", "--training-steps", "6", "--num-workers", "0",
            "--optimizer", "Muon", "--learning-rate", "3e-3", "--muon-learning-rate", "2e-2", "--lr-schedule", "cosine",
            "--max-grad-norm", "1.0"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main([*args, "--checkpoint-output-dir", str(full), "--save-per-steps", "3"]) == 0
    out = capsys.readouterr().out
    lines = [m.groups() for line in out.splitlines() if (m := STEP_LINE.match(line))]
    assert len(lines) == 6 and float(lines[-1][2]) < float(lines[0][2])
    # Each group's rate is named: --learning-rate's as `lr`, the matrices' as `muon lr`, on one schedule.
    assert "LR schedule: cosine from 0.003 to 0 (Muon's matrices: from 0.02 to 0) over 6 updates" in out
    rates = [tuple(map(float, m.groups())) for m in re.finditer(r", lr: (\S+), muon lr: (\S+), ", out)]
    assert len(rates) == 6 and rates[0][0] <= 3e-3 and rates[0][1] <= 2e-2 and rates[-1][0] < rates[0][0]
    assert all(abs(muon / lr - 2e-2 / 3e-3) < 1e-4 for lr, muon in rates[:-1])
    assert train_main([*args, "--checkpoint-output-dir", str(part), "--checkpoint-input-dir", str(full / "step_3"),
                       "--resume-training-from-checkpoint", "true"]) == 0
    assert [m.groups() for line in capsys.readouterr().out.splitlines() if (m := STEP_LINE.match(line))] == lines[3:]


def test_placements_muon_cannot_run_are_refused_by_name():
    for placement, flag in (({"offload": True}, "--offload"), ({"host_update": True}, "--offload"),
                            ({"shard": True}, "ZeRO-1")):
        with pytest.raises(UsageError, match=f"--optimizer Muon cannot run with {flag}"):
            build_optimizer(tiny_model(), "Muon", lr=1e-3, weight_decay=0.0, **placement)
    cfg = TrainConfig.from_flat({"dataset": "generated", "optimizer": "Muon"})
    for whole, kfac in ((False, False), (True, True)):  # pipeline stages or shards; K-FAC
        strategy = types.SimpleNamespace(whole_gradients=whole)
        with pytest.raises(UsageError, match="--optimizer Muon runs on one process or DDP replicas") as err:
            setup._build_optimizer(cfg.replace(kfac=kfac), strategy, torch.device("cpu"), "fp32")
        assert "\n" not in str(err.value)


def test_muon_flags_are_validated_and_explained():
    with pytest.raises(UsageError, match="--muon-momentum"):
        TrainConfig.from_flat({"dataset": "generated", "muon_momentum": 1.0})
    with pytest.raises(UsageError, match="--muon-learning-rate"):
        TrainConfig.from_flat({"dataset": "generated", "muon_learning_rate": -1.0})
    from gpt2forge.train.config import field_help
    assert "2-D weights of the transformer blocks" in field_help("optimizer") and "AdamW" in field_help("optimizer")
