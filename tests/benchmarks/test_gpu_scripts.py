"""benchmarks/gpu_check.sh and gpu_measure.sh, the prepared GPU runs: they parse (bash -n) and their
--dry-run lists every step without running one, on a machine without a GPU."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "gpu_check.sh": ["env", "imports", "ops_build", "memory_plan", "cuda_tests", "train_bf16_packed",
                     "resume_bf16_packed", "losses_after_resume", "generate_eager_vs_graphs",
                     "train_dropout_recompute_profiled", "train_fp16_dynamic_scaling", "train_offload_full"],
    "gpu_measure.sh": ["train_bf16", "lm_head_op", "decode_bf16", "train_bf16_fused_loss"],
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
