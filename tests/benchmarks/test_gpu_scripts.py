"""benchmarks/gpu_check.sh and gpu_measure.sh, the prepared GPU runs: they parse (bash -n), their
--dry-run lists every step without running one and every training and evaluation command in it
parses with the real parser, and their JSON summary is rewritten when each step ends
(benchmarks/gpu_steps.sh), on a machine without a GPU."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from gpt2forge.evaluation.cli import wiki_parser
from gpt2forge.frontends.graphcore import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "gpu_check.sh": ["env", "imports", "ops_build", "memory_plan", "cuda_tests", "train_bf16_packed",
                     "resume_bf16_packed", "losses_after_resume", "generate_eager_vs_graphs", "evaluate_wiki",
                     "train_gpt_neo_window", "train_kfac", "train_deterministic_repeats",
                     "train_dropout_recompute_profiled", "train_fp16_dynamic_scaling", "train_offload_full",
                     "oom_one_line_error"],
    "gpu_measure.sh": ["train_bf16", "lm_head_op", "decode_bf16", "offload_full_gpt2_medium", "offload_full_gpt2_large",
                       "offload_full_gpt2_xl", "train_bf16_fused_loss"],
}


def dry_run(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / script), "--dry-run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_gpu_script_parses_and_its_dry_run_lists_every_step(script, tmp_path):
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)]).returncode == 0
    proc = dry_run(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^\[(\w+), \d+s\] ", proc.stdout, re.M)
    assert steps and sorted(steps) == sorted(SCRIPTS[script]), proc.stdout
    assert not list((tmp_path / "out").glob("*.json"))  # a dry run writes no results


def test_gpu_check_runs_every_test_marked_cuda_without_stopping_at_the_first(tmp_path):
    line = next(x for x in dry_run("gpu_check.sh", tmp_path).stdout.splitlines() if x.startswith("[cuda_tests"))
    marked = subprocess.run(["grep", "-rl", "--include=test_*.py", "pytest.mark.cuda", "tests"], cwd=ROOT,
                            capture_output=True, text=True).stdout.split()
    assert marked and all(path in line for path in marked), line
    assert " -x" not in line and "no:xdist" in line and "--timeout" in line


def test_gpu_script_refuses_an_unknown_argument(tmp_path):
    proc = dry_run("gpu_check.sh", tmp_path, "--fast")
    assert proc.returncode == 2 and "unknown argument --fast" in proc.stderr


def commands_of(dry: str, script: str) -> list[list[str]]:
    """Every `script` command line in a dry run's output (inside `bash -c` steps too), without its
    redirections."""
    found = []
    for line in dry.splitlines():
        if f"{script} " not in line:
            continue
        words = shlex.split(line[line.index(script):].split(" > ")[0].split(" || ")[0])
        found.append(words[1:])
    return found


def test_every_training_and_evaluation_command_parses_with_the_real_parser(tmp_path):
    out = dry_run("gpu_check.sh", tmp_path).stdout + dry_run("gpu_measure.sh", tmp_path).stdout
    train = commands_of(out, "train_gpt2.py")
    # packed, resumed, GPT-Neo, K-FAC, deterministic (twice), dropout, fp16, offload, OOM, the plan; 3 offload sizes
    assert len(train) == 14, out
    configs = [parse_args(argv) for argv in train]
    assert any(c.kfac.kfac for c in configs) and any(c.runtime.deterministic == "true" for c in configs)
    assert sum(c.memory.offload == "full" for c in configs) == 4
    assert max(c.parallel.batch_size for c in configs) == 8192  # the deliberate out-of-memory
    (evaluate,) = commands_of(out, "tasks/evaluate_wiki.py")
    assert wiki_parser().parse_args(evaluate).device == "cuda"


def test_the_summary_is_rewritten_when_each_step_ends_side_by_side_ones_too(tmp_path):
    # Two steps one after the other, then two side by side: the JSON after each holds every step ended so far.
    script = f"""
        set -uo pipefail
        cd {ROOT}
        NAME=probe BUDGET=100
        source benchmarks/gpu_steps.sh
        step first 10 true
        cp "$OUT/probe.json" {tmp_path}/after_first.json
        step second 10 false
        cp "$OUT/probe.json" {tmp_path}/after_second.json
        step slow 10 sleep 1 &
        step quick 10 true &
        wait
        cp "$OUT/probe.json" {tmp_path}/after_both.json
    """
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path), "PYTHON": "python3"}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

    def statuses(name: str) -> dict:
        return {k: v["status"] for k, v in json.loads((tmp_path / name).read_text())["steps"].items()}

    assert statuses("after_first.json") == {"first": "ok"}
    assert statuses("after_second.json") == {"first": "ok", "second": "failed"}
    assert statuses("after_both.json") == {"first": "ok", "second": "failed", "slow": "ok", "quick": "ok"}
    assert (tmp_path / "out" / "probe_logs.tar.gz").is_file() and not list((tmp_path / "out").glob("*.part"))
