"""`--deepspeed --deepspeed_config ds.json` on a Megatron-DeepSpeed command line -> the one training config.

DeepSpeed 0.19.8 is the oracle where it runs on the CPU: its `DeepSpeedConfig` for the batch-size rule and
its `lr_schedules` for the learning rate per update. The docs' tables are checked against `FLAGS` and `KEYS`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_megatron import TINY, _corpus, _step_lines, seed_000_argv  # pytest puts tests/frontends on the path

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.deepspeed import KEYS, resolve_batch
from gpt2forge.frontends.flag_table import cell
from gpt2forge.frontends.megatron import (
    FRONT_END,
    build_parser,
    equivalent_command,
    parse_args,
    translate,
)
from gpt2forge.train.schedule import build_lr_schedule

DOCS = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"
BASE = ["--micro-batch-size", "4", "--global-batch-size", "8", "--data-path", "x", "--train-iters", "10"]


def ds(tmp_path: Path, config: dict | str) -> list[str]:
    """The flags that hand `config` (written to tmp_path/ds.json) to the run."""
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def test_seed_000_with_a_ds_json_maps_every_block(tmp_path, capsys):
    config = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "steps_per_print": 5,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "min_loss_scale": 0.5},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                 "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10,
                                                           "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "wall_clock_breakdown": False,
    }
    argv = [a for a in seed_000_argv(tmp_path) if a not in ("--lr-decay-style", "cosine")]
    cfg = parse_args([*argv, *ds(tmp_path, config)], world_size=2)
    # ds.json's batches win: 16 = micro 2 x accumulation 4 x 2 replicas (the flags said 4 and 8)
    assert (cfg.parallel.batch_size, cfg.parallel.gradient_accumulation, cfg.parallel.replication_factor) == (2, 4, 2)
    assert cfg.optim.max_grad_norm == 0.5 and cfg.parallel.zero_stage == 2 and cfg.memory.offload == "optimizer"
    r = cfg.loss_scale
    assert (cfg.runtime.precision, r.auto_loss_scaling, r.initial_loss_scale, r.loss_scale_window,
            r.loss_scale_hysteresis, r.min_loss_scale) == ("fp16", True, 4096.0, 500, 3, 0.5)
    o = cfg.optim
    # the seed's --lr 0.00015 and --lr-warmup-fraction .01 win; the blocks fill the rest
    assert (o.optimizer, o.learning_rate, o.adam_beta2, o.adam_eps, o.weight_decay) == ("AdamW", 0.00015, 0.95, 1e-6,
                                                                                       0.1)
    assert (o.lr_schedule, o.lr_warmup, o.lr_warmup_steps, o.lr_decay_steps) == ("cosine", 0.01, None, 320000)
    assert o.min_lr == pytest.approx(0.1 * 0.00015)
    assert cfg.logging.log_steps == 10  # the seed's --log-interval wins over steps_per_print
    err = capsys.readouterr().err
    assert "train_batch_size 16 in " in err and "replaces --global-batch-size 8" in err
    assert "--lr 0.00015 wins over optimizer.params.lr 0.0003" in err
    ignored = [line for line in err.splitlines() if "no meaning here, ignored" in line]
    assert len(ignored) == 1 and ignored[0].endswith("zero_optimization.overlap_comm, wall_clock_breakdown")


def test_blocks_fill_what_the_flags_leave_out(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 7,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 1,
                                                                "warmup_max_lr": 6e-4, "warmup_type": "linear"}}}
    values = translate(["--data-path", "x", "--train-iters", "10", *ds(tmp_path, config)], world_size=1)
    assert (values["batch_size"], values["gradient_accumulation"]) == (4, 2)
    assert (values["optimizer"], values["weight_decay"], values["adam_beta1"]) == ("AdamW", 0.0, 0.9)  # DeepSpeed's
    # WarmupDecayLR's warmup_max_lr is the peak; a warm-up of 1 is 2 in DeepSpeed
    assert (values["learning_rate"], values["lr_schedule"], values["lr_warmup_steps"], values["lr_decay_steps"],
            values["min_lr"], values["log_steps"]) == (6e-4, "linear", 2, 50, 0.0, 7)


@pytest.mark.parametrize("block, expected", [
    ({"fp16": {"enabled": True, "loss_scale": 128}}, ("fp16", False, 128.0)),
    ({"bf16": {"enabled": True}}, ("bf16", False, 50000.0)),
    ({"bfloat16": {"enabled": True}}, ("bf16", False, 50000.0)),
    ({"fp16": {"enabled": False}}, ("fp32", False, 50000.0)),
    ({}, ("fp16", True, 50000.0)),  # no block: --fp16 decides
])
def test_precision_and_loss_scale(tmp_path, block, expected):
    cfg = parse_args([*BASE, "--fp16", *ds(tmp_path, {"train_batch_size": 8, **block})], world_size=2)
    assert (cfg.runtime.precision, cfg.loss_scale.auto_loss_scaling, cfg.loss_scale.loss_scaling) == expected


@pytest.mark.parametrize("zero, expected", [
    ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, (3, "full")),
    ({"stage": 1, "offload_optimizer": {"device": "none"}}, (1, "none")),
    ({"stage": 0}, (0, None)),
])
def test_zero_stage_and_offload(tmp_path, zero, expected):
    values = translate([*BASE, "--zero-stage", "1", *ds(tmp_path, {"train_batch_size": 8, "zero_optimization": zero})],
                       world_size=2)
    assert (values["zero_stage"], values.get("offload")) == expected


def test_offload_param_below_stage_3_is_ignored_as_deepspeed_does(tmp_path, capsys):
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    values = translate([*BASE, *ds(tmp_path, config)], world_size=2)
    assert values["zero_stage"] == 2 and "offload" not in values
    assert "zero_optimization.offload_param (read by DeepSpeed in stage 3 only)" in capsys.readouterr().err


@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * "
     "world_size 10 != 2 * 2 * 2"),
    ({"gradient_accumulation_steps": 2}, "Either train_batch_size or train_micro_batch_size_per_gpu needs to be "
                                         "provided"),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "bfloat16 and fp16 modes cannot be simultaneously enabled"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
     'scheduler.params.warmup_type "log": the warm-up here is linear'),
    ({"train_batch_size": 8, "scheduler": {"type": "OneCycle"}}, 'scheduler.type "OneCycle": WarmupLR, WarmupDecayLR'),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear",
                                                                          "warmup_num_steps": 0}}},
     "warmup_num_steps must be a positive integer, got 0"),
    ({"train_batch_size": 8, "optimizer": {"type": "Lamb"}}, 'optimizer.type "Lamb": Adam or AdamW'),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     'offload_param.device "nvme": only cpu offload'),
    ({"train_batch_size": "auto"}, 'train_batch_size is "auto", which Hugging Face'),
    ('{"train_batch_size": 8,}', "not valid JSON (Expecting property name enclosed in double quotes at line 1 "
                                 "column 24); fix the file"),
    ("[8]", "holds a JSON list, not an object"),
])
def test_what_cannot_be_reproduced_is_a_one_line_error(tmp_path, config, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        translate([*BASE, *ds(tmp_path, config)], world_size=2)


def test_deepspeed_switch_and_config_go_together(tmp_path, capsys):
    with pytest.raises(UsageError, match="--deepspeed needs --deepspeed_config ds.json"):
        translate([*BASE, "--deepspeed"], world_size=1)
    with pytest.raises(UsageError, match="--deepspeed_config .*missing.json: cannot read it"):
        translate([*BASE, "--deepspeed", "--deepspeed-config", str(tmp_path / "missing.json")], world_size=1)
    flags = ds(tmp_path, {"train_batch_size": 2})
    assert translate([*BASE, *flags[1:]], world_size=2)["batch_size"] == 4  # without --deepspeed: not read
    assert "is not read without --deepspeed" in capsys.readouterr().err


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batch_rule_is_deepspeeds(monkeypatch, world_size):
    ds_config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is the oracle of the batch rule")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world_size)
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    checked = 0
    for train in (None, 8, 12, 16):
        for micro in (None, 2, 3):
            for accumulation in (None, 1, 2):
                given = {k: v for k, v in zip(keys, (train, micro, accumulation)) if v is not None}
                try:
                    theirs = ds_config.DeepSpeedConfig(given)
                except AssertionError as e:
                    with pytest.raises(UsageError) as ours:
                        resolve_batch(train, micro, accumulation, world_size)
                    assert str(ours.value) == str(e), given
                else:
                    assert resolve_batch(train, micro, accumulation, world_size) == tuple(
                        getattr(theirs, k) for k in keys), given
                checked += 1
    assert checked == 36


def _lrs(scheduler_of, updates: int) -> list[float]:
    """The learning rate each update runs at, stepping the scheduler after every update as both trainers do."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = scheduler_of(opt)
    out = []
    for _ in range(updates):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_max_lr": 1.0}),
    ("WarmupDecayLR", {"warmup_max_lr": 1.0, "total_num_steps": 12}),
    ("WarmupCosineLR", {"total_num_steps": 12, "cos_min_ratio": 0.1}),
])
def test_schedules_equal_deepspeeds_one_update_earlier(tmp_path, kind, params):
    schedules = pytest.importorskip("deepspeed.runtime.lr_schedules", reason="DeepSpeed is the oracle of its LR")
    params = {**params, "warmup_num_steps": 4, "warmup_type": "linear"}
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
              "scheduler": {"type": kind, "params": params}}
    o = parse_args(["--micro-batch-size", "8", "--data-path", "x", *ds(tmp_path, config)], world_size=1).optim
    ours = _lrs(lambda opt: build_lr_schedule(opt, o.lr_schedule, o.lr_decay_steps or 12, o.lr_warmup_steps,
                                              o.min_lr / o.learning_rate), 16)
    theirs = _lrs(lambda opt: getattr(schedules, kind)(opt, **params), 16)
    # DeepSpeed's scheduler starts at step -1 and is first stepped after update 0: its update u runs at our
    # update u - 1 (its first two updates both at 0), except WarmupCosineLR's decay, which lines up
    aligned = [u > 4 and kind == "WarmupCosineLR" for u in range(16)]
    assert theirs == pytest.approx([ours[u] if same else ours[max(u - 1, 0)] for u, same in enumerate(aligned)])


