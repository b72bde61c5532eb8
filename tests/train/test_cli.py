"""The flag set is an API: every shipped command line parses against the real parser and its layout
validates against the model; precedence defaults < --config file < command line."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.model.config import ModelConfig
from gpt2forge.parallel.topology import build_layout

ROOT = Path(__file__).resolve().parents[2]


def script_args(text: str) -> list[str]:
    """The arguments after `train_gpt2.py` in a shell script or command (continuations joined)."""
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if "train_gpt2.py" in line:
            args = shlex.split(line.split("train_gpt2.py", 1)[1])
            return [a for a in args if a != "$@"]
    raise AssertionError("no train_gpt2.py command")


def shipped_command_lines() -> list[tuple[str, list[str]]]:
    out = [(p.name, script_args(p.read_text())) for p in sorted((ROOT / "run").glob("pretraining_*.sh"))
           if "\n# Stand-in:" not in p.read_text()]  # a reference name that says where it went (tests/seeds)
    spec = yaml.safe_load((ROOT / "benchmarks.yml").read_text())
    for name, entry in spec.items():
        if "options" not in name and "train_gpt2.py" in entry["cmd"]:
            out.append((name, script_args(entry["cmd"].replace("\n", " "))))  # the runner joins lines
    make_args = re.search(r"TRAIN_ARGS \?= (.*?)\n\n", (ROOT / "Makefile").read_text(), re.S).group(1)
    out.append(("make train", shlex.split(make_args.replace("\\\n", " ").replace("$(CORPUS)", "c.pkl")
                                          .replace("$(CKPT_DIR)", "ck").replace("$(PRECISION)", "bf16"))))
    # Every fenced block of the README and the docs that holds a complete `python train_gpt2.py` command.
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        name = "README" if doc.name == "README.md" else f"docs/{doc.name}"
        for block in re.findall(r"```\n(.*?)```", doc.read_text(), re.S):
            if "python train_gpt2.py" in block and "..." not in block:
                out.append((name, script_args(block)))
    return out


@pytest.mark.parametrize("name,args", shipped_command_lines(), ids=lambda x: x if isinstance(x, str) else "")
def test_shipped_command_line_parses_and_layout_validates(name, args):
    cfg = parse_args(args)
    model_cfg = cfg.model_source().config
    layout = build_layout(cfg.parallel, model_cfg.n_layer)
    assert sum(layout.layers_per_stage) == model_cfg.n_layer


def test_reference_readme_command_with_old_flag_names():
    cfg = parse_args(shlex.split(
        "--model gpt2 --max-len 1024 --layers-per-ipu 0 4 4 4 --matmul-proportion 0.15 0.15 0.15 0.15 "
        "--ipus-per-replica 4 --replication-factor 1 --epochs 3 --gradient-accumulation 512 "
        "--device-iterations 1 --batch-size 1 --enable-sequence-serialized True --remap-logit True "
        "--embedding-serialization-factor 4 --recompute-checkpoint-every-layer True "
        "--enable-half-partials True --train-path 'generated' --compile-only False"))
    assert cfg.data.dataset == "generated" and cfg.runtime.compile_only is False
    assert cfg.parallel.layers_per_ipu == [0, 4, 4, 4]
    old = parse_args(["--train-path", "corpus.pkl", "--save-model-path", "out", "--pretrained-checkpoint", "in"])
    assert old.data.dataset == "pickle" and old.data.input_files == ["corpus.pkl"]
    assert old.checkpoint.checkpoint_output_dir == "out" and old.checkpoint.checkpoint_input_dir == "in"


@pytest.mark.parametrize("text,value", [("True", True), ("false", False), ("1", True), ("no", False)])
def test_boolean_syntax(text, value):
    assert parse_args(["--dataset", "generated", "--use-wandb", text]).logging.use_wandb is value
    assert parse_args(["--dataset", "generated", "--use-wandb"]).logging.use_wandb is True


def test_bad_boolean_is_an_argparse_error():
    with pytest.raises(SystemExit) as exc:
        parse_args(["--dataset", "generated", "--use-wandb", "maybe"])
    assert exc.value.code == 2


def test_precedence_defaults_file_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"learning-rate": 0.5, "batch_size": 3, "dataset": "generated",
                                    "layers-per-ipu": [0, 2], "use_wandb": "yes"}))
    cfg = parse_args(["--config", str(path), "--batch-size", "7"])
    assert cfg.optim.learning_rate == 0.5  # file beats default
    assert cfg.parallel.batch_size == 7  # command line beats file
    assert cfg.parallel.layers_per_ipu == [0, 2] and cfg.logging.use_wandb is True
    assert cfg.optim.epochs == 1  # default
    jpath = tmp_path / "run.json"
    jpath.write_text(json.dumps({"no_such_flag": 1}))
    with pytest.raises(UsageError, match="no_such_flag"):
        parse_args(["--config", str(jpath)])


def test_layout_errors_name_the_flag():
    cfg = parse_args(["--dataset", "generated", "--layers-per-ipu", "0", "4", "4", "--ipus-per-replica", "3"])
    with pytest.raises(UsageError, match="--layers-per-ipu 0 4 4 places 8 blocks.*n_layer=12"):
        build_layout(cfg.parallel, 12)
    cfg = parse_args(["--dataset", "generated", "--layers-per-ipu", "0", "12"])
    with pytest.raises(UsageError, match="--ipus-per-replica"):
        build_layout(cfg.parallel, 12)


def test_stage_map_is_data():
    cfg = parse_args(["--dataset", "generated", "--layers-per-ipu", "0", "2", "1", "--ipus-per-replica", "3"])
    layout = build_layout(cfg.parallel, 3)
    assert layout.stage_of_layer() == [1, 1, 2]
    assert layout.stage_map()[:2] == ["Embedding --> stage 0", "Layer 0  --> stage 1"]


@pytest.mark.parametrize("argv,flag", [
    (["--dataset", "generated", "--batch-size", "0"], "--batch-size"),
    (["--dataset", "generated", "--epochs", "0"], "--epochs"),
    (["--dataset", "generated", "--max-grad-norm", "-1"], "--max-grad-norm"),
    (["--max-len", "16"], "--dataset"),
])
def test_invalid_values_name_the_flag(argv, flag):
    with pytest.raises(UsageError, match=flag):
        parse_args(argv)


def test_model_config_flag_takes_any_hf_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 48, "n_head": 3, "vocab_size": 500,
                                "n_positions": 64, "some_hf_only_key": True}))
    cfg = parse_args(["--dataset", "generated", "--model-config", str(path), "--max-len", "32"]).model_source().config
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.n_positions) == (3, 48, 500, 32)
    path.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UsageError, match=r"model_type is 'llama'; pass a GPT-2 \(gpt2\) or GPT-Neo"):
        ModelConfig.from_json(path)


@pytest.mark.parametrize("env,prefix", [({}, "error: bad"), ({"RANK": "0", "WORLD_SIZE": "4"}, "error: bad"),
                                        ({"RANK": "3", "WORLD_SIZE": "4"}, "error: rank 3: bad")])
def test_error_lines_name_the_rank_other_than_0(env, prefix, monkeypatch, capsys):
    from gpt2forge.core.errors import RunError, UsageError, cli_main

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def fails(exc):
        raise exc

    assert cli_main(fails)(UsageError("bad input")) == 2
    assert cli_main(fails)(RunError("bad run")) == 1
    assert capsys.readouterr().err.splitlines() == [prefix + " input", prefix + " run"]


def test_a_model_too_big_for_the_host_is_refused_before_it_is_allocated(monkeypatch):
    # a mistyped --max-len (1e11 positions) asked the allocator for 12.8 TB and died in nn.Embedding
    import torch

    from gpt2forge.core import memory
    from gpt2forge.model.build import build_model

    cfg = parse_args(["--model", "gpt2-test", "--dataset", "generated", "--max-len", "99999999999"])
    with pytest.raises(UsageError, match=r"99999999999 positions.*GiB available; choose a smaller") as exc:
        build_model(cfg.model_source(), torch.device("cpu"))
    assert "\n" not in str(exc.value)
    small = parse_args(["--model", "gpt2-test", "--dataset", "generated", "--max-len", "32"])
    need = 4 * small.model_source().config.num_params()
    monkeypatch.setattr(memory, "available_host_memory", lambda: need - 1.0)
    with pytest.raises(UsageError, match="available"):
        build_model(small.model_source(), torch.device("cpu"))
    monkeypatch.setattr(memory, "available_host_memory", lambda: float(need))
    model = build_model(small.model_source(), torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) >= 1


@pytest.mark.parametrize("flag", ["--batch-size", "--gradient-accumulation", "--replication-factor",
                                  "--device-iterations"])
def test_a_step_too_big_for_the_host_is_refused_by_its_flags(flag, monkeypatch):
    # --batch-size 99999999999 asked the allocator for 12.8 TB while drawing the epoch's order
    from gpt2forge.core import memory
    from gpt2forge.train.setup import check_step_fits_host

    cfg = parse_args(["--model", "gpt2-test", "--dataset", "generated", "--max-len", "16", flag, "99999999999"])
    with pytest.raises(UsageError, match=rf"{flag} 99999999999.*GiB available; choose a smaller batch") as exc:
        check_step_fits_host(cfg)
    assert "\n" not in str(exc.value)
    ok = parse_args(["--model", "gpt2-test", "--dataset", "generated", "--max-len", "16", flag, "2"])
    check_step_fits_host(ok)
    monkeypatch.setattr(memory, "available_host_memory", lambda: 16.0 * ok.samples_per_step * 16 - 1)
    with pytest.raises(UsageError, match="choose a smaller batch"):
        check_step_fits_host(ok)
