"""benchmarks/peer_nanogpt.py: its summary arithmetic, the seed offset it gives nanoGPT's train.py, its
scoring of a nanoGPT model against nanoGPT's own loss, its refusal of a folder that is not nanoGPT,
and a smoke run of both arms (4 updates, no timing checked)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NANOGPT = ROOT.parent / "shared" / "reference" / "nanogpt"
"""An unmodified karpathy/nanoGPT checkout beside the repository (never copied into it)."""
needs_nanogpt = pytest.mark.skipif(not (NANOGPT / "train.py").is_file(),
                                   reason=f"no nanoGPT checkout at {NANOGPT}")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import peer_nanogpt
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return peer_nanogpt


def run_record(arm: str, seed: int, curve: list[tuple[int, float, float]], wall: float, step: float = 0.5) -> dict:
    return {"arm": arm, "seed": seed, "curve": curve, "wall_s": wall, "step_s_median": step, "first_step_s": 2 * step}


def test_max_len_and_batch_size_set_both_arms_job(bench, tmp_path):
    """--max-len and --batch-size reach ours' flags (--stride following --max-len: windows that do not
    overlap) and nanoGPT's block_size and batch_size; at TRAIN_ARGS' own --max-len its --stride stays."""
    args = bench.parse_args(["--nanogpt", str(tmp_path), "--max-len", "256", "--batch-size", "4"])
    flags = bench.ours_flags(3, args, tmp_path)
    value = {name: flags[len(flags) - 1 - flags[::-1].index(name) + 1] for name in ("--max-len", "--stride",
                                                                                    "--batch-size", "--seed")}
    assert value == {"--max-len": "256", "--stride": "256", "--batch-size": "4", "--seed": "3"}
    settings = bench.nanogpt_settings(args)
    assert (settings["block_size"], settings["batch_size"], settings["eval_iters"]) == (256, 4, args.val_num // 4)
    default = bench.parse_args(["--nanogpt", str(tmp_path)])
    assert bench.stride_for(default) == int(bench.train_flag("--stride"))
    assert bench.nanogpt_settings(default)["block_size"] == int(bench.train_flag("--max-len"))


def test_summary_ratios_are_ours_time_to_the_peer_final_loss_over_its_wall_time(bench, capsys):
    runs = [  # (update, held-out loss, seconds): seed 0's ours passes nanoGPT's final loss, seed 1's does not
        run_record("ours", 0, [(1, 6.0, 10.0), (2, 5.0, 20.0)], 20.0),
        run_record("nanogpt", 0, [(1, 6.0, 50.0), (2, 5.5, 100.0)], 100.0, step=1.0),
        run_record("ours", 1, [(1, 6.2, 10.0), (2, 5.8, 30.0)], 30.0),
        run_record("nanogpt", 1, [(1, 6.0, 50.0), (2, 5.5, 100.0)], 100.0, step=1.0),
    ]
    summary = bench.summarize(runs)
    assert summary["wall_ratios"] == {0: 0.15, 1: None}  # 5.5 is halfway from 6.0 to 5.0: 15 s of 100
    ours = summary["arms"]["ours"]
    assert ours["loss"][2] == pytest.approx((5.4, 0.565685), rel=1e-5)  # mean, stdev of 5.0 and 5.8
    assert ours["wall_s"] == pytest.approx((25.0, 7.071068)) and ours["first_step_s"] == (1.0, 0.0)
    assert summary["arms"]["nanogpt"]["step_s_median"] == (1.0, 0.0)
    # mean curve: ours 6.1 at 10 s, 5.4 at 25 s; nanoGPT's mean final 5.5: at 10 + 15 * 0.6 / 0.7 s of 100
    assert summary["mean_wall_ratio"] == pytest.approx((10 + 15 * 0.6 / 0.7) / 100)
    # paired by seed: at 2, -0.5 and +0.3; at 1, 0.0 and +0.2
    assert summary["paired"][2] == pytest.approx({"mean": -0.1, "se": 0.4, "lower": 1, "n": 2})
    assert summary["paired"][1] == pytest.approx({"mean": 0.1, "se": 0.1, "lower": 0, "n": 2})
    bench.report(summary, [0, 1])
    out = capsys.readouterr().out
    assert "seed 0: ours reaches nanoGPT's final held-out loss in 0.15x its wall time (target <= 0.5): met" in out
    assert "seed 1: ours reaches nanoGPT's final held-out loss not within the run: MISSED" in out
    assert re.search(r"held-out loss at 2 +5\.4000 \+- 0\.5657 +5\.5000 \+- 0\.0000", out)
    assert ("ours minus nanoGPT at 1, paired over 2 seeds: +0.1000 (SE 0.1000; ours lower in 0 of 2; target <= 0: "
            "MISSED)") in out
    assert ("ours minus nanoGPT at 2, paired over 2 seeds: -0.1000 (SE 0.4000; ours lower in 1 of 2; target <= -0.1: "
            "met)") in out


def test_one_arm_alone_is_summarized_alone(bench, capsys):
    runs = [run_record("nanogpt", seed, [(1, 6.0 + seed, 50.0), (2, 5.5 + seed, 100.0)], 100.0) for seed in (0, 1)]
    summary = bench.summarize(runs)
    assert set(summary["arms"]) == {"nanogpt"} and "paired" not in summary
    assert summary["arms"]["nanogpt"]["loss"][2] == pytest.approx((6.0, 0.707107), rel=1e-5)
    bench.report(summary, [0, 1])
    out = capsys.readouterr().out
    assert re.search(r"held-out loss at 2 +6\.0000 \+- 0\.7071\n", out) and "reaches" not in out


def test_seed_offset_file_makes_train_py_draw_1337_plus_the_seed_once(bench):
    namespace = {"torch": torch}
    manual_seed = torch.manual_seed
    try:
        exec(bench.SEED_OFFSET.format(seed=3), namespace)  # as nanoGPT's configurator runs a config file
        torch.manual_seed(1337)  # train.py's call
        drawn = torch.rand(4)
        assert torch.manual_seed is manual_seed  # unwrapped after that one call
    finally:
        torch.manual_seed = manual_seed
    torch.manual_seed(1340)
    assert torch.equal(drawn, torch.rand(4))


@needs_nanogpt
def test_held_out_loss_of_a_nanogpt_model_is_its_own_token_weighted_loss(bench):
    GPT, GPTConfig = bench.nanogpt_gpt_class(str(NANOGPT))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=16, dropout=0.0, bias=True))
    windows = [torch.randint(0, 50, (17,)) for _ in range(5)]
    windows[3][9:] = -100  # a short document's window: padded with IGNORE_INDEX
    loss = bench.held_out_loss(model, windows, batch_size=2)
    batch = torch.stack(windows)
    targets = batch[:, 1:].clone()
    targets[targets == -100] = -1  # nanoGPT's ignore_index
    _, expected = model(batch[:, :-1].clamp(min=0), targets)  # one batch: its mean over the scored tokens
    assert loss == pytest.approx(expected.item(), rel=1e-5)


def test_a_folder_without_nanogpt_is_refused_in_one_line(tmp_path):
    (tmp_path / "train.py").write_text("")
    proc = subprocess.run([sys.executable, "benchmarks/peer_nanogpt.py", "--nanogpt", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: --nanogpt {tmp_path} is not a nanoGPT folder: it lacks model.py, configurator.py "
                           "(clone https://github.com/karpathy/nanoGPT and name its folder)\n")


@pytest.fixture()
def corpus(tmp_path) -> Path:
    """make train's corpus: build/stdlib_docs.pkl, or built here the way the Makefile builds it."""
    built = ROOT / "build" / "stdlib_docs.pkl"
    if built.is_file():
        return built
    out = tmp_path / "stdlib_docs.pkl"
    subprocess.run([sys.executable, "data/build_default_corpus.py", "--output", str(out)], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    return out


@pytest.mark.slow
@needs_nanogpt
def test_smoke_both_arms_print_and_record_every_number(tmp_path, corpus):
    config = json.loads((ROOT / "config" / "config_mini.json").read_text())
    config.update(n_embd=32, n_head=2, n_layer=2)  # make train's vocabulary and context, a tiny body
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "benchmarks/peer_nanogpt.py", "--nanogpt", str(NANOGPT), "--steps", "4", "--warmup", "1",
         "--eval-every", "2", "--seeds", "0", "--val-num", "8", "--corpus", str(corpus), "--model-config",
         str(tmp_path / "config.json"), "--ours-flags", "--torch-compile false", "--wait-quiet", "0",
         "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "seed_offset.py --dataset=stdlib_docs --out_dir=out --device=cpu --dtype=float32 --compile=False" in out
    for arm in ("ours    ", "nanogpt "):
        assert re.search(rf"{arm} seed 0: 2: [0-9.]+, 4: [0-9.]+; step [0-9.]+ s, first [0-9.]+ s, wall [0-9.]+ s", out)
    for row in ("held-out loss at 2", "held-out loss at 4", "step s (median)", "first step s", "wall s"):
        assert re.search(rf"{re.escape(row)} +[0-9.]+ \+- [0-9.]+ +[0-9.]+ \+- [0-9.]+", out), row
    assert "seed 0: ours reaches nanoGPT's final held-out loss" in out and "mean over seeds: ours reaches" in out
    assert "number of parameters" not in out  # the parent's scoring stays quiet
    result = json.loads((tmp_path / "r.json").read_text())
    ours, peer = result["runs"] if result["runs"][0]["arm"] == "ours" else result["runs"][::-1]
    for run, updates in ((ours, 4), (peer, 5)):  # nanoGPT's loop makes one update after its last evaluation
        assert [s for s, _, _ in run["curve"]] == [2, 4] and all(0 < loss < 12 for _, loss, _ in run["curve"])
        assert len(run["step_s"]) == updates and run["wall_s"] > run["curve"][-1][2] > 0 < run["first_step_s"]
    # nanoGPT's own estimate draws windows of the same held-out tokens: near our score of the same weights
    assert abs(dict(peer["own_val_estimate"])[4] - peer["curve"][-1][1]) < 0.5
    assert set(result["summary"]["wall_ratios"]) == {"0"} and "mean_wall_ratio" in result["summary"]
    assert result["nanogpt_command"][1] == "seed_offset.py"
    # An ablation of ours against the same nanoGPT runs: only ours runs again.
    proc = subprocess.run(
        [sys.executable, "benchmarks/peer_nanogpt.py", "--nanogpt", str(NANOGPT), "--steps", "4", "--warmup", "1",
         "--eval-every", "2", "--seeds", "0", "--val-num", "8", "--corpus", str(corpus), "--model-config",
         str(tmp_path / "config.json"), "--ours-flags", "--torch-compile false --windows random", "--wait-quiet",
         "0", "--nanogpt-runs", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"nanoGPT's runs: from {tmp_path / 'r.json'}" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("nanogpt  seed 0:"))
    assert f"wall {peer['wall_s']:.1f} s" in line  # the earlier run's figures, not a new run's


def test_reused_nanogpt_runs_must_share_the_peer_settings(bench, tmp_path):
    earlier = tmp_path / "r.json"
    args = bench.parse_args(["--nanogpt", str(tmp_path), "--seeds", "0,1", "--nanogpt-runs", str(earlier)])
    earlier.write_text(json.dumps({"args": {**vars(args), "steps": args.steps + 1},
                                   "runs": [run_record("nanogpt", 0, [], 1.0)]}))
    assert "its runs had other --steps; run both arms again" in bench.reused_nanogpt_runs(args, [0])
    earlier.write_text(json.dumps({"args": vars(args), "runs": [run_record("nanogpt", 0, [], 1.0)]}))
    assert bench.reused_nanogpt_runs(args, [0])[0]["wall_s"] == 1.0
    assert "no nanoGPT run of seed(s) 1" in bench.reused_nanogpt_runs(args, [0, 1])
    earlier.write_text("{}")
    assert "not a --json of this benchmark" in bench.reused_nanogpt_runs(args, [0])


@pytest.mark.slow
@needs_nanogpt
def test_lockstep_trains_both_from_the_same_weights_on_the_same_batches(tmp_path, corpus):
    proc = subprocess.run(
        [sys.executable, "benchmarks/nanogpt_lockstep.py", "--nanogpt", str(NANOGPT), "--steps", "3", "--warmup", "0",
         "--seeds", "0", "--val-num", "8", "--corpus", str(corpus), "--json", str(tmp_path / "r.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    first_nano, first_ours = run["train_loss_curve"][0]
    # Same weights, same batch: the first losses differ only by nanoGPT's 47 padding classes
    # (ln(50304 / 50257) = 0.0009) and GELU's form.
    assert abs(first_nano - first_ours) < 0.005, run["train_loss_curve"]
    assert abs(run["ours"] - run["nanogpt"]) < 0.05 and "mean ours - nanoGPT" in proc.stdout
