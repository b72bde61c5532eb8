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
