"""--precision auto on the CPU: the faster of bf16 and fp32 by a probe, cached per machine."""

import json

import pytest
import torch

import gpt2forge.core.precision as precision
from gpt2forge.core.errors import UsageError
from gpt2forge.core.precision import resolve_precision


@pytest.fixture()
def probe(monkeypatch, tmp_path):
    """No pin, the cache under tmp_path, and a probe whose times the test sets; returns its calls."""
    monkeypatch.delenv(precision.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    times = {"fp32": 1.0, "bf16": 0.5}

    class Calls(list):
        pass

    calls = Calls()

    def fake(p, **_):
        calls.append(p)
        return times[p]

    monkeypatch.setattr(precision, "probe_seconds", fake)
    calls.times = times
    return calls


def test_bf16_is_chosen_where_it_measured_faster_by_the_margin_and_the_answer_is_cached(probe):
    choice, why = precision.cpu_auto_precision(bf16_emulated=False)
    assert choice == "bf16" and "2.00x" in why and "measured now" in why
    assert sorted(probe) == ["bf16", "fp32"]
    cached = json.loads(precision.cache_file().read_text())
    assert cached[precision.cpu_identity()] == {"fp32_s": 1.0, "bf16_s": 0.5}
    probe.times["bf16"] = 5.0  # the cache answers: no second probe
    assert precision.cpu_auto_precision(bf16_emulated=False)[0] == "bf16"
    assert len(probe) == 2


def test_a_run_held_to_an_older_instruction_set_measures_again(probe, monkeypatch):
    for name in precision.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert precision.cpu_auto_precision(bf16_emulated=False)[0] == "bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # bf16 matmuls emulated: the native answer is not this one
    probe.times["bf16"] = 50.0
    assert precision.cpu_auto_precision(bf16_emulated=False)[0] == "fp32"
    assert len(probe) == 4 and precision.cpu_identity().endswith("|ONEDNN_MAX_CPU_ISA=AVX2")


@pytest.mark.parametrize("bf16_s", [0.95, 1.0, 3.0])
def test_fp32_stays_where_bf16_is_not_clearly_faster(probe, bf16_s):
    probe.times["bf16"] = bf16_s
    assert precision.cpu_auto_precision(bf16_emulated=False)[0] == "fp32"


def test_emulated_bf16_is_not_timed(probe):
    assert precision.cpu_auto_precision(bf16_emulated=True) == ("fp32", "this CPU has no bf16 matmul kernels")
    assert probe == []


def test_the_environment_pins_the_answer_and_a_bad_value_is_refused(probe, monkeypatch):
    monkeypatch.setenv(precision.ENV, "bf16")
    assert precision.cpu_auto_precision(bf16_emulated=False)[0] == "bf16"
    monkeypatch.setenv(precision.ENV, "half")
    with pytest.raises(UsageError, match="GPT2FORGE_CPU_PRECISION"):
        precision.cpu_auto_precision(bf16_emulated=False)
    assert probe == []


def test_a_damaged_cache_is_measured_again(probe):
    precision.cache_file().parent.mkdir(parents=True)
    precision.cache_file().write_text("{not json")
    assert precision.cpu_auto_precision(bf16_emulated=False)[0] == "bf16"
    assert len(probe) == 2


def test_resolve_precision_auto_on_the_cpu_says_what_it_chose_and_why(probe, monkeypatch, capsys):
    monkeypatch.setattr("gpt2forge.core.precision.cpu_half_matmul_is_emulated", lambda p: False)
    assert resolve_precision("auto", torch.device("cpu")) == "bf16"
    assert "Precision: bf16 (--precision auto: bf16 autocast ran" in capsys.readouterr().out


def test_the_real_probe_times_both_precisions():
    assert precision.probe_seconds("fp32", rows=16, width=32, reps=1) > 0
    assert precision.probe_seconds("bf16", rows=16, width=32, reps=1) > 0
