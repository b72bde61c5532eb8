"""benchmarks/class_check.py: the class label from CPU flags, the contradiction logic on made-up figures,
the shipped figures quote the docs, and a smoke run writes a complete record (no timing is checked)."""

from __future__ import annotations

import datetime
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("class_check", ROOT / "benchmarks" / "class_check.py")
class_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(class_check)

CLOSE, FAR = {"decode_round_trip_ns": [40, 65]}, {"decode_round_trip_ns": [364, 395]}


def figure(metric, value, **extra):
    return {"metric": metric, "value": value, "doc": "docs/benchmarks.md", "section": "S", "date": "2026-01-01",
            "commit": None, "source": "made up", **extra}


MADE_UP = {"classes": [
    {"class": "Test EPYC", "label": "avx2", "cpu_model_contains": "EPYC", "figures": [
        figure("decode_round_floor_ratio", 1.05),
        figure("decode_start_floor_ratio", [1.02, 1.08]),
        figure("train_fp32_ratio", 1.42),
        figure("lm_head_op_time_ratio", 0.91),
    ]},
    {"class": "Test two-state EPYC", "label": "avx512_bf16", "cpu_model_contains": "EPYC", "figures": [
        figure("decode_round_floor_ratio", 1.07, when=CLOSE),
        figure("decode_round_floor_ratio", 1.20, when=FAR),
        figure("train_fp32_ratio", 1.53),
    ]},
]}


@pytest.mark.parametrize("flags,label", [
    (["avx2", "fma"], "avx2"), (["avx2", "avx512f", "avx512bw"], "avx512"),
    (["avx2", "avx512f", "avx512_bf16"], "avx512_bf16"), (["avx2", "avx512f", "avx512_bf16", "amx_tile"], "amx"),
    ([], "other")])
def test_class_label_from_flags(flags, label):
    assert class_check.cpu_class(flags) == label


def statuses(verdicts):
    return [(v["metric"], v["status"], v.get("worse")) for v in verdicts]


def test_contradictions_on_made_up_figures(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(MADE_UP))
    classes = class_check.load_figures(path)
    assert class_check.find_class(classes, "avx2", "AMD EPYC 7B13")["class"] == "Test EPYC"
    assert class_check.find_class(classes, "avx2", "Intel Xeon") is None  # a figure of one class never for another
    assert class_check.find_class(classes, "amx", "AMD EPYC") is None
    figures = classes[0]["figures"]
    # decode 1.40x against 1.05x: worse; the start's 1.15x is within 10% of the range 1.02-1.08; training
    # 1.24x against 1.42x (higher is better): worse; the LM head op not measured
    today = {"decode_round_floor_ratio": 1.40, "decode_start_floor_ratio": 1.15, "train_fp32_ratio": 1.24}
    assert statuses(class_check.compare(today, {}, figures, 0.10)) == [
        ("decode_round_floor_ratio", "contradicts", True), ("decode_start_floor_ratio", "agrees", None),
        ("train_fp32_ratio", "contradicts", True), ("lm_head_op_time_ratio", "not measured", None)]
    # better than recorded is a contradiction too (the docs' figure is stale): lower decode, higher training
    today = {"decode_round_floor_ratio": 0.90, "decode_start_floor_ratio": 1.20, "train_fp32_ratio": 1.60,
             "lm_head_op_time_ratio": 0.95}
    assert statuses(class_check.compare(today, {}, figures, 0.10)) == [
        ("decode_round_floor_ratio", "contradicts", False), ("decode_start_floor_ratio", "contradicts", True),
        ("train_fp32_ratio", "contradicts", False), ("lm_head_op_time_ratio", "agrees", None)]
    assert statuses(class_check.compare(today, {}, figures, 0.20))[1:3] == [
        ("decode_start_floor_ratio", "agrees", None), ("train_fp32_ratio", "agrees", None)]


@pytest.mark.parametrize("state,close,far", [
    ({"decode_round_trip_ns": 52}, "agrees", "other state"),          # inside the close range
    ({"decode_round_trip_ns": 300}, "other state", "contradicts"),    # nearest the far range
    ({}, "state unknown", "state unknown")])                          # one decode thread: no round trip
def test_a_two_state_class_compares_with_the_nearest_state(state, close, far):
    figures = MADE_UP["classes"][1]["figures"]
    verdicts = class_check.compare({"decode_round_floor_ratio": 1.05, "train_fp32_ratio": 1.50}, state, figures, 0.10)
    assert [v["status"] for v in verdicts] == [close, far, "agrees"]


def test_shipped_figures_quote_the_docs():
    shipped = json.loads((ROOT / "benchmarks" / "class_figures.json").read_text())
    labels = {class_check.cpu_class(f) for f in (["avx2"], ["avx512f"], ["avx512_bf16"], ["amx_tile"])}
    for klass in shipped["classes"]:
        assert klass["label"] in labels, klass["class"]
        for f in klass["figures"]:
            doc = (ROOT / f["doc"]).read_text()
            where = f"{klass['class']} {f['metric']}"
            assert f["metric"] in class_check.RATIOS, where
            assert f["source"] in doc and f"## {f['section']}\n" in doc, where  # still written there, verbatim
            for value in f["value"] if isinstance(f["value"], list) else [f["value"]]:
                assert f"{value:.2f}x" in f["source"], where  # the figure is the source's, not invented
            if "when" in f:
                assert f["when_source"] in doc, where
                for lo, hi in f["when"].values():
                    assert f"{lo}-{hi} ns" in f["when_source"], where


