"""Hugging Face run_clm command lines (`train_clm.py`) -> the one training config and trainer.

The oracles are the other tools' own code: transformers' `get_scheduler` for the learning-rate
schedules, `datasets` + transformers' GPT-2 tokenizer for run_clm's validation blocks, and
transformers' `GPT2LMHeadModel` (opened with `from_pretrained` from the run's --output_dir) for the
eval loss the run prints.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.run_clm import FLAGS, SCHEDULERS, parse_args, translate
from gpt2forge.text.corpus import pydoc_topics, stdlib_root
from gpt2forge.text.tokenizer import asset_dir
from gpt2forge.train.config import TrainConfig
from gpt2forge.train.schedule import build_run_schedule

transformers = pytest.importorskip("transformers", reason="transformers is the oracle of these tests")
datasets = pytest.importorskip("datasets", reason="datasets reads run_clm's data")

REPO = Path(__file__).resolve().parents[2]
TINY = {"vocab_size": 50257, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}
"""A 2-layer GPT-2 without dropout (so one process and two replicas compute the same updates)."""


@pytest.fixture(scope="module")
def clm_files(tmp_path_factory) -> dict[str, Path]:
    """A tiny Hugging Face GPT-2 folder (save_pretrained) and .txt training/validation text."""
    root = tmp_path_factory.mktemp("clm")
    model_dir = root / "tiny-gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY)).save_pretrained(model_dir)
    transformers.GPT2TokenizerFast.from_pretrained(str(asset_dir())).save_pretrained(model_dir)
    lines = [line for topic in pydoc_topics(stdlib_root())[:40] for line in topic.splitlines()]
    (root / "train.txt").write_text("\n".join(lines[:1500]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[1500:1900]) + "\n")
    return {"model": model_dir, "train": root / "train.txt", "valid": root / "valid.txt"}


def _argv(files: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--model_name_or_path", str(files["model"]), "--train_file", str(files["train"]), "--validation_file",
            str(files["valid"]), "--block_size", "32", "--per_device_train_batch_size", "2", "--max_train_steps",
            "3", "--learning_rate", "1e-3", "--seed", "0", "--output_dir", str(out), *extra]


def _eval_line(text: str) -> tuple[float, float]:
    found = re.findall(r"epoch (\d+): perplexity: (\S+) eval_loss: (\S+)", text)
    assert len(found) == 1, text[-2000:]
    return float(found[0][1]), float(found[0][2])


def run_clm_blocks(tokenizer, path: Path, block_size: int) -> torch.Tensor:
    """The validation blocks as run_clm_no_trainer.py makes them: `datasets` reads the .txt (one
    record per line, line breaks kept), the tokenizer encodes each record, and every batch of 1,000
    records is concatenated and cut into blocks (the remainder dropped)."""
    raw = datasets.load_dataset("text", data_files={"validation": str(path)}, keep_linebreaks=True)["validation"]
    ids = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

    def group(batch):
        joined = sum(batch["input_ids"], [])
        n = len(joined) // block_size * block_size
        return {"input_ids": [joined[i:i + block_size] for i in range(0, n, block_size)]}

    blocks = ids.map(group, batched=True, remove_columns=ids.column_names)
    return torch.tensor(blocks["input_ids"])


# -- the flags ---------------------------------------------------------------------------------------------


def test_seed_002_options_become_the_same_run(clm_files, tmp_path):
    """Seed 002's OPTIONS block (model and dataset swapped for local ones; --dataset_name of a local
    save_to_disk folder is the data reader's test), with its K-FAC lines switched on."""
    argv = shlex_split(f"""--low_cpu_mem_usage --train_file {clm_files['train']}
        --model_name_or_path {clm_files['model']} --output_dir {tmp_path / 'run'} --checkpointing_steps 1000
        --resume_from_checkpoint --max_train_steps 10000 --per_device_train_batch_size 1
        --per_device_eval_batch_size 1 --gradient_accumulation_steps 8 --mixed_precision fp16
        --kfac --kfac-factor-update-steps 5 --kfac-inv-update-steps 50""")
    cfg = parse_args(argv, world_size=4)
    assert (cfg.parallel.batch_size, cfg.parallel.gradient_accumulation, cfg.parallel.replication_factor) == (1, 8, 4)
    assert cfg.optim.training_steps == 10000 and cfg.optim.learning_rate == 5e-5 and cfg.optim.weight_decay == 0.0
    assert (cfg.optim.lr_schedule, cfg.optim.lr_warmup_steps, cfg.optim.min_lr) == ("linear", 0, 0.0)
    assert cfg.optim.max_grad_norm is None  # run_clm_no_trainer does not clip
    assert (cfg.runtime.precision, cfg.loss_scale.auto_loss_scaling, cfg.loss_scale.initial_loss_scale) == \
        ("fp16", True, 65536.0)
    assert cfg.checkpoint.checkpoint_input_dir == str(clm_files["model"])
    assert cfg.checkpoint.checkpoint_output_dir == str(tmp_path / "run") and cfg.checkpoint.auto_resume
    assert (cfg.checkpoint.save_per_steps, cfg.checkpoint.save_per_epochs) == (1000, 0)
    assert cfg.checkpoint.final_model_dir == str(tmp_path / "run")
    assert (cfg.kfac.kfac, cfg.kfac.kfac_factor_update_steps, cfg.kfac.kfac_inv_update_steps) == (True, 5, 50)
    assert cfg.data.dataset == "hf" and cfg.data.input_files == [str(clm_files["train"])]
    assert cfg.arch.max_len == 64  # the model's positions (run_clm: at most 1024)
    assert cfg.logging.log_format == "run_clm"


