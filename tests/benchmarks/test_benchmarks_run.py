"""The issue-24 benchmarks, the K-FAC update-time benchmark and the blend-order benchmark run end to
end on a tiny shape and print their ratios (no timing is checked)."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2forge.ops.library import has_op

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quality_parity_runs_both_arms_on_a_tiny_model(tmp_path):
    gen = __import__("numpy").random.default_rng(0)
    docs = [list(gen.integers(0, 50256, int(n))) + [50256] for n in gen.integers(40, 400, 60)]
    corpus = tmp_path / "corpus.pkl"
    corpus.write_bytes(pickle.dumps([[int(t) for t in d] for d in docs]))
    config = json.loads((ROOT / "config" / "config_mini.json").read_text())
    config.update(n_embd=32, n_head=2, n_layer=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = run(["benchmarks/quality_parity.py", "--steps", "4", "--warmup", "1", "--eval-every", "2", "--seeds", "0",
               "--val-num", "4", "--corpus", str(corpus), "--model-config", str(tmp_path / "config.json"),
               "--ours-flags", "--torch-compile false", "--wait-quiet", "0", "--json", str(tmp_path / "r.json")])
    assert "ours - trainer" in out and "Trainer's final held-out loss" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert {(r["arm"], r["seed"]) for r in result["runs"]} == {("ours", 0), ("trainer", 0)}
    for r in result["runs"]:
        assert [s for s, _, _ in r["curve"]] == [2, 4] and all(0 < loss < 12 for _, loss, _ in r["curve"])


def test_quality_parity_summary_compares_per_seed_and_mean_curves(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import quality_parity
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    runs = [  # (update, held-out loss, seconds): seed 0's ours passes its Trainer, seed 1's does not
        {"arm": "ours", "seed": 0, "curve": [(1, 6.0, 10.0), (2, 5.0, 20.0)], "wall_s": 20.0},
        {"arm": "trainer", "seed": 0, "curve": [(1, 6.0, 50.0), (2, 5.5, 100.0)], "wall_s": 100.0},
        {"arm": "ours", "seed": 1, "curve": [(1, 6.2, 10.0), (2, 5.8, 20.0)], "wall_s": 20.0},
        {"arm": "trainer", "seed": 1, "curve": [(1, 6.0, 50.0), (2, 5.5, 100.0)], "wall_s": 100.0},
    ]
    summary = quality_parity.summarize(runs, "")
    out = capsys.readouterr().out
    assert summary["wall_ratios"] == {0: 0.15, 1: None}  # 5.5 is halfway from 6.0 to 5.0: 15 s of 100
    assert summary["paired_gaps"] == pytest.approx([-0.5, 0.3])
    # mean curves: ours 6.1, 5.4 at 10, 20 s; the Trainer's mean final 5.5 at 100 s: 5.5 at 10 + 10 * 0.6/0.7
    assert summary["mean_wall_ratio"] == pytest.approx((10 + 10 * 0.6 / 0.7) / 100)
    assert "seed 1: ours reaches the Trainer's final held-out loss not within 2 updates: MISSED" in out
    assert "mean over seeds: ours reaches the Trainer's mean final held-out loss in 0.19x" in out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_profile_prints_the_breakdown(precision):
    out = run(["benchmarks/step_profile.py", "--model", "gpt2-test", "--batch-size", "1", "--seq-len", "16",
               "--steps", "1", "--profile-steps", "1", "--precision", precision])
    for line in ("matmul: qkv", "matmul: LM head", "optimizer", "framework overhead", "MFU",
                 f"T=16, {precision},", f"{precision} matmul peak measured in this run"):
        assert line in out


def test_train_throughput_reads_the_peak_in_the_run(tmp_path):
    out = run(["benchmarks/train_throughput.py", "--model", "gpt2-test", "--batch-size", "1", "--seq-len", "16",
               "--steps", "2", "--warmup", "1", "--precisions", "fp32", "--json", str(tmp_path / "r.json"),
               "--profile", str(tmp_path / "profile")])
    assert "ratio" in out and "MFU of the peak measured in this run" in out
    for impl in ("ours", "transformers"):  # the profiled steps' tables
        table = (tmp_path / "profile" / f"{impl}_fp32.txt").read_text()
        assert f"{impl}_fp32: 2 steps profiled" in table and "graph breaks:" in table and "aten::mm" in table
    assert "against the best peak this machine has shown" in out
    (s,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert len(s["peak_reads_flops"]) == 3  # before the warm-up and after each of the 2 rounds
    assert s["device_peak_flops"] == max(s["peak_reads_flops"]) <= s["best_peak_flops"]
    ours = s["impls"]["ours"]
    assert ours["mfu"] >= ours["mfu_best_peak"] > 0


def test_generation_latency_prints_the_floor_ratio():
    out = run(["benchmarks/generation_latency.py", "--model", "gpt2-test", "--quick", "--no-compile",
               "--prompt-len", "8", "--new-tokens", "4", "--hf-threads", "ours"])
    assert "ours / floor:" in out and "triad" in out and "bandwidth at the end" in out
    assert "ours / the floor measured around ours in each round (" in out
    assert "1-minute load" in out  # the load it started under
    if has_op("gemv_linear"):  # the step-by-step pairing reads with the kernel
        assert re.search(r"ours step by step / the kernel's one-call read .* median over all steps [0-9.]+x", out)


def test_generation_latency_checks_bf16_against_fp32_greedy():
    out = run(["benchmarks/generation_latency.py", "--model", "gpt2-test", "--precisions", "fp32,bf16", "--batch-sizes",
               "1", "--rounds", "1", "--no-compile", "--prompt-len", "8", "--new-tokens", "6", "--hf-threads", "ours",
               "--accuracy-model", "random"])
    assert "ours / the fp32 weights' floor:" in out
    assert "bf16 against fp32 greedy decoding (random gpt2-test weights" in out and "identical for" in out


def test_kfac_step_prints_whole_cycles_and_the_parts():
    out = run(["benchmarks/kfac_step.py", "--quick"])
    assert "K-FAC 5/50 / AdamW:" in out and "K-FAC 1/10" in out
    out = run(["benchmarks/kfac_step.py", "--quick", "--components", "--steps", "2"])
    for line in ("precondition only", "factors + precondition", "decomposition (alone)",
                 "K-FAC 5/50: ", "combined from the parts"):
        assert line in out, out


def test_blend_order_compares_with_the_python_order():
    if not has_op("build_blending_indices"):
        pytest.skip("the custom ops library is not built (make custom_ops)")
    out = run(["benchmarks/blend_order.py", "--samples", "2e4", "--python-samples", "2e3", "--repeats", "1"])
    assert "ours (C++ op)" in out and "ns/sample" in out
    assert re.search(r"Python reference .* ours is \d+x faster; arrays equal", out)


def test_lm_head_memory_op_checks_the_fused_function_against_plain():
    out = run(["benchmarks/lm_head_memory.py", "op", "--tokens", "96", "--vocab", "512", "--embd", "32",
               "--repeats", "1", "--device", "cpu"])
    lines = [line for line in out.splitlines() if "against plain, relative differences" in line]
    assert len(lines) == (2 if has_op("lm_head_ce") else 1), out  # fused (the C++ op, if built) and reference
    for line in lines:
        assert all(float(x) < 1e-4 for x in re.findall(r"(\d\.\de[-+]\d+)", line)), line
