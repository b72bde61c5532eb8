"""Seed 002: GPT pretraining with Hugging Face's run_clm_no_trainer (llm-pytorch's `llm.trainers.gpt`,
GPT-Neo 125M on WikiText, K-FAC optional). Its command lines run here with `train_clm.py` in place of
`-m llm.trainers.gpt` (docs/run_clm.md), as written otherwise.

The seed's names are local here: the runs start in a folder that holds `wikitext/` (a clone of the hub
dataset's layout: README configs and parquet files, so `--dataset_config_name wikitext-2-raw-v1` picks
it) and `EleutherAI/gpt-neo-125m/` (a 32-wide GPT-Neo written by transformers' save_pretrained), so
`--dataset_name wikitext --model_name_or_path EleutherAI/gpt-neo-125m` name them as written. Sizes
shrink by flags after the seed's (`--max_train_steps 2`). Not run here: the PBS job script itself (its
node file, `mpiexec` and rendezvous run on namespaced nodes in tests/cluster/test_launch_styles.py),
`module load`, `qsub` and `pip install`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2forge.cli import clm_main

transformers = pytest.importorskip("transformers", reason="writes the GPT-Neo folder")
datasets = pytest.importorskip("datasets", reason="run_clm's data comes through datasets")

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step \d+ of epoch \d+, loss: \S+, acc: \S+, lr: \S+, throughput: \S+ samples/sec", re.M)
EVAL = re.compile(r"^epoch \d+: perplexity: \S+ eval_loss: \S+$", re.M)

OPTIONS = ("--low_cpu_mem_usage --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 "
           "--model_name_or_path EleutherAI/gpt-neo-125m --output_dir runs/gpt-neo-125m-pretraining "
           "--checkpointing_steps 1000 --resume_from_checkpoint --max_train_steps 10000 "
           "--per_device_train_batch_size 1 --per_device_eval_batch_size 1 --gradient_accumulation_steps 8 "
           "--mixed_precision fp16 ")
"""pretrain.pbs's OPTIONS, line by line."""
KFAC = "--kfac --kfac-factor-update-steps 5 --kfac-inv-update-steps 50"
"""Its commented-out K-FAC lines."""
SHRINK = ["--max_train_steps", "2", "--checkpointing_steps", "1", "--gradient_accumulation_steps", "2"]

README = """---
configs:
- config_name: wikitext-2-raw-v1
  data_files:
  - split: train
    path: wikitext-2-raw-v1/train-*
  - split: validation
    path: wikitext-2-raw-v1/validation-*
---
"""


@pytest.fixture(scope="module")
def seed_folder(tmp_path_factory) -> Path:
    """The folder the seed's job runs in (module docstring)."""
    import torch

    root = tmp_path_factory.mktemp("seed_002")
    wikitext = root / "wikitext"
    (wikitext / "wikitext-2-raw-v1").mkdir(parents=True)
    (wikitext / "README.md").write_text(README)
    lines = [f" = Section {i} = \n" if i % 10 == 0 else f" The river {i} runs past the town , and its banks "
             f"hold {i % 7} mills that grind the grain of the valley . \n" for i in range(400)]
    for split, part in (("train", lines[:360]), ("validation", lines[360:])):
        datasets.Dataset.from_dict({"text": part}).to_parquet(
            str(wikitext / "wikitext-2-raw-v1" / f"{split}-00000-of-00001.parquet"))
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(vocab_size=50257, max_position_embeddings=64, hidden_size=32, num_layers=2,
                                       num_heads=2, attention_types=[[["global", "local"], 1]], window_size=16)
    transformers.GPTNeoForCausalLM(config).save_pretrained(root / "EleutherAI" / "gpt-neo-125m")
    return root


def test_help_of_the_trainer():
    """`python -m llm.trainers.gpt --help`."""
    with pytest.raises(SystemExit) as exc:
        clm_main(["--help"])
    assert exc.value.code == 0


