"""Fine-tuning: starting from a Hugging Face GPT-2 directory or our checkpoint with a new optimizer
and schedule, --min-lr and Megatron's sample-based schedule, dropout overrides, the run/finetune_*.sh
recipes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import re
import shlex
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt2forge.cli import train_main
from gpt2forge.data.indexed import IndexedWriter
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.model.build import build_model, init_generator
from gpt2forge.model.checkpoint import load_model_config, load_weights, resolve_checkpoint_dir
from gpt2forge.model.gpt2 import Attention, Dropout, GPT2LMHeadModel
from gpt2forge.train.schedule import ScheduleLength, build_lr_schedule, schedule_length

ROOT = Path(__file__).resolve().parents[2]
V, T = 96, 16  # the tiny models' vocabulary and the runs' --max-len
STEP_LR = re.compile(r"^step \d+ of epoch \d+, loss: (\S+), acc: \S+, lr: (\S+),", re.M)


def save_hf_model(path: Path, seed: int = 0) -> Path:
    """A tiny transformers GPT2LMHeadModel with random weights, written by save_pretrained."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=V - 1, eos_token_id=V - 1)
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def write_pickle(path: Path, docs: list[list[int]]) -> Path:
    path.write_bytes(pickle.dumps(docs))
    return path


def run_args(*extra: str) -> list[str]:
    return ["--max-len", str(T), "--batch-size", "2", "--device-iterations", "1", "--num-workers", "0",
            "--precision", "fp32", *extra]


