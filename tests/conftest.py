"""Shared pytest set-up."""

import json
import os
from pathlib import Path

import pytest
from fake_cuda import fake_cuda  # noqa: F401  (the fixture, for every test: tests/fake_cuda.py)

# The suite is calibrated on the CPU (exact step lines in fp32, gloo): GPUs are hidden from it and
# from the processes it starts. tests/test_cuda.py runs its GPU checks in child processes that get
# the machine's own CUDA_VISIBLE_DEVICES back (HOST_CUDA_VISIBLE_DEVICES).
HOST_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# --precision auto on the CPU is fp32 in the suite, on every CPU (the probe that decides it on a
# user's machine, gpt2forge.core.precision, has tests of its own that unset this).
os.environ["GPT2FORGE_CPU_PRECISION"] = "fp32"

TESTS = Path(__file__).resolve().parent

# CI's torch 2.11 leg runs the fast tier and, of the slow tests, these rooms' (marker torch_version): what a
# torch release can change under us. Compile and FlexAttention (model, generate, train, ops), the custom ops'
# ABI (ops), checkpoint formats and optimizers (train, parallel), DDP/FSDP2/pipelining/tensor parallel and
# torchrun (parallel), the CUDA tests (the GPU machines run torch 2.11). The rest of the slow tests (front
# ends, data and preprocessing tools, evaluation, benchmark smokes, fuzz, the namespaced cluster) run their
# torch-dependent parts through these same paths, and run in the first leg.
TORCH_VERSION_ROOMS = ("core", "generate", "model", "ops", "parallel", "train", "test_cuda.py")

FAST_TIER_BUDGET_S = 120
"""`make test-fast` on 2 cores of any CPU class, bf16-emulating AVX2 included (issue 55)."""
SLOW_CASE_S = 3.0
"""A test over this many seconds on a 2-core AVX-512 machine belongs in the full suite (@pytest.mark.slow)."""

TINY_MODEL = {"model_type": "gpt2", "vocab_size": 96, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2}


@pytest.fixture()
def make_tiny_config(tmp_path):
    """Writes tmp_path/tiny.json: a 2-layer GPT-2 config.json, `TINY_MODEL` with the given fields changed."""
    def make(**fields) -> Path:
        path = tmp_path / "tiny.json"
        path.write_text(json.dumps({**TINY_MODEL, **fields}))
        return path
    return make


@pytest.fixture(autouse=True)
def _runs_dir(tmp_path, monkeypatch):
    """Training runs without --checkpoint-output-dir write their metrics file under runs/: keep
    tests' runs in their own temporary folder instead of the repository."""
    monkeypatch.setenv("GPT2FORGE_RUNS_DIR", str(tmp_path / "runs"))


DEV_DATA = Path(os.environ.get("GPT2FORGE_DEV_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
"""The development copies of the real evaluation sets (WikiText, LAMBADA): $GPT2FORGE_DEV_DATA, else
the `shared/data` folder beside the repository. Never copied into the repository."""


@pytest.fixture()
def eval_data_or_none() -> Path | None:
    """The folder of the real evaluation sets (wikitext/, lambada/), or None when absent."""
    return DEV_DATA if (DEV_DATA / "wikitext").is_dir() and (DEV_DATA / "lambada").is_dir() else None


@pytest.fixture()
def eval_data(eval_data_or_none) -> Path:
    """The folder of the real evaluation sets (wikitext/, lambada/); skips the test when absent."""
    if eval_data_or_none is None:
        pytest.skip(f"real evaluation sets not found in {DEV_DATA} (set GPT2FORGE_DEV_DATA)")
    return eval_data_or_none


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.relative_to(TESTS).parts[0] in TORCH_VERSION_ROOMS:
            item.add_marker(pytest.mark.torch_version)


_fast_tier_seconds: dict[str, float] = {}
"""Seconds per test not marked slow (set-up, call and tear-down), filled as the run goes."""


def pytest_runtest_logreport(report):
    if "slow" not in report.keywords:
        _fast_tier_seconds[report.nodeid] = _fast_tier_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The fast tier's cost in this run, and its cases over SLOW_CASE_S: the guard that keeps
    `make test-fast` within FAST_TIER_BUDGET_S (a report, not a failure: times depend on the machine)."""
    if not _fast_tier_seconds:
        return
    total = sum(_fast_tier_seconds.values())
    over = sorted(((s, n) for n, s in _fast_tier_seconds.items() if s > SLOW_CASE_S), reverse=True)
    terminalreporter.write_line(
        f"fast tier (tests not marked slow): {len(_fast_tier_seconds)} tests, {total:.0f} s in tests "
        f"(make test-fast's budget: {FAST_TIER_BUDGET_S} s on 2 cores); {len(over)} over {SLOW_CASE_S:g} s"
        + (" (mark them @pytest.mark.slow, or make them smaller):" if over else ""))
    for seconds, nodeid in over[:10]:
        terminalreporter.write_line(f"  {seconds:5.1f} s  {nodeid}")