def test_unknown_check_is_refused():
    with pytest.raises(SystemExit):
        class_check.parse_args(["--checks", "decode,nope"])


@pytest.mark.slow
def test_smoke_run_appends_a_complete_record(tmp_path):
    from gpt2forge.tools.machine_report import cpu_info

    info = cpu_info()
    figures = {"classes": [{"class": "this machine", "label": class_check.cpu_class(info["flags"]),
                            "cpu_model_contains": info["model"], "figures": [
                                figure("train_fp32_ratio", 1e-3),        # far below any run: contradicted, better
                                figure("lm_head_op_time_ratio", 1e3),    # far above: contradicted, better
                                figure("decode_round_floor_ratio", 1.0, when=CLOSE)]}]}
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    results = tmp_path / "results.jsonl"
    runs = []
    for checks in ("decode,train,lm_head_op", "lm_head_op"):  # the second record is appended, not written over
        proc = subprocess.run([sys.executable, "benchmarks/class_check.py", "--smoke", "--checks", checks,
                               "--results", str(results), "--figures", str(tmp_path / "figures.json")], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(proc.stdout)
    lines = results.read_text().splitlines()
    assert len(lines) == 2 and set(json.loads(lines[1])["raw"]) == {"lm_head_op"}
    record, stdout = json.loads(lines[0]), runs[0]
    assert record["class"] == class_check.cpu_class(info["flags"]) and record["class_name"] == "this machine"
    assert record["cpu_model"] == info["model"] and record["smoke"] is True and not record["errors"]
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"])  # HEAD then: others may have committed since
    assert subprocess.run(["git", "merge-base", "--is-ancestor", record["commit"], "HEAD"], cwd=ROOT).returncode == 0
    assert datetime.datetime.fromisoformat(record["date"]).tzinfo is not None
    assert isinstance(record["load_1min_start"], float)
    assert set(record["raw"]) == set(record["settings"]) == {"decode", "train", "lm_head_op"}
    for key in ("decode_start_floor_ratio", "decode_round_floor_ratio", "train_fp32_ratio", "lm_head_op_time_ratio"):
        assert record["ratios"][key] > 0, key
    verdicts = {v["metric"]: v for v in record["verdicts"]}
    assert verdicts["train_fp32_ratio"]["status"] == "contradicts" and not verdicts["train_fp32_ratio"]["worse"]
    assert verdicts["lm_head_op_time_ratio"]["status"] == "contradicts"
    assert not verdicts["lm_head_op_time_ratio"]["worse"]
    # with one decode thread there is no round trip, so the one-state figure is not compared
    assert verdicts["decode_round_floor_ratio"]["status"] in ("agrees", "contradicts", "other state", "state unknown")
    compared = [v for v in record["verdicts"] if v["status"] in ("agrees", "contradicts")]
    contradicted = sum(v["status"] == "contradicts" for v in compared)
    assert re.search(rf"^{contradicted} of {len(compared)} recorded figures contradicted", stdout, re.M), stdout[-2000:]
    assert "CONTRADICTS docs/benchmarks.md (S, 2026-01-01): train_fp32_ratio" in stdout


def test_a_run_held_to_an_older_instruction_set_is_recorded_so_and_compared_with_no_class(tmp_path, monkeypatch,
                                                                                          capsys):
    from gpt2forge.core.precision import ISA_LIMITS
    from gpt2forge.tools.machine_report import cpu_info

    info = cpu_info()
    measured = class_check.Measured(ratios={"lm_head_op_time_ratio": 9.0, "lm_head_op_memory_ratio": 0.1}, state={},
                                    raw={"fused_seconds": 9.0, "plain_seconds": 1.0})
    monkeypatch.setattr(class_check, "CHECKS", (class_check.Check(name="lm_head_op", benchmark="made_up.py", args=(),
                                                                  smoke_args=(), run=lambda _: measured),))
    figures = tmp_path / "figures.json"
    figures.write_text(json.dumps({"classes": [{"class": "this machine", "label": class_check.cpu_class(info["flags"]),
                                                "cpu_model_contains": info["model"],
                                                "figures": [figure("lm_head_op_time_ratio", 0.9)]}]}))
    results = tmp_path / "results.jsonl"
    args = ["--checks", "lm_head_op", "--results", str(results), "--figures", str(figures)]
    for name in ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert class_check.main(args) == 0
    assert "CONTRADICTS" in capsys.readouterr().out  # as the CPU is: its class's figure applies
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert class_check.main(args) == 0
    out = capsys.readouterr().out
    assert "held to an older instruction set (ATEN_CPU_CAPABILITY=avx2)" in out and "CONTRADICTS" not in out
    first, held = (json.loads(line) for line in results.read_text().splitlines())
    assert first["isa_limits"] == {} and first["class_name"] == "this machine"
    assert held["isa_limits"] == {"ATEN_CPU_CAPABILITY": "avx2"} and held["class_name"] is None
    assert held["verdicts"] == []
