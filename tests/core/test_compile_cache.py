"""--executable-cache-dir on a file system that machines of several CPU classes share: each class
compiles into its own folder, so no class loads kernels inductor generated for another."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2forge.core import compilation, precision
from gpt2forge.core.compilation import compile_enabled, machine_cache_dir, use_machine_cache

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^(step \d+ of epoch \d+, loss: \S+, acc: \S+),", re.M)


def test_each_cpu_class_and_forced_isa_has_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    here = machine_cache_dir(str(tmp_path))
    assert Path(here).parent == tmp_path and machine_cache_dir(str(tmp_path)) == here  # stable on one machine
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert machine_cache_dir(str(tmp_path)) != here
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(compilation, "cpu_identity", lambda: precision.cpu_identity() + " (another CPU)")
    assert machine_cache_dir(str(tmp_path)) != here


def test_inductors_cache_wherever_it_is_gets_the_machines_folder_once(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"})
    use_machine_cache(None)  # inductor's default
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == machine_cache_dir(default_cache_dir())
    assert compile_enabled("true", torch.device("cpu"), str(tmp_path / "flag"))  # the flag wins
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == machine_cache_dir(str(tmp_path / "flag"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "shared")  # the user's
    assert not compile_enabled("auto", torch.device("cpu"), None)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == machine_cache_dir(str(tmp_path / "shared"))
    use_machine_cache(None)  # once only: no folder inside the folder
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == machine_cache_dir(str(tmp_path / "shared"))


def _train(config: Path, cache: Path, tmp_path: Path, **env: str) -> list[str]:
    args = ["--model-config", str(config), "--dataset", "generated", "--max-len", "32", "--batch-size", "4",
            "--gradient-accumulation", "1", "--device-iterations", "1", "--training-steps", "3", "--log-steps", "1",
            "--num-workers", "0", "--seed", "3", "--precision", "fp32", "--torch-compile", "true",
            "--executable-cache-dir", str(cache)]
    run = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-2000:]
    return STEP.findall(run.stdout)


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="needs a CPU with AVX-512, to compile for it and then for AVX2 alone")
def test_a_cache_filled_with_avx512_kernels_serves_an_avx2_run_the_same_losses(make_tiny_config, tmp_path):
    # Before the folders, the AVX2 run loaded the AVX-512 run's generated code into its own build:
    # `IndexError: index 9221120237041090560 is out of bounds` in the embedding's backward.
    config, cache = make_tiny_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), tmp_path / "cache"
    native = _train(config, cache, tmp_path)
    assert len(native) == 3
    assert _train(config, cache, tmp_path, ATEN_CPU_CAPABILITY="avx2") == native
    assert len(list(cache.iterdir())) == 2