def flag_table() -> list[str]:
    """docs/megatron.md's table of `FLAGS`, one line per row (paste the failing test's output there)."""
    return FRONT_END.flag_table("Megatron")


def key_table() -> list[str]:
    """docs/megatron.md's table of ds.json's `KEYS`."""
    rows = [f"| `{key}` | {cell(here)} |" for key, here in KEYS.items()]
    return ["| ds.json key | Here: `train_gpt2.py` flag, meaning |", "| --- | --- |", *rows]


@pytest.mark.parametrize("table", [flag_table, key_table])
def test_docs_show_every_flag_and_key(table):
    text = DOCS.read_text()
    missing = [line for line in table() if line not in text]
    assert not missing, "docs/megatron.md is behind; paste:\n" + "\n".join(table())


def test_deepspeed_flags_are_in_help():
    text = build_parser().format_help()
    assert "\nDeepSpeed:" in text and "--deepspeed_config" in text and "(train_gpt2.py --zero-stage)" in text


@pytest.mark.slow
def test_seed_000_under_the_deepspeed_launcher_runs_as_its_equivalent(tmp_path, capsys):
    from gpt2forge.cli import megatron_main, train_main  # the two front ends compared

    _corpus(tmp_path)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
              "steps_per_print": 1, "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
              "zero_optimization": {"stage": 1}, "wall_clock_breakdown": False}
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        for name in ("my-gpt2_text_document.bin", "my-gpt2_text_document.idx"):
            (tmp_path / d / name).symlink_to(tmp_path / name)
    argv = [*seed_000_argv(tmp_path / "a"), *TINY, *ds(tmp_path, config)]
    assert megatron_main(argv) == 0
    theirs = capsys.readouterr().out
    values = translate([*seed_000_argv(tmp_path / "b"), *TINY, *ds(tmp_path, config)], world_size=1)
    assert (values["gradient_accumulation"], values["initial_loss_scale"], values["zero_stage"]) == (2, 4096.0, 1)
    assert train_main(equivalent_command(values)) == 0
    ours = capsys.readouterr().out
    assert len(_step_lines(theirs)) == 3 and _step_lines(theirs) == _step_lines(ours)
    assert f" iteration {3:8d}/{3:8d} | consumed samples: {6:12d} |" in theirs
