"""End-to-end trainer tests on a tiny model: resume equals an uninterrupted run, checkpoints survive
kill -9, bad input gives one line and exit code 2."""

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpt2forge.cli import train_main

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step (\d+) of epoch (\d+), loss: (\S+), acc: (\S+), lr: (\S+), "
                       r"throughput: (\S+) samples/sec")


@pytest.fixture()
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(activation_function="gelu", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def base_args(cfg: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--gradient-accumulation", "2", "--device-iterations", "1", "--epochs", "2", "--num-workers", "0",
            "--learning-rate", "3e-3", "--lr-schedule", "cosine", "--max-grad-norm", "1.0",
            "--checkpoint-output-dir", str(out), *extra]


def step_lines(text: str) -> list[tuple[str, ...]]:
    """(step, epoch, loss, acc, lr) of each step line: everything but the timing."""
    return [m.groups()[:5] for line in text.splitlines() if (m := STEP_LINE.match(line))]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_resumed_run_equals_uninterrupted_run(tiny_config, tmp_path, capsys, workers):
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_main(base_args(tiny_config, full, "--save-per-steps", "3", "--num-workers", workers)) == 0
    full_lines = step_lines(capsys.readouterr().out)
    assert len(full_lines) == 8  # 4 host steps per epoch (generated data) x 2 epochs
    assert (full / "step_3").is_dir() and (full / "epoch_1").is_dir() and (full / "epoch_2").is_dir()

    assert train_main(base_args(tiny_config, part, "--checkpoint-input-dir", str(full / "step_3"),
                                "--resume-training-from-checkpoint", "True", "--num-workers", workers)) == 0
    resumed_lines = step_lines(capsys.readouterr().out)
    assert resumed_lines == full_lines[3:]
    a = load_file(full / "epoch_2" / "model.safetensors")
    b = load_file(part / "epoch_2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_auto_resume_continues_from_the_latest_checkpoint_and_keep_prunes(tiny_config, tmp_path, capsys):
    full, requeued = tmp_path / "full", tmp_path / "requeued"
    args = ["--save-per-steps", "3", "--auto-resume", "true", "--keep-checkpoints", "2"]
    # No checkpoint yet: a fresh run. It writes step_3, epoch_1, step_6, epoch_2 and keeps the newest two.
    assert train_main(base_args(tiny_config, full, *args)) == 0
    out = capsys.readouterr().out
    assert f"auto-resume: no checkpoint in {full} yet; starting a new run" in out
    assert sorted(d.name for d in full.iterdir() if d.is_dir()) == ["epoch_2", "step_6"]
    full_lines = step_lines(out)
    # A job requeued after writing step_6 (its output directory holds it): the same command continues.
    requeued.mkdir()
    shutil.copytree(full / "step_6", requeued / "step_6")
    (requeued / "latest").write_text("step_6\n")
    assert train_main(base_args(tiny_config, requeued, *args)) == 0
    out = capsys.readouterr().out
    assert f"auto-resume: continuing from {requeued / 'step_6'}" in out
    assert step_lines(out) == full_lines[6:]


def test_non_finite_gradients_skip_updates_and_stop_a_diverged_run(tiny_config, tmp_path, capsys):
    # A learning rate of 1e30 blows the weights up after the first updates; from then on every
    # gradient is NaN. Those updates are skipped (the weights stay finite) and the run stops with one line.
    args = base_args(tiny_config, tmp_path / "o", "--learning-rate", "1e30", "--lr-schedule", "constant",
                     "--max-nonfinite-updates", "3", "--save-per-steps", "1", "--gradient-accumulation", "1")
    args.remove("--max-grad-norm")
    args.remove("1.0")
    assert train_main(args) == 1
    captured = capsys.readouterr()
    assert captured.err.count("non-finite gradients, update skipped") == 3
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "3 updates in a row had non-finite gradients" in errors[0]
    saved = load_file(tmp_path / "o" / "step_1" / "model.safetensors")
    assert all(t.isfinite().all() for t in saved.values())


def test_fp16_overflows_while_the_scale_comes_down_hold_the_lr_and_never_stop_the_run(tiny_config, tmp_path, capsys,
                                                                                    monkeypatch):
    # Megatron's fp16 defaults (scale 2^32, hysteresis 2, window 1000): the first ~15 updates overflow
    # while the scale halves. They are skipped with the learning rate held (Megatron steps its scheduler
    # only `if update_successful`) and never count toward --max-nonfinite-updates, which stopped such
    # runs at update 10.
    metrics = tmp_path / "m.jsonl"
    args = base_args(tiny_config, tmp_path / "o", "--precision", "fp16", "--auto-loss-scaling", "true",
                     "--initial-loss-scale", str(2.0 ** 32), "--loss-scale-hysteresis", "2",
                     "--loss-scale-window", "1000", "--lr-schedule", "linear", "--lr-warmup", "0",
                     "--learning-rate", "1e-3", "--gradient-accumulation", "1", "--training-steps", "22",
                     "--metrics-file", str(metrics))
    monkeypatch.setattr("gpt2forge.core.log._seen_notices", set())  # notices print once per process
    assert train_main(args) == 0
    assert "fp16: gradients overflowed at this loss scale" in capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in rows if "loss_scale" in r]
    assert len(rows) == 22
    skipped = [r["grad_norm"] is None or not math.isfinite(r["grad_norm"]) for r in rows]
    k = skipped.index(False)  # the first applied update: every one before it overflowed, none after
    assert k > 10 and not any(skipped[k:])
    # Megatron-Core's DynamicGradScaler with hysteresis 2: the first overflow keeps 2^32, each later one halves.
    assert [r["loss_scale"] for r in rows[:k]] == [2.0 ** (32 - max(i, 0)) for i in range(k)]
    assert all(r["loss_scale"] == rows[k - 1]["loss_scale"] for r in rows[k:])
    # Linear decay over 22 updates, indexed by applied updates only: 1e-3 held through the skips.
    assert [r["lr"] for r in rows] == pytest.approx([1e-3 * (22 - max(0, i - k + 1)) / 22 for i in range(22)])


def test_loss_falls_and_step_line_format(tiny_config, tmp_path, capsys):
    args = base_args(tiny_config, tmp_path / "o", "--epochs", "6", "--learning-rate", "1e-2")
    assert train_main(args) == 0
    lines = step_lines(capsys.readouterr().out)
    losses = [float(x[2]) for x in lines]
    assert len(losses) == 24 and losses[-1] < losses[0] - 0.3


def test_same_seed_is_bit_reproducible(tiny_config, tmp_path, capsys):
    for name in ("a", "b"):
        assert train_main(base_args(tiny_config, tmp_path / name, "--epochs", "1")) == 0
    capsys.readouterr()
    a = load_file(tmp_path / "a" / "epoch_1" / "model.safetensors")
    b = load_file(tmp_path / "b" / "epoch_1" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_same_seed_is_bit_reproducible_compiled(tiny_config, tmp_path, capsys):
    # Inductor's CPU scatter-add (the tied embedding's gradient) adds with atomics in thread order;
    # --deterministic auto (on for the CPU) makes it call ATen's ordered kernel instead.
    assert not torch.are_deterministic_algorithms_enabled()
    for name in ("a", "b"):
        args = base_args(tiny_config, tmp_path / name, "--epochs", "1", "--torch-compile", "true")
        assert train_main(args) == 0
        assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is restored
    capsys.readouterr()
    a = load_file(tmp_path / "a" / "epoch_1" / "model.safetensors")
    b = load_file(tmp_path / "b" / "epoch_1" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_deterministic_mode_is_set_for_the_run_only():
    from gpt2forge.core.determinism import deterministic_algorithms

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for mode, device, want in (("auto", cpu, True), ("false", cpu, False), ("auto", cuda, False)):
        with deterministic_algorithms(mode, device) as on:
            assert on == want == torch.are_deterministic_algorithms_enabled()
        assert not torch.are_deterministic_algorithms_enabled()


def test_pickle_training_evaluates_validation(tiny_config, tmp_path, capsys):
    docs = [[(i * 7 + j) % 96 for j in range(40 + i)] for i in range(30)]
    pkl = tmp_path / "docs.pkl"
    pkl.write_bytes(pickle.dumps(docs))
    args = base_args(tiny_config, tmp_path / "o", "--dataset", "pickle", "--input-files", str(pkl),
                     "--val-num", "4", "--stride", "16", "--epochs", "1")
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"validation after step \d+: loss [\d.]+, perplexity [\d.]+, tokens \d+", out)
    state = torch.load(tmp_path / "o" / "epoch_1" / "training_state.pt", weights_only=True)
    assert "val_perplexity" in state["metrics"]


KILL_CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import gpt2forge.train.run_folder as ck
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    root, flag = Path(sys.argv[1]), Path(sys.argv[2])
    model = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    ck.save_checkpoint(root, "step_1", model, {"step": 1}, {})
    real_save = ck.save_file
    def slow_save(*args, **kwargs):
        real_save(*args, **kwargs)
        flag.write_text("mid-save")
        time.sleep(60)
    ck.save_file = slow_save
    ck.save_checkpoint(root, "step_2", model, {"step": 2}, {})
""")


@pytest.mark.slow
def test_kill_9_mid_save_leaves_earlier_checkpoints_intact(tmp_path):
    root, flag = tmp_path / "ckpts", tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(root), str(flag)], cwd=ROOT)
    deadline = time.time() + 120
    while not flag.exists():
        assert proc.poll() is None and time.time() < deadline, "child exited before reaching the save"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    visible = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert visible == ["latest", "step_1"]  # no half-written step_2 under a checkpoint name
    assert (root / "latest").read_text().strip() == "step_1"
    from gpt2forge.model.checkpoint import load_weights, resolve_checkpoint_dir
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    model = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    load_weights(model, resolve_checkpoint_dir(root))


def _error(capsys, argv) -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err
    return errors[0]


def test_bad_input_one_line_exit_2(tiny_config, tmp_path, capsys):
    out = tmp_path / "o"
    assert "--layers-per-ipu" in _error(capsys, base_args(tiny_config, out, "--layers-per-ipu", "0", "1",
                                                          "--ipus-per-replica", "2"))
    assert "missing.pkl" in _error(capsys, base_args(tiny_config, out, "--dataset", "pickle",
                                                     "--input-files", str(tmp_path / "missing.pkl")))
    empty = tmp_path / "empty.pkl"
    empty.write_bytes(b"")
    assert "empty.pkl" in _error(capsys, base_args(tiny_config, out, "--dataset", "pickle",
                                                   "--input-files", str(empty)))
    big = tmp_path / "big.pkl"
    big.write_bytes(pickle.dumps([[5] * 40, [1, 2, 96] + [3] * 40]))
    msg = _error(capsys, base_args(tiny_config, out, "--dataset", "pickle", "--input-files", str(big)))
    assert "big.pkl" in msg and "96" in msg
    assert "--checkpoint-input-dir" in _error(capsys, base_args(tiny_config, out,
                                                                "--resume-training-from-checkpoint"))
    assert "--input-files" in _error(capsys, base_args(tiny_config, out, "--dataset", "pickle"))


def test_checkpoint_errors(tiny_config, tmp_path, capsys):
    out = tmp_path / "o"
    assert train_main(base_args(tiny_config, out, "--epochs", "1")) == 0
    capsys.readouterr()
    ckpt = out / "epoch_1"
    msg = _error(capsys, base_args(tiny_config, tmp_path / "p", "--checkpoint-input-dir", str(ckpt),
                                   "--max-len", "65"))
    assert "--max-len 65" in msg and "n_positions=16" in msg
    (ckpt / "training_state.pt").unlink()
    msg = _error(capsys, base_args(tiny_config, tmp_path / "p", "--checkpoint-input-dir", str(ckpt),
                                   "--resume-training-from-checkpoint"))
    assert "training_state.pt" in msg
    assert "not found" in _error(capsys, base_args(tiny_config, out, "--checkpoint-input-dir",
                                                   str(tmp_path / "nowhere")))


@pytest.mark.slow
def test_entry_point_prints_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train_gpt2.py", "--dataset", "pickle", "--input-files",
                           str(tmp_path / "none.pkl"), "--model", "gpt2-test"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "none.pkl" in proc.stderr


@pytest.mark.slow
def test_compile_only_exits_zero(tiny_config, capsys):
    pytest.importorskip("torch._inductor")
    if not any(os.access(os.path.join(d, "c++"), os.X_OK) for d in os.environ.get("PATH", "").split(":")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    assert train_main(["--model-config", str(tiny_config), "--compile-only", "--max-len", "16",
                       "--batch-size", "2"]) == 0
    assert "Compiled/Loaded model in" in capsys.readouterr().out
