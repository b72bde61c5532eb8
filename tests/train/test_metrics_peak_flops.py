"""MFU's CPU peak: the best of several matmul reads, cached per CPU and only ever raised, and a step
that beats it never prints an MFU over 100% (issue 53: one slow start-up read gave 80-118%)."""

import json
import os
import re

import pytest
import torch

from gpt2forge.cli import train_main
from gpt2forge.train.metrics import peak_flops
from gpt2forge.train.metrics.peak_flops import StepMeter, device_peak_flops

CPU = torch.device("cpu")
GFLOP = 1e9
STEP_MFU = re.compile(r"^step \d+ of epoch \d+, .* MFU: (\S+),")


@pytest.fixture()
def reads(monkeypatch, tmp_path):
    """An empty peak cache under tmp_path and a matmul read whose results the test scripts: each call
    takes the next of `reads.script` (the last one repeats). Returns the reads taken."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak_flops, "cpu_half_matmul_is_emulated", lambda precision: False)

    class Reads(list):
        script = [150 * GFLOP]

    taken = Reads()

    def scripted_read(precision, **_):
        flops = taken.script[min(len(taken), len(taken.script) - 1)]
        taken.append((precision, flops))
        return flops

    monkeypatch.setattr(peak_flops, "measure_cpu_peak_flops", scripted_read)
    return taken


def meter_at(peak_flops, **kw) -> StepMeter:
    """A meter whose step of 1 s does 1 GFLOP per sample: `samples_per_step` GFLOP/s."""
    return StepMeter(1, 1, GFLOP, peak_flops, **kw)


def mfu_percent(text: str) -> float:
    return float(text.lstrip("~").rstrip("%"))


def test_mfu_stays_at_or_under_100_when_the_first_peak_read_is_slowed(reads):
    reads.script = [50 * GFLOP, 150 * GFLOP]  # the first read a third of the CPU's (a busy moment)
    meter = meter_at(device_peak_flops(CPU, "fp32"))
    _, _, text = meter.rates(1.0 / 140)  # a step at 140 GFLOP/s: faster than the slow read, not the CPU
    assert len(reads) > 1 and meter.peak_flops == 150 * GFLOP
    assert text == "93.3%" and meter.mfu(140.0) <= 1.0  # the slow read did not stand: no mark


@pytest.mark.parametrize("rate", [151, 400, 1e6])
def test_a_step_that_beats_every_read_re_reads_the_peak_and_marks_the_figure(reads, rate, capsys):
    reads.script = [50 * GFLOP] * peak_flops.PEAK_FLOPS_READS + [150 * GFLOP]  # busy all through start-up
    start_up = device_peak_flops(CPU, "fp32")
    meter = meter_at(start_up, reread_peak_flops=peak_flops.peak_flops_reader(CPU, "fp32"))
    _, tokens, text = meter.rates(1.0 / rate)
    assert text.startswith("~") and mfu_percent(text) <= 100.0 and meter.mfu(tokens) <= 1.0
    assert meter.peak_flops == max(150 * GFLOP, rate * GFLOP)  # re-read; raised to the step's rate if still beaten
    assert "above the peak" in capsys.readouterr().out
    assert mfu_percent(meter.rates(1.0 / 100)[2]) <= 100.0


def test_without_a_re_read_a_faster_step_raises_the_peak_and_later_figures_stay_marked():
    meter = meter_at(100 * GFLOP)  # a GPU's data sheet: nothing to re-read
    assert meter.rates(1.0 / 50)[2] == "50.0%"
    assert meter.rates(1.0 / 120)[2] == "~100.0%"
    assert meter.peak_flops == 120 * GFLOP and meter.rates(1.0 / 60)[2] == "~50.0%"  # against a step's rate: a bound


def test_re_reads_are_bounded_and_never_lower_the_peak(reads):
    calls = []

    def reread() -> float:
        calls.append(1)
        return 10 * GFLOP  # slower than the peak in hand

    meter = meter_at(100 * GFLOP, reread_peak_flops=reread)
    for rate in (110, 120, 130, 140, 150):
        assert mfu_percent(meter.rates(1.0 / rate)[2]) <= 100.0
    assert meter.peak_flops == 150 * GFLOP and len(calls) == peak_flops.REREADS


def test_the_step_line_mfu_becomes_a_number():
    from gpt2forge.train.metrics.monitor import numeric_mfu

    assert numeric_mfu("~97.5%") == pytest.approx(0.975)


def test_a_slower_read_never_lowers_the_cached_peak(reads):
    reads.script = [200 * GFLOP]
    assert device_peak_flops(CPU, "fp32") == 200 * GFLOP
    reads.script = [100 * GFLOP]  # a later run on a busy machine
    assert device_peak_flops(CPU, "fp32") == 200 * GFLOP
    assert peak_flops.remember_cpu_peak_flops("fp32", 120 * GFLOP) == 200 * GFLOP
    cached = json.loads(peak_flops.cache_file().read_text())
    assert cached == {peak_flops.cpu_peak_flops_key("fp32"): 200 * GFLOP}
    assert peak_flops.remember_cpu_peak_flops("fp32", 250 * GFLOP) == 250 * GFLOP  # a faster one raises it
    assert len(reads) == peak_flops.PEAK_FLOPS_READS + 1  # with a peak cached, one read: the cache is the floor


def test_the_cache_key_follows_the_cpu(reads, monkeypatch):
    """A peak cached for one CPU (model and flags, threads, CPUs usable, torch) is never another's."""
    reads.script = [300 * GFLOP]
    assert device_peak_flops(CPU, "fp32") == 300 * GFLOP
    here = peak_flops.cpu_peak_flops_key("fp32")
    assert peak_flops.cpu_peak_flops_key("bf16") != here
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))  # the same CPU, more of it usable
    more_cpus = peak_flops.cpu_peak_flops_key("fp32")
    reads.script = [100 * GFLOP]
    assert device_peak_flops(CPU, "fp32") == 100 * GFLOP
    monkeypatch.setattr(peak_flops, "cpu_identity", lambda: "Another CPU|0123456789ab|2 threads|torch 2.x")
    another = peak_flops.cpu_peak_flops_key("fp32")
    reads.script = [80 * GFLOP]
    assert device_peak_flops(CPU, "fp32") == 80 * GFLOP
    assert json.loads(peak_flops.cache_file().read_text()) == {here: 300 * GFLOP, more_cpus: 100 * GFLOP,
                                                         another: 80 * GFLOP}


def test_a_training_run_never_prints_an_mfu_over_100(reads, make_tiny_config, capsys):
    reads.script = [1e6]  # every read absurdly slow: each step beats the peak
    args = ["--model-config", str(make_tiny_config()), "--dataset", "generated", "--max-len", "16",
            "--batch-size", "2", "--gradient-accumulation", "1", "--device-iterations", "1", "--epochs", "1",
            "--num-workers", "0", "--precision", "fp32"]
    assert train_main(args) == 0
    figures = [m.group(1) for line in capsys.readouterr().out.splitlines() if (m := STEP_MFU.match(line))]
    assert figures and all(text.startswith("~") and mfu_percent(text) <= 100.0 for text in figures)
