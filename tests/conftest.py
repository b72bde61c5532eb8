"""Shared pytest set-up."""

import pytest


@pytest.fixture(autouse=True)
def _runs_dir(tmp_path, monkeypatch):
    """Training runs without --checkpoint-output-dir write their metrics file under runs/: keep
    tests' runs in their own temporary folder instead of the repository."""
    monkeypatch.setenv("GPT2FORGE_RUNS_DIR", str(tmp_path / "runs"))