def train_records(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"]


# ---------------------------------------------------------------------------------------------
# Starting from a Hugging Face directory and from our checkpoint
# ---------------------------------------------------------------------------------------------


def test_first_step_loss_equals_transformers_loss_on_that_batch(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf_dir = save_hf_model(tmp_path / "hf")
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, V, (8, T + 1), generator=g)  # one window per document: the whole first step
    data = write_pickle(tmp_path / "docs.pkl", windows.tolist())
    metrics = tmp_path / "metrics.jsonl"
    assert train_main(run_args("--checkpoint-input-dir", str(hf_dir), "--dataset", "pickle", "--input-files",
                               str(data), "--gradient-accumulation", "4", "--training-steps", "1",
                               "--learning-rate", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
                               "--metrics-file", str(metrics))) == 0
    out = capsys.readouterr().out
    assert "fine-tuning: a new optimizer" in out and "resid_pdrop 0.1 -> 0" in out
    (first,) = train_records(metrics)

    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits  # (B, T, V)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert first["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def domain_docs(starts: range, length: int = 40) -> list[list[int]]:
    """Documents of the 'domain': arithmetic progressions mod V (step 1, 2 or 3), unlike random text."""
    return [[(s + k * (1 + s % 3)) % (V - 1) for k in range(length)] for s in starts]


def held_out_loss(ckpt: Path, docs: list[list[int]]) -> float:
    model = GPT2LMHeadModel(load_model_config(ckpt))
    load_weights(model, ckpt)
    ids = torch.tensor([d[: T + 1] for d in docs])  # (N, T + 1)
    with torch.no_grad():
        out = model(ids[:, :-1], labels=ids[:, 1:])
    return (out.loss_sum / out.tokens).item()


@pytest.mark.slow  # ~6 s: a 2-step parent and a 50-step fine-tune
def test_fifty_steps_on_a_domain_corpus_lower_its_held_out_loss(make_tiny_config, tmp_path, capsys):
    # The parent: a tiny model pretrained briefly on random tokens (our checkpoint format).
    tiny = make_tiny_config(n_positions=T)
    parent_root = tmp_path / "parent"
    assert train_main(run_args("--model-config", str(tiny), "--dataset", "generated", "--gradient-accumulation", "1",
                               "--training-steps", "2", "--checkpoint-output-dir", str(parent_root))) == 0
    parent = resolve_checkpoint_dir(parent_root)  # its `latest`
    # Fine-tune on the domain (even starts); held out: odd starts, never trained on.
    train = write_pickle(tmp_path / "domain.pkl", domain_docs(range(0, 190, 2)))
    held_out = domain_docs(range(1, 190, 10))
    out_root = tmp_path / "ft"
    capsys.readouterr()
    assert train_main(run_args("--checkpoint-input-dir", str(parent), "--dataset", "pickle", "--input-files",
                               str(train), "--stride", "8", "--gradient-accumulation", "1", "--training-steps", "50",
                               "--learning-rate", "1e-2", "--min-lr", "1e-3", "--lr-schedule", "cosine",
                               "--lr-warmup-steps", "5", "--hidden-dropout", "0.0",
                               "--checkpoint-output-dir", str(out_root))) == 0
    out = capsys.readouterr().out
    losses = [float(loss) for loss, _ in STEP_LR.findall(out)]
    assert len(losses) == 50 and all(math.isfinite(x) for x in losses)  # NaN-free in fp32 (nanoGPT#210)

    before, after = held_out_loss(parent, held_out), held_out_loss(out_root / "step_50", held_out)
    print(f"held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 0.5, (before, after)
    # A fine-tune that trained nothing (nanoGPT#161) would leave tensors as they were: every one moved.
    a, b = load_file(parent / "model.safetensors"), load_file(out_root / "step_50" / "model.safetensors")
    unchanged = [k for k in a if torch.equal(a[k], b[k])]
    assert not unchanged
    # New optimizer and schedule: the step count and the schedule start at 0, not at the parent's 2.
    state = torch.load(out_root / "step_50" / "training_state.pt", weights_only=True)
    assert state["progress"]["step"] == 50 and state["lr_scheduler"]["last_epoch"] == 50
    assert json.loads((out_root / "step_50" / "config.json").read_text())["resid_pdrop"] == 0.0


def test_zero_learning_rate_is_named(make_tiny_config, tmp_path, capsys):
    tiny = make_tiny_config(n_positions=T)
    assert train_main(run_args("--model-config", str(tiny), "--dataset", "generated", "--gradient-accumulation", "1",
                               "--training-steps", "1", "--learning-rate", "0")) == 0
    assert "notice: --learning-rate 0: no update will change the weights" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# --min-lr and the sample-based schedule
# ---------------------------------------------------------------------------------------------


def lrs(schedule: str, total: int, warmup: int, n: int, floor: float = 0.0, per_update: int = 1) -> list[float]:
    """LR / peak seen by updates 0..n-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_schedule(opt, schedule, total, warmup, floor, per_update)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_ends_at_min_lr_and_holds_it(schedule):
    got = lrs(schedule, total=10, warmup=2, n=14, floor=0.1)
    assert got[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert got[10:] == pytest.approx([0.1] * 4)  # the end of the decay and after it: the floor
    assert all(a > b > 0.1 for a, b in zip(got[2:9], got[3:10]))  # decreasing towards the floor
    no_floor = lrs(schedule, total=10, warmup=2, n=10)
    assert got[5] == pytest.approx(0.1 + 0.9 * no_floor[5])


def test_constant_schedule_ignores_min_lr():
    assert lrs("constant", total=10, warmup=2, n=12, floor=0.5) == lrs("constant", total=10, warmup=2, n=12)


def megatron_scheduler_class():
    """Megatron-Core's OptimizerParamScheduler, loaded from its file (megatron.core's __init__ needs
    triton and more, which this one module does not)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (pip install --no-deps megatron-core==0.19.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "optimizer_param_scheduler.py"
    if not path.is_file():
        pytest.skip(f"{path} not found in this megatron-core")
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *args, **kwargs: None
    saved = sys.modules.get("megatron.core.utils")
    sys.modules["megatron.core.utils"] = utils
    try:
        module_spec = importlib.util.spec_from_file_location("megatron_optimizer_param_scheduler", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["megatron.core.utils"]
        else:
            sys.modules["megatron.core.utils"] = saved
    return module.OptimizerParamScheduler


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("decay,warmup,gbs", [(100, 20, 8), (96, 0, 8), (50, 7, 3)])
def test_sample_based_schedule_equals_megatron_core(style, decay, warmup, gbs):
    scheduler_class = megatron_scheduler_class()
    peak, floor = 3e-4, 3e-5
    opt = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
    # As Megatron-LM's training.py builds it with --lr-decay-samples / --lr-warmup-samples: lengths in
    # samples, stepped by the global batch after every update.
    megatron = scheduler_class(opt, init_lr=0.0, max_lr=peak, min_lr=floor, lr_warmup_steps=warmup,
                               lr_decay_steps=decay, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                               wd_incr_steps=decay, wd_incr_style="constant")
    want = []
    for _ in range(decay // gbs + 4):  # past the end of the decay too
        want.append(opt.param_groups[0]["lr"])
        megatron.step(increment=gbs)
    got = [peak * m for m in lrs(style, decay, warmup, len(want), floor / peak, per_update=gbs)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)


def step_lrs_and_weights(args: list[str], out: Path, capsys) -> tuple[list[tuple[str, str]], dict]:
    assert train_main([*args, "--checkpoint-output-dir", str(out)]) == 0
    lines = STEP_LR.findall(capsys.readouterr().out)
    return lines, load_file(resolve_checkpoint_dir(out) / "model.safetensors")


def test_schedule_in_samples_equals_the_same_schedule_in_updates(make_tiny_config, tmp_path, capsys):
    tiny = make_tiny_config(n_positions=T)
    base = run_args("--model-config", str(tiny), "--dataset", "generated", "--gradient-accumulation", "2",
                    "--learning-rate", "3e-3", "--min-lr", "1e-3", "--lr-schedule", "linear")
    # 4 samples per update: 8 updates = 32 samples; warm-up 2 updates = 8 samples; decay 6 updates = 24.
    in_updates = step_lrs_and_weights([*base, "--training-steps", "8", "--lr-warmup-steps", "2",
                                       "--lr-decay-steps", "6"], tmp_path / "u", capsys)
    in_samples = step_lrs_and_weights([*base, "--train-samples", "32", "--lr-warmup-samples", "8",
                                       "--lr-decay-samples", "24"], tmp_path / "s", capsys)
    assert len(in_updates[0]) == 8 and in_updates[0] == in_samples[0]
    assert float(in_updates[0][-1][1]) == pytest.approx(1e-3)  # past the decay: the floor
    assert all(torch.equal(in_updates[1][k], in_samples[1][k]) for k in in_updates[1])


def test_schedule_length_units():
    cfg = parse_args(["--dataset", "generated", "--train-samples", "100", "--lr-warmup", "0.1"])
    assert schedule_length(cfg.optim, total_updates=13, samples_per_update=8) == ScheduleLength(100, 10, 8, "samples")
    cfg = parse_args(["--dataset", "generated", "--lr-warmup-steps", "3"])
    assert schedule_length(cfg.optim, total_updates=13, samples_per_update=8) == ScheduleLength(13, 3, 1, "updates")


def cli_error(capsys, argv: list[str]) -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err
    return errors[0]


@pytest.mark.parametrize("extra,flag", [
    (["--min-lr", "1e-2"], "--min-lr"),
    (["--min-lr=-1e-5"], "--min-lr"),
    (["--train-samples", "0"], "--train-samples"),
    (["--lr-decay-samples", "0"], "--lr-decay-samples"),
    (["--lr-warmup-samples=-1"], "--lr-warmup-samples"),
    (["--lr-warmup-samples", "40", "--lr-decay-samples", "20"], "--lr-warmup-samples 40"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout"),
    (["--attention-dropout=-0.1"], "--attention-dropout"),
])
def test_bad_values_are_one_line_exit_2(make_tiny_config, capsys, extra, flag):
    args = run_args("--model-config", str(make_tiny_config(n_positions=T)), "--dataset", "generated",
                    "--gradient-accumulation", "1", "--training-steps", "2", "--learning-rate", "1e-3", *extra)
    assert flag in cli_error(capsys, args)


# ---------------------------------------------------------------------------------------------
# Dropout overrides
# ---------------------------------------------------------------------------------------------


def dropout_probabilities(model: torch.nn.Module) -> tuple[set[float], set[float]]:
    """(p of every residual/embedding Dropout, attn_pdrop of every attention), checking that no other
    kind of dropout module exists in the model."""
    assert not [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    hidden = [m.p for m in model.modules() if isinstance(m, Dropout)]
    attention = [m.attn_pdrop for m in model.modules() if isinstance(m, Attention)]
    assert len(hidden) == 1 + 2 * model.config.n_layer and len(attention) == model.config.n_layer
    return set(hidden), set(attention)


def test_initial_weights_draw_from_a_stream_of_their_own(make_tiny_config):
    """--seed picks the initial weights, but not from the generator state that the held-out split and
    the first epoch's order start from (torch.Generator().manual_seed(seed)): the same seed, the same
    weights; another seed, other weights; neither equal to a draw from the data's stream."""
    def weights(seed: int) -> torch.Tensor:
        args = ["--dataset", "generated", "--max-len", str(T), "--seed", str(seed),
                "--model-config", str(make_tiny_config(n_positions=T))]
        return build_model(parse_args(args).model_source(), torch.device("cpu")).transformer.wte.weight[:V]

    first = weights(5)
    assert torch.equal(first, weights(5)) and not torch.equal(first, weights(6))
    assert torch.equal(first, torch.randn(first.shape, generator=init_generator(5)) * 0.02)
    assert not torch.equal(first, torch.randn(first.shape, generator=torch.Generator().manual_seed(5)) * 0.02)


@pytest.mark.parametrize("source", ["fresh", "hugging face"])
def test_dropout_overrides_reach_every_dropout_module(make_tiny_config, tmp_path, source):
    start = (["--model-config", str(make_tiny_config(n_positions=T))] if source == "fresh"
             else ["--checkpoint-input-dir", str(save_hf_model(tmp_path / "hf"))])
    args = ["--dataset", "generated", "--max-len", str(T), *start]
    model = build_model(parse_args(args).model_source(), torch.device("cpu"))
    assert dropout_probabilities(model) == ({0.1}, {0.1})  # the config's own
    model = build_model(parse_args([*args, "--hidden-dropout", "0.05", "--attention-dropout", "0.2"]).model_source(),
                        torch.device("cpu"))
    assert dropout_probabilities(model) == ({0.05}, {0.2})
    # With both at 0 a training-mode forward draws no mask anywhere: two passes agree exactly.
    model = build_model(parse_args([*args, "--hidden-dropout", "0", "--attention-dropout", "0"]).model_source(),
                        torch.device("cpu"))
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    model.train()
    torch.manual_seed(1)
    a = model(ids)
    torch.manual_seed(2)
    assert torch.equal(a, model(ids))


# ---------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------


def recipe_args(path: Path, env: dict[str, str]) -> list[str]:
    """The train_gpt2.py arguments of a run/*.sh recipe, with its ${VAR} / ${VAR:-default} filled in."""
    text = path.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if "launch train_gpt2.py" in ln)

    def fill(m: re.Match) -> str:
        name, default = m.group(1), m.group(3)
        return env.get(name, default if default is not None else "")

    line = re.sub(r"\$\{(\w+)(:-([^}]*))?\}", fill, line)
    return [a for a in shlex.split(line.split("train_gpt2.py", 1)[1]) if a != "$@"]


@pytest.mark.parametrize("name", ["finetune_domain.sh", "finetune_instruct.sh"])
def test_recipes_parse_against_the_real_parser(name):
    path = ROOT / "run" / name
    assert os.access(path, os.R_OK)
    args = recipe_args(path, {"CHECKPOINT": "ckpt", "DATA": "data/x"})
    cfg = parse_args(args)
    assert cfg.checkpoint.checkpoint_input_dir == "ckpt" and cfg.optim.min_lr > 0
    if name == "finetune_instruct.sh":
        assert cfg.data.dataset == "jsonl" and cfg.data.loss_on == "completion"


@pytest.mark.slow  # a few seconds each: 8 steps of the recipe's flags on tiny data
@pytest.mark.parametrize("name", ["finetune_domain.sh", "finetune_instruct.sh"])
def test_recipes_fine_tune_a_hugging_face_directory(tmp_path, capsys, name):
    transformers = pytest.importorskip("transformers")
    if name == "finetune_domain.sh":  # a .bin/.idx domain corpus of a 96-token vocabulary
        hf_dir = save_hf_model(tmp_path / "hf")
        data = tmp_path / "domain_text_document"
        with IndexedWriter(data, np.uint16) as writer:
            for doc in domain_docs(range(200)):
                writer.add_document(doc + [V - 1])
    else:  # prompt/completion JSONL in GPT-2 BPE: a model of its vocabulary
        cfg = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(hf_dir := tmp_path / "hf")
        data = tmp_path / "sft.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"Q: {a} plus {a % 7}?\nA:", "completion": f" {a + a % 7}"})
                                + "\n" for a in range(120)))
    out = tmp_path / "out"
    args = recipe_args(ROOT / "run" / name, {"CHECKPOINT": str(hf_dir), "DATA": str(data), "OUTPUT": str(out)})
    assert train_main([*args, "--max-len", "32", "--batch-size", "4", "--gradient-accumulation", "1",
                       "--train-samples", "32", "--lr-warmup-samples", "8", "--learning-rate", "3e-3",
                       "--min-lr", "3e-4", "--eval-every-steps", "4", "--save-per-steps", "8", "--num-workers", "0",
                       "--split", "90,10,0"]) == 0
    text = capsys.readouterr().out
    val = [float(x) for x in re.findall(r"validation after step \d+: loss (\S+),", text)]
    assert len(val) == 2 and val[1] < val[0]
    # The step line shows the LR of the next update: after 4 updates of 4 samples, sample 16 of a cosine over
    # 32 samples with 8 of warm-up; after the last, the floor.
    step_lrs = [float(lr) for _, lr in STEP_LR.findall(text)]
    cosine = 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * (16 - 8) / (32 - 8)))
    assert len(step_lrs) == 8 and step_lrs[3] == pytest.approx(cosine, rel=1e-5) and step_lrs[-1] == 3e-4
    assert (out / "step_8" / "model.safetensors").is_file()