@pytest.mark.slow
def test_options_block_runs_and_resumes(seed_folder, monkeypatch, capsys):
    """pretrain.pbs's OPTIONS in one process (fp16 as written); launched again, the same line continues
    from the newest checkpoint in --output_dir (--resume_from_checkpoint bare)."""
    monkeypatch.chdir(seed_folder)
    out = seed_folder / "runs" / "gpt-neo-125m-pretraining"
    assert clm_main([*shlex.split(OPTIONS), *SHRINK]) == 0
    text = capsys.readouterr().out
    assert len(STEP.findall(text)) == 2 and len(EVAL.findall(text)) == 1, text[-3000:]
    assert (out / "step_2").is_dir() and (out / "model.safetensors").is_file()
    assert transformers.GPTNeoForCausalLM.from_pretrained(out).config.window_size == 16
    assert clm_main([*shlex.split(OPTIONS), *SHRINK, "--max_train_steps", "3"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"continuing from \S*runs/gpt-neo-125m-pretraining/step_2\b", text), text[-3000:]
    assert len(STEP.findall(text)) == 1


def test_kfac_lines_switch_kfac_on(seed_folder, monkeypatch):
    from gpt2forge.frontends.run_clm import parse_args

    monkeypatch.chdir(seed_folder)
    cfg = parse_args([*shlex.split(OPTIONS + KFAC)], world_size=1)
    assert (cfg.kfac.kfac, cfg.kfac.kfac_factor_update_steps, cfg.kfac.kfac_inv_update_steps) == (True, 5, 50)
    assert (cfg.parallel.batch_size, cfg.parallel.gradient_accumulation, cfg.runtime.precision) == (1, 8, "fp16")


@pytest.mark.slow
def test_torchrun_launcher_line(seed_folder, tmp_path):
    """`torchrun --nnodes=1 --nproc_per_node=auto --standalone -m llm.trainers.gpt {options}` (auto: one
    process per CPU core without GPUs; 2 where the machine has more than 4 cores), in fp32 (the CPU
    emulates fp16 matmuls; the options block above runs fp16)."""
    nproc = "auto" if (os.cpu_count() or 1) <= 4 else "2"
    out = tmp_path / "run"
    argv = [*shlex.split(OPTIONS), *SHRINK, "--output_dir", str(out), "--max_train_steps", "1", "--mixed_precision",
            "no"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
                           "--max_restarts", "0", "--standalone", str(ROOT / "train_clm.py"), *argv],
                          cwd=seed_folder, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(STEP.findall(proc.stdout)) == 1 and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("names,message", [
    ("--dataset_name EleutherAI/pile --dataset_config_name all",
     "--dataset_name EleutherAI/pile: not a local path, and not in the local datasets cache"),
    ("--dataset_name NeelNanda/pile-10k", "--dataset_name NeelNanda/pile-10k: not a local path"),
    ("--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --model_name_or_path EleutherAI/gpt-neo-1.3B",
     "--model_name_or_path EleutherAI/gpt-neo-1.3B: no such folder, and not in the local Hugging Face cache"),
    ("--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --model_name_or_path EleutherAI/gpt-neox-20b",
     "--model_name_or_path EleutherAI/gpt-neox-20b: no such folder"),
    ("--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --model_name_or_path gpt2",
     "--model_name_or_path gpt2: no such folder"),
])
def test_hub_names_without_a_local_copy_are_one_line(names, message, seed_folder, tmp_path, monkeypatch, capsys):
    """The seed's other datasets and models (its "Customize Pretraining"), on a machine whose caches are
    empty: one line saying how to get a local copy, exit 2."""
    import huggingface_hub

    monkeypatch.chdir(seed_folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    model = [] if "--model_name_or_path" in names else ["--model_name_or_path", "EleutherAI/gpt-neo-125m"]
    assert clm_main([*shlex.split(names), *model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