def shlex_split(text: str) -> list[str]:
    import shlex
    return shlex.split(text)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedules_equal_transformers_get_scheduler(name, clm_files):
    cfg = parse_args(["--train_file", str(clm_files["train"]), "--lr_scheduler_type", name, "--num_warmup_steps",
                      "3", "--learning_rate", "0.01"], world_size=1)
    ours_p, theirs_p = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    ours_opt, theirs_opt = torch.optim.AdamW([ours_p], lr=0.01), torch.optim.AdamW([theirs_p], lr=0.01)
    ours = build_run_schedule(ours_opt, cfg.optim, total_updates=20, samples_per_update=8)
    theirs = transformers.get_scheduler(name, theirs_opt, num_warmup_steps=3, num_training_steps=20)
    for update in range(20):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-9,
                                                               abs=1e-15), (name, update)
        ours_opt.step(), theirs_opt.step(), ours.step(), theirs.step()


def test_defaults_and_renames(clm_files, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch --mixed_precision` sets
    values = translate(["--train_file", str(clm_files["train"]), "--validation_split_percentage", "10",
                        "--no_keep_linebreaks", "--preprocessing_num_workers", "2", "--overwrite_cache", "True",
                        "--with_tracking", "--report_to", "tensorboard", "--output_dir", "out", "--block_size", "128",
                        "--checkpointing_steps", "epoch"], world_size=1)
    cfg = TrainConfig.from_flat(values)
    assert (cfg.optim.epochs, cfg.parallel.batch_size, cfg.optim.learning_rate) == (3, 8, 5e-5)
    assert cfg.runtime.precision == "bf16"
    assert (cfg.data.validation_split_percentage, cfg.data.keep_linebreaks, cfg.data.preprocessing_workers,
            cfg.data.overwrite_cache) == (10, False, 2, True)
    assert cfg.logging.tensorboard_dir == str(Path("out") / "clm_no_trainer") and not cfg.logging.use_wandb
    assert cfg.arch.max_len == 128 and cfg.arch.model == "gpt2"  # a new GPT-2 small, as --model_type gpt2
    assert cfg.arch.max_position_embeddings == 1024  # GPT2Config()'s
    assert (cfg.checkpoint.save_per_epochs, cfg.checkpoint.save_per_steps) == (1, None)


def test_every_refused_flag_is_one_line(clm_files):
    refused = [row.names[0] for row in FLAGS if type(row.target).__name__ == "Refused"]
    assert {"--push_to_hub", "--trust_remote_code", "--streaming"} <= set(refused)
    for name in refused:
        with pytest.raises(UsageError, match=re.escape(name)) as err:
            translate(["--train_file", str(clm_files["train"]), name], world_size=1)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv, message", [
    ([], "Need either a dataset name or a training file"),
    (["--train_file", "x.parquet"], r"--train_file x.parquet: should be a \.txt"),
    (["--train_file", "x.txt", "--model_type", "gpt_neo"], "--model_type gpt_neo: this trainer builds GPT-2"),
    (["--train_file", "x.txt", "--lr_scheduler_type", "inverse_sqrt"], "--lr_scheduler_type inverse_sqrt"),
    (["--train_file", "x.txt", "--mixed_precision", "fp8"], "--mixed_precision fp8"),
    (["--train_file", "x.txt", "--checkpointing_steps", "often"], "--checkpointing_steps often"),
    (["--train_file", "x.txt", "--with_tracking", "--report_to", "comet_ml"], "--report_to comet_ml"),
    (["--train_file", "x.txt", "--model_name_or_path", "no-such-org/no-such-model"],
     "not in the local Hugging Face cache"),
    (["--train_file", "x.txt", "--fp16"], "unrecognized arguments"),
])
def test_bad_flags_are_one_line(argv, message):
    with pytest.raises(UsageError, match=message) as err:
        translate(argv, world_size=1)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_errors_from_below_the_front_end_name_run_clms_flags(tmp_path, capsys):
    # `--dataset_name wikitext` not cached here used to say `pass --input-files DIR`, which train_clm.py refuses.
    from gpt2forge.cli import clm_main

    argv = ["--dataset_name", "gpt2forge-no-such-set", "--dataset_config_name", "raw", "--model_type", "gpt2"]
    assert clm_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --dataset_name gpt2forge-no-such-set: not a local path")
    assert "pass --dataset_name DIR" in err and "--input-files" not in err
    assert clm_main(["--train_file", str(tmp_path / "none.txt"), "--model_type", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert f"--train_file {tmp_path / 'none.txt'}: no such file (--train_file reads" in err and "--dataset" not in err


def test_other_models_and_accelerate_state_are_refused(tmp_path, clm_files):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UsageError, match="llama/config.json: model_type 'llama'; this trainer trains GPT-2 "
                                         r"\(gpt2\) and GPT-Neo \(gpt_neo\)"):
        translate(["--train_file", str(clm_files["train"]), "--model_name_or_path", str(llama)], world_size=1)
    saved = tmp_path / "step_100"
    saved.mkdir()
    (saved / "random_states_0.pkl").write_bytes(b"\x80\x04N.")
    with pytest.raises(UsageError, match="accelerate save_state folder"):
        translate(["--train_file", str(clm_files["train"]), "--resume_from_checkpoint", str(saved)], world_size=1)


# -- runs ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process_run(clm_files, tmp_path_factory) -> tuple[Path, str]:
    """(--output_dir, printed lines) of a 3-update run_clm run in this process, checkpointing every 2."""
    from gpt2forge.cli import clm_main

    out = tmp_path_factory.mktemp("one") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert clm_main(_argv(clm_files, out, "--checkpointing_steps", "2")) == 0
    return out, printed.getvalue()


@pytest.mark.slow
def test_run_prints_run_clm_eval_and_leaves_what_transformers_opens(clm_files, one_process_run, capsys):
    from gpt2forge.cli import clm_main

    out, text = one_process_run
    perplexity, eval_loss = _eval_line(text)
    assert perplexity == pytest.approx(math.exp(eval_loss), rel=1e-12)
    assert (out / "step_2" / "training_state.pt").is_file() and not (out / "epoch_1").exists()
    assert json.loads((out / "all_results.json").read_text())["perplexity"] == pytest.approx(perplexity, rel=1e-9)

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    blocks = run_clm_blocks(tokenizer, clm_files["valid"], 32)
    assert len(blocks) >= 8
    with torch.no_grad():
        theirs = float(model(input_ids=blocks, labels=blocks).loss)  # every block as long: the mean over blocks
    assert eval_loss == pytest.approx(theirs, abs=2e-5)

    # bare --resume_from_checkpoint: the newest checkpoint of --output_dir (step_3, the run's end) goes on
    assert clm_main(_argv(clm_files, out, "--max_train_steps", "4", "--resume_from_checkpoint")) == 0
    resumed = capsys.readouterr().out
    assert f"continuing from {out / 'step_3'}" in resumed and "resumed from" in resumed
    assert resumed.count(" of epoch ") == 1  # one more update: the fourth


@pytest.mark.slow
def test_torchrun_two_replicas_equal_one_process(clm_files, one_process_run, tmp_path):
    """Seed 002 launches with torchrun: 2 processes x 1 sequence give one process's 2-sequence updates."""
    _, one = _eval_line(one_process_run[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(REPO / "train_clm.py"), *_argv(clm_files, tmp_path / "two", "--per_device_train_batch_size", "1")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    _, two = _eval_line(done.stdout)
    assert two == pytest.approx(one, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("processes", ["1", "2"])
def test_accelerate_launch_runs_it_with_its_precision(clm_files, tmp_path, processes):
    """Under `accelerate launch` the script starts and takes the launcher's precision (the run itself
    is the one process's run above: --print-equivalent stops before training). Without GPUs,
    `--num_processes 2` starts one process: that is said in one line (issue 46 item 10), not silent."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", processes,
           "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no", str(REPO / "train_clm.py"),
           *_argv(clm_files, tmp_path / "acc", "--max_train_steps", "1"), "--print-equivalent"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--precision bf16" in done.stdout, done.stdout
    alone = "notice: accelerate launch started one process here (without GPUs its --num_processes N starts one"
    assert (alone in done.stderr) == (processes == "2"), done.stderr[-3000:]


def test_docs_show_every_flag():
    from gpt2forge.frontends.run_clm import FRONT_END

    text = (REPO / "docs" / "run_clm.md").read_text()
    missing = [line for line in FRONT_END.flag_table("run_clm") if line not in text]
    assert not missing, "docs/run_clm.md is behind; paste:\n" + "\n".join(FRONT_END.flag_table("run_clm"))


@pytest.mark.slow
def test_seed_002_wikitext_job_on_a_local_datasets_copy(eval_data, clm_files, tmp_path, capsys):
    """docs/run_clm.md's worked example: the WikiText test articles saved as a local `datasets`
    dataset, seed 002's OPTIONS as written but for the model (the tiny one), the run's length and the
    precision (this CPU emulates fp16 matmuls)."""
    from gpt2forge.cli import clm_main

    raw = datasets.load_dataset("text", data_files={"train": str(eval_data / "wikitext" / "wiki.test.raw")},
                                keep_linebreaks=True, cache_dir=str(tmp_path / "hf-cache"))
    raw.save_to_disk(str(tmp_path / "wikitext"))
    options = shlex_split(f"""--low_cpu_mem_usage --dataset_name {tmp_path / 'wikitext'}
        --model_name_or_path {clm_files['model']} --output_dir {tmp_path / 'run'} --checkpointing_steps 1000
        --resume_from_checkpoint --max_train_steps 10000 --per_device_train_batch_size 1
        --per_device_eval_batch_size 1 --gradient_accumulation_steps 8 --mixed_precision fp16
        --kfac --kfac-factor-update-steps 5 --kfac-inv-update-steps 50""")
    assert clm_main([*options, "--max_train_steps", "2", "--mixed_precision", "no"]) == 0
    text = capsys.readouterr().out
    assert "train 4140 records" in text and "validation 218 records" in text  # 5% of 4,358 lines validate
    _eval_line(text)
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "step_2").is_dir()


@pytest.mark.slow
def test_seed_002_trains_a_local_gpt_neo_folder(clm_files, tmp_path, capsys):
    """Seed 002's model family: a tiny GPT-Neo folder (save_pretrained; a local layer whose window, 8, is
    shorter than the 32-token blocks) trains with K-FAC on its nn.Linear layers, and the folder the run
    leaves opens in transformers' GPTNeoForCausalLM with our logits."""
    from gpt2forge.cli import clm_main
    from gpt2forge.model.checkpoint import load_model

    neo = tmp_path / "tiny-gpt-neo"
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(vocab_size=50257, max_position_embeddings=64, hidden_size=32, num_layers=2,
                                       num_heads=2, attention_types=[[["global", "local"], 1]], window_size=8)
    start = transformers.GPTNeoForCausalLM(config).eval()
    start.save_pretrained(neo)
    argv = _argv(clm_files, tmp_path / "run", "--max_train_steps", "2", "--kfac", "--kfac-factor-update-steps", "1",
                 "--kfac-inv-update-steps", "1")
    argv[argv.index(str(clm_files["model"]))] = str(neo)
    assert clm_main(argv) == 0
    text = capsys.readouterr().out
    assert text.count(" of epoch ") == 2
    _eval_line(text)
    trained = transformers.GPTNeoForCausalLM.from_pretrained(tmp_path / "run").eval()
    assert trained.config.attention_layers == ["global", "local"] and trained.config.window_size == 8
    ours = load_model(tmp_path / "run").eval()
    assert ours.transformer.h["1"].attn.window == 8 and ours.transformer.h["1"].attn.c_attn.bias is None
    x = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = trained(x).logits
        torch.testing.assert_close(ours(x)[..., :50257], theirs, rtol=1e-5, atol=1e-5)
        assert (start(x).logits - theirs).abs().max() > 1e-4  # the weights did change


def test_config_name_of_a_gpt_neo_folder_builds_a_new_gpt_neo(clm_files, tmp_path):
    """--config_name with a GPT-Neo folder: a new model of its shape, its position table
    (max_position_embeddings, GPT-Neo's name for n_positions) and block size."""
    neo = tmp_path / "neo-config"
    transformers.GPTNeoConfig(max_position_embeddings=48, hidden_size=32, num_layers=2, num_heads=2,
                              attention_types=[[["global", "local"], 1]], window_size=8).save_pretrained(neo)
    cfg = parse_args(["--train_file", str(clm_files["train"]), "--config_name", str(neo)])
    assert cfg.arch.max_position_embeddings == 48 and cfg.arch.max_len == 48
    model_config = cfg.model_source().config
    assert model_config.model_type == "gpt_neo" and model_config.attention_layers == ["global", "local"]
    assert model_config.n_positions == 48 and model_config.window_size == 8
