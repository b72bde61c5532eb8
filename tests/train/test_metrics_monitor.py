"""Observability: the metrics file every run writes, TensorBoard, the profiler, W&B offline mode, the
progress bar, the plot command and the environment report."""

import io
import json
import re
import struct
import sys
import types
from pathlib import Path

import pytest

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.tools.machine_report import CPU_FLAGS, environment, format_report
from gpt2forge.tools.plot import main as plot_main
from gpt2forge.tools.plot import plot, read_metrics
from gpt2forge.train.metrics import monitor
from gpt2forge.train.metrics.profiler import parse_profile_steps

STEP_LINE = re.compile(r"^step \d+ of epoch \d+, loss: (\S+), acc: \S+, lr: (\S+), throughput: \S+ samples/sec, "
                       r"tokens/s: \S+, MFU: (\S+),")


@pytest.fixture()
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(activation_function="gelu")


def tiny_args(cfg: Path, *extra: str) -> list[str]:
    return ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--gradient-accumulation", "2", "--device-iterations", "1", "--epochs", "1", "--num-workers", "0",
            "--learning-rate", "3e-3", "--lr-schedule", "cosine", *extra]


def test_trainer_writes_metrics_tensorboard_and_profile(tiny_config, tmp_path, capsys):
    metrics, tb, prof = tmp_path / "m" / "metrics.jsonl", tmp_path / "tb", tmp_path / "prof"
    assert train_main(tiny_args(tiny_config, "--metrics-file", str(metrics), "--tensorboard-dir", str(tb),
                                "--profile-steps", "2:3", "--profile-dir", str(prof))) == 0
    lines = [m.groups() for ln in capsys.readouterr().out.splitlines() if (m := STEP_LINE.match(ln))]
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["tokens"] for r in train] == [64, 128, 192, 256]
    for rec, (loss, lr, mfu) in zip(train, lines, strict=True):  # the file holds what the step lines print
        assert f"{rec['loss']:.4f}" == loss and f"{rec['lr']:.6g}" == lr
        assert isinstance(rec["mfu"], float) and f"{100 * rec['mfu']:.1f}%" == mfu

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/tokens_per_sec", "train/mfu", "train/peak_memory_gib"} <= set(
        acc.Tags()["scalars"])
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert [e.value for e in events] == pytest.approx([r["loss"] for r in train], rel=1e-6)  # stored as float32

    trace = json.loads((prof / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2  # host steps 2 and 3
    assert "aten::" in (prof / "top_ops.txt").read_text()


def test_metrics_file_defaults(tmp_path, monkeypatch):
    model = types.SimpleNamespace(vocab_size=96)
    cfg = parse_args(["--dataset", "generated", "--checkpoint-output-dir", str(tmp_path / "ck")])
    assert monitor.metrics_path(cfg, "x") == tmp_path / "ck" / "metrics.jsonl"
    cfg = parse_args(["--dataset", "generated", "--model", "gpt2-medium", "--max-len", "256", "--batch-size", "2",
                      "--gradient-accumulation", "8"])
    name = monitor.run_name(cfg, model)
    assert name == "gpt2-medium_96_sl256_gbs16"  # the reference's W&B name scheme
    monkeypatch.delenv(monitor.RUNS_DIR_ENV, raising=False)
    assert re.fullmatch(r"runs/gpt2-medium_96_sl256_gbs16_\d{8}-\d{6}/metrics.jsonl",
                        monitor.metrics_path(cfg, name).as_posix())
    monkeypatch.setenv(monitor.RUNS_DIR_ENV, str(tmp_path / "r"))
    assert monitor.metrics_path(cfg, name).parent.parent == tmp_path / "r"


@pytest.mark.parametrize("text", ["3", "0:2", "4:3", "a:b"])
def test_bad_profile_steps_name_the_flag(text):
    with pytest.raises(UsageError, match=f"--profile-steps '{text}': expected A:B"):
        parse_profile_steps(text)


def test_mfu_becomes_a_number():
    assert monitor.numeric_mfu("12.3%") == pytest.approx(0.123)
    assert monitor.numeric_mfu(0.5) == 0.5 and monitor.numeric_mfu("unknown") is None


def test_wandb_goes_offline_without_an_api_key(tmp_path, monkeypatch):
    calls = {}
    fake = types.SimpleNamespace(init=lambda **kw: calls.setdefault("init", kw),
                                 log=lambda d: calls.setdefault("log", []).append(d),
                                 finish=lambda: calls.setdefault("finish", True))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    cfg = parse_args(["--dataset", "generated", "--use-wandb", "--metrics-file", str(tmp_path / "m.jsonl")])
    run_monitor = monitor.RunMonitor(cfg, types.SimpleNamespace(vocab_size=50257), total_steps=1)
    run_monitor.step({"step": 1, "epoch": 0, "tokens": 128, "loss": 2.0, "acc": 0.5, "lr": 1e-4,
                  "samples_per_sec": 3.0, "tokens_per_sec": 384.0, "mfu": "unknown"})
    run_monitor.close()
    import os

    assert os.environ["WANDB_MODE"] == "offline"
    assert calls["init"]["project"] == "torch-gpt2" and calls["init"]["name"] == "gpt2_50257_sl128_gbs1"
    assert calls["log"][0]["Loss"] == 2.0 and calls["log"][0]["Throughput"] == 3.0 and calls["finish"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal_and_prints_go_around_it(monkeypatch):
    record = {"step": 1, "loss": 2.0, "tokens_per_sec": 10.0}
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = monitor._ProgressBar(total=4)
    bar.update(record)
    assert bar.bar.disable and sys.stderr.getvalue() == ""
    bar.close()
    term_out, term_err = _Terminal(), _Terminal()
    monkeypatch.setattr(sys, "stdout", term_out)
    monkeypatch.setattr(sys, "stderr", term_err)
    bar = monitor._ProgressBar(total=4)
    bar.update(record)
    assert sys.stdout is not term_out  # step lines go through tqdm.write while the bar shows
    print("step line")
    bar.update({**record, "step": 2})
    bar.close()
    assert sys.stdout is term_out and sys.stderr is term_err
    assert "step line" in term_out.getvalue() and "2/4" in term_err.getvalue()


def write_metrics(path: Path) -> None:
    rows = [{"kind": "train", "step": s, "epoch": 0, "tokens": 64 * s, "loss": 5.0 - 0.5 * s, "lr": 1e-3 * s,
             "muon_lr": 4e-3 * s, "tokens_per_sec": 100.0 + s} for s in (1, 2, 3)]
    rows.insert(2, {**rows[1], "loss": 99.0})  # a resumed run re-did step 2: the last record wins
    rows.append({"kind": "validation", "step": 3, "tokens": 192, "val_loss": 3.9, "val_perplexity": 49.4})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + json.dumps(rows[2]) + "\n"
                    + "".join(json.dumps(r) + "\n" for r in rows[3:]) + '{"kind": "tra')  # torn last line


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_plot_draws_the_files_data(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics)
    drawn = plot(metrics, tmp_path / "charts", width=640, height=400)
    assert drawn["loss.png"] == {"train loss": ([64.0, 128.0, 192.0], [4.5, 99.0, 3.5]),
                                 "validation loss": ([192.0], [3.9])}
    assert drawn["throughput.png"] == {"tokens/s": ([64.0, 128.0, 192.0], [101.0, 102.0, 103.0])}
    assert drawn["lr.png"] == {"lr": ([1.0, 2.0, 3.0], [0.001, 0.002, 0.003]),
                               "muon lr": ([1.0, 2.0, 3.0], [0.004, 0.008, 0.012])}
    for name in drawn:
        assert png_size(tmp_path / "charts" / name) == (640, 400)
    assert plot_main([str(metrics), "--out", str(tmp_path / "c2")]) == 0
    assert png_size(tmp_path / "c2" / "loss.png") == (900, 500)
    assert "line 6 is incomplete" in capsys.readouterr().err


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert plot_main([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{}\n")
    with pytest.raises(UsageError, match="bad.jsonl: line 1 is not JSON"):
        read_metrics(bad)
    assert "metrics file not found" in capsys.readouterr().err


def test_environment_report():
    env = environment()
    assert set(env["cpu"]["flags"]) <= set(CPU_FLAGS)
    assert env["packages"]["torch"] != "not installed"
    text = format_report(env)
    assert text.startswith("== environment") and "custom ops:" in text and "fast paths:" in text
    assert f"torch CPU capability {env['devices']['cpu_capability']}" in text


def test_wait_for_quiet_waits_for_a_low_load_and_warns_when_it_never_comes(monkeypatch, capsys):
    from gpt2forge.tools import machine_report
    loads = iter([2.0, 1.0, 0.3])
    monkeypatch.setattr(machine_report.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(machine_report.time, "sleep", lambda s: None)
    assert machine_report.wait_for_quiet(60.0) == 0.3
    assert "1-minute load 0.30: quiet machine" in capsys.readouterr().out
    monkeypatch.setattr(machine_report.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert machine_report.wait_for_quiet(0.0) == 1.5  # 0: at once
    assert "warning: the machine is not quiet (1-minute load 1.50, quiet is below 0.5)" in capsys.readouterr().out
