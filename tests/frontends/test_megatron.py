"""Megatron-LM command lines (`pretrain_gpt.py`, `pretrain_gpt2.py`) -> the one training config.

The seed scripts' flag blocks are copied here as written, with only the data and vocabulary paths
swapped for test files; seed 000 is Megatron-DeepSpeed's README, seed 001 Megatron-LM's older one.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.megatron import FLAGS, build_parser, equivalent_command, parse_args, translate
from gpt2forge.text.tokenizer import asset_dir

SEED_000_GPT_ARGS = """
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
    --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --lr 0.00015
    --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE --lr-warmup-fraction .01 --fp16
"""
SEED_000_OUTPUT_ARGS = ("--log-interval 10 --save-interval 500 --eval-interval 100 --eval-iters 10 "
                        "--checkpoint-activations")
SEED_000_DATA_ARGS = "--save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --data-path $DATA_PATH"

SEED_001_GPT2 = """
       --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --batch-size 8 --seq-length 1024
       --max-position-embeddings 1024 --train-iters 320000 --save checkpoints/gpt2_345m
       --load checkpoints/gpt2_345m --resume-dataloader --train-data wikipedia --lazy-loader
       --tokenizer-type GPT2BPETokenizer --cache-dir cache --split 949,50,1 --distributed-backend nccl
       --lr 0.00015 --lr-decay-style cosine --weight-decay 1e-2 --clip-grad 1.0 --warmup .01
       --checkpoint-activations --fp16
"""


def seed_000_argv(tmp_path: Path) -> list[str]:
    text = " ".join((SEED_000_GPT_ARGS, SEED_000_OUTPUT_ARGS, SEED_000_DATA_ARGS))
    swaps = {"$VOCAB_FILE": str(asset_dir() / "vocab.json"), "$MERGE_FILE": str(asset_dir() / "merges.txt"),
             "$CHECKPOINT_PATH": str(tmp_path / "checkpoints" / "gpt2"),
             "$DATA_PATH": str(tmp_path / "my-gpt2_text_document")}
    for var, value in swaps.items():
        text = text.replace(var, value)
    return shlex.split(text)


def seed_001_argv(tmp_path: Path) -> list[str]:
    text = SEED_001_GPT2.replace("checkpoints/gpt2_345m", str(tmp_path / "gpt2_345m"))
    text = text.replace("--train-data wikipedia", f"--train-data {tmp_path / 'wikipedia.json'}")
    return shlex.split(text.replace("--cache-dir cache", f"--cache-dir {tmp_path / 'cache'}"))


def test_seed_000_gpt_args_become_the_same_run(tmp_path):
    cfg = parse_args(seed_000_argv(tmp_path), world_size=1)
    assert (cfg.arch.num_layers, cfg.arch.hidden_size, cfg.arch.num_attention_heads) == (24, 1024, 16)
    assert cfg.arch.max_len == 1024 and cfg.arch.max_position_embeddings == 1024
    # global 8 = micro 4 x accumulation 2 x 1 data-parallel replica
    assert (cfg.parallel.batch_size, cfg.parallel.gradient_accumulation, cfg.parallel.replication_factor) == (4, 2, 1)
    assert cfg.parallel.device_iterations == 1 and cfg.samples_per_update == 8
    o = cfg.optim
    assert (o.learning_rate, o.training_steps, o.lr_decay_steps, o.lr_schedule, o.lr_warmup) == \
        (0.00015, 500000, 320000, "cosine", 0.01)
    assert (o.optimizer, o.weight_decay, o.max_grad_norm, o.adam_eps, o.min_lr) == ("AdamW", 0.01, 1.0, 1e-8, 0.0)
    r = cfg.loss_scale
    assert (cfg.runtime.precision, r.auto_loss_scaling, r.initial_loss_scale, r.loss_scale_window,
            r.loss_scale_hysteresis) == ("fp16", True, 2.0 ** 32, 1000, 2)
    assert cfg.memory.recompute_checkpoint_every_layer
    assert (cfg.logging.log_steps, cfg.logging.log_format) == (10, "megatron")
    assert (cfg.eval.eval_every_steps, cfg.eval.eval_iters, cfg.checkpoint.save_per_steps) == (100, 10, 500)
    assert cfg.data.dataset == "mmap" and cfg.data.input_files == [str(tmp_path / "my-gpt2_text_document")]
    assert cfg.data.split == "969,30,1" and cfg.data.seed == 1234
    # --load = --save: continue from the latest checkpoint there when there is one
    assert cfg.checkpoint.checkpoint_output_dir == str(tmp_path / "checkpoints" / "gpt2") and cfg.checkpoint.auto_resume


def test_seed_001_pretrain_gpt2_flags_become_the_same_run(tmp_path):
    cfg = parse_args(seed_001_argv(tmp_path), world_size=1)
    assert cfg.parallel.batch_size == 8 and cfg.parallel.gradient_accumulation == 1
    assert cfg.data.dataset == "jsonl" and cfg.data.input_files == [str(tmp_path / "wikipedia.json")]
    assert cfg.data.split == "949,50,1" and cfg.data.data_cache_dir == str(tmp_path / "cache")
    assert (cfg.optim.lr_warmup, cfg.optim.weight_decay, cfg.optim.max_grad_norm) == (0.01, 0.01, 1.0)
    assert cfg.runtime.precision == "fp16" and cfg.memory.recompute_checkpoint_every_layer


def test_megatron_defaults_apply_when_a_flag_is_left_out():
    cfg = parse_args(["--micro-batch-size", "2", "--train-iters", "10", "--data-path", "x"], world_size=1)
    o = cfg.optim
    assert (o.lr_schedule, o.lr_warmup, o.weight_decay, o.max_grad_norm) == ("linear", 0.0, 0.01, 1.0)
    assert cfg.logging.log_steps == 100 and cfg.eval.eval_iters == 100 and cfg.runtime.precision == "auto"


def test_global_batch_over_data_parallel_replicas_and_pipeline_stages():
    argv = ["--micro-batch-size", "2", "--global-batch-size", "16", "--num-layers", "4", "--data-path", "x"]
    cfg = parse_args(argv + ["--pipeline-model-parallel-size", "2"], world_size=4)
    # 4 processes = 2 stages x 2 replicas; 16 = 2 x accumulation 4 x 2 replicas
    assert cfg.parallel.replication_factor == 2 and cfg.parallel.gradient_accumulation == 4
    assert cfg.parallel.layers_per_ipu == [2, 2] and cfg.parallel.ipus_per_replica == 2
    with pytest.raises(UsageError, match=r"global batch size \(16\) is not divisible by micro batch size \(2\) "
                                         r"times data parallel size \(3\)"):
        translate(argv, world_size=3)


@pytest.mark.parametrize("argv, message", [
    (["--tensor-model-parallel-size", "2"], "world size (1) is not divisible by tensor model parallel size (2) "
                                             "times pipeline model parallel size (1)"),
    (["--no-save-optim"], "--no-save-optim: checkpoints always hold the optimizer"),
    (["--optimizer", "sgd"], "--optimizer sgd: only adam"),
    (["--optimizer", "muon"], "--optimizer muon: Megatron's Muon (q, k and v orthogonalized apart"),
    (["--no-load-optim"], "--no-load-optim without --finetune"),
    (["--data-impl", "lazy"], "--data-impl lazy: only the mmap format"),
    (["--tokenizer-type", "BertWordPieceLowerCase"], "--tokenizer-type BertWordPieceLowerCase"),
    (["--lr-decay-style", "inverse-square-root"], "inverse-square-root"),
    (["--vocab-file", "v.json"], "--vocab-file needs its partner"),
    (["--num-experts", "8"], "unrecognized arguments: --num-experts 8; pretrain_gpt.py takes the Megatron-LM flags"),
])
def test_flags_without_a_meaning_here_are_one_line_errors(argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        translate(["--micro-batch-size", "1", "--data-path", "x", *argv], world_size=1)


def test_mock_data_trains_on_generated_tokens_and_bad_values_name_the_flag():
    values = translate(["--micro-batch-size", "2", "--mock-data"], world_size=1)
    assert values["dataset"] == "generated" and "input_files" not in values
    # no epoch checkpoints, as in Megatron: --train-iters 99999999999 on the short mock epochs once wrote one
    # checkpoint per epoch until the disk was full
    assert values["save_per_epochs"] == 0
    with pytest.raises(UsageError, match="--learning-rate nan: not a finite number"):
        parse_args(["--micro-batch-size", "2", "--mock-data", "--lr", "nan"])


def test_tensor_parallel_size_divides_the_world_into_replicas():
    # 8 processes = 2 replicas x (2 stages x 2 tensor-parallel ranks); seed 001's --model-parallel-size too
    argv = ["--micro-batch-size", "1", "--global-batch-size", "4", "--num-layers", "4", "--data-path", "x",
            "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    values = translate([*argv, "--model-parallel-size", "2"], world_size=8)
    assert (values["tensor_model_parallel_size"], values["replication_factor"], values["gradient_accumulation"]) == \
        (2, 2, 2)
    assert values["sequence_parallel"] is True
    # Megatron turns sequence parallelism off at tensor-parallel size 1
    assert "sequence_parallel" not in translate(argv, world_size=8)


def test_finetune_starts_from_the_weights_of_load(tmp_path):
    values = translate(["--micro-batch-size", "1", "--data-path", "x", "--load", str(tmp_path), "--finetune",
                        "--no-load-optim", "--no-load-rng"], world_size=1)
    assert values["checkpoint_input_dir"] == str(tmp_path) and "resume_training_from_checkpoint" not in values


def test_help_groups_the_flags_as_megatron_does():
    text = build_parser().format_help()
    positions = [text.index(f"\n{group}:") for group in ("model", "regularization", "training", "learning rate",
                                                          "checkpointing", "mixed precision", "distributed",
                                                          "validation", "data and dataloader", "logging")]
    assert positions == sorted(positions)
    assert "(train_gpt2.py --learning-rate)" in text and "refused here:" in text
    assert len({name for row in FLAGS for name in row.names}) == sum(len(row.names) for row in FLAGS)


def test_equivalent_command_parses_to_the_same_config(tmp_path):
    from gpt2forge.frontends.graphcore import parse_args as our_parse_args  # the other front end, compared here

    values = translate(seed_000_argv(tmp_path), world_size=1)
    assert our_parse_args(equivalent_command(values)) == parse_args(seed_000_argv(tmp_path), world_size=1)


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "3", "--log-interval", "1",
        "--eval-interval", "3", "--eval-iters", "1", "--save-interval", "3", "--num-workers", "0"]
"""Appended after a seed's flags (the last value wins, as in Megatron's argparse): a model and run
small enough for the test suite; every other flag is the seed's as written."""


def _step_lines(text: str) -> list[str]:
    """The Megatron lines without their time stamp and elapsed time."""
    lines = [line for line in text.splitlines() if "| lm loss:" in line]
    return [line.split("] ", 1)[-1].split(" elapsed time")[0] + line.split("|", 3)[-1] for line in lines]


def _corpus(tmp_path: Path) -> None:
    import json

    import numpy as np

    from gpt2forge.data.indexed import IndexedWriter
    from gpt2forge.text.tokenizer import load_tokenizer

    rng = np.random.default_rng(0)
    with IndexedWriter(tmp_path / "my-gpt2_text_document", np.uint16) as w:
        for _ in range(200):
            w.add_document(np.array([*rng.integers(0, 50000, int(rng.integers(20, 120))), 50256], dtype=np.int64))
    tok = load_tokenizer()
    words = [tok.decode([int(t)]) for t in rng.integers(0, 50000, 4000)]
    with open(tmp_path / "wikipedia.json", "w") as f:
        for i in range(0, 4000, 40):
            f.write(json.dumps({"text": "".join(words[i:i + 40])}) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("seed, extra, samples", [("000", ["--global-batch-size", "2"], 6),
                                                   ("001", ["--batch-size", "1"], 3)])
def test_seed_scripts_run_and_equal_the_same_run_in_our_flags(tmp_path, capsys, seed, extra, samples):
    from gpt2forge.cli import megatron_main, train_main  # the two front ends compared

    _corpus(tmp_path)
    argv_of = {"000": seed_000_argv, "001": seed_001_argv}[seed]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        for name in ("my-gpt2_text_document.bin", "my-gpt2_text_document.idx", "wikipedia.json"):
            (tmp_path / d / name).symlink_to(tmp_path / name)
    assert megatron_main([*argv_of(tmp_path / "a"), *TINY, *extra]) == 0
    theirs = capsys.readouterr().out
    ours_argv = equivalent_command(translate([*argv_of(tmp_path / "b"), *TINY, *extra], world_size=1))
    assert train_main(ours_argv) == 0
    ours = capsys.readouterr().out
    assert len(_step_lines(theirs)) == 3 and _step_lines(theirs) == _step_lines(ours)
    assert "validation loss at iteration 3 | lm loss value:" in theirs
    assert f" iteration {3:8d}/{3:8d} | consumed samples: {samples:12d} |" in theirs  # Megatron's widths


def test_errors_from_below_the_front_end_name_megatrons_flags(tmp_path, capsys):
    # Seed 001's `--train-data wikipedia` used to end in `--input-files wikipedia: no such file`, a flag
    # pretrain_gpt2.py does not take.
    from gpt2forge.cli import megatron_main
    from gpt2forge.frontends.flag_table import in_own_words
    from gpt2forge.frontends.megatron import FRONT_END

    missing = str(tmp_path / "wikipedia")
    assert megatron_main([*TINY, "--train-data", missing]) == 2
    err = capsys.readouterr().err
    assert f"error: --train-data {missing}: no such file (--train-data reads files" in err and "--input" not in err
    words = FRONT_END.own_words(["--batch-size", "1", "--mock-data"])  # the spelling typed wins
    assert in_own_words("lower --learning-rate, clip with --max-grad-norm; reduce --batch-size, "
                        "--gradient-accumulation or --device-iterations (--dataset generated)", words) == \
        "lower --lr, clip with --clip-grad; reduce --batch-size, --global-batch-size or --device-iterations " \
        "(--mock-data)"
    assert FRONT_END.own_words(["--data-path", "x"])["--batch-size"] == "--micro-batch-size"


def test_max_nonfinite_updates_is_taken_as_in_train_gpt2():
    values = translate(["--micro-batch-size", "1", "--mock-data", "--max-nonfinite-updates", "3"], world_size=1)
    assert values["max_nonfinite_updates"] == 3


@pytest.mark.slow
def test_fp16_run_gets_past_the_skipped_iterations_of_a_scale_from_2_to_the_32(capsys):
    # Seeds 000 and 001 train with --fp16: Megatron's scale starts at 2^32 and halves on every second
    # overflow, so the first ~17 iterations are skipped (lr held, as Megatron holds it); the run used
    # to stop at iteration 10 ("10 updates in a row had non-finite gradients").
    from gpt2forge.cli import megatron_main

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "21", "--log-interval",
            "1", "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0", "--mock-data", "--fp16",
            "--lr", "1e-3"]
    assert megatron_main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "| lm loss:" in line]
    fields = [dict(part.strip().rsplit(": ", 1) for part in line.split("|")[1:-1]) for line in lines]
    assert len(fields) == 21
    skipped = [int(f["number of skipped iterations"]) for f in fields]
    k = skipped[-1]  # every skip came first, while the scale came down
    assert 10 < k < 21 and skipped == [min(i + 1, k) for i in range(21)]
    assert float(fields[0]["loss scale"]) == 2.0 ** 32 and float(fields[-1]["loss scale"]) < 2.0 ** 17
    lrs = [float(f["learning rate"]) for f in fields]
    assert lrs[:k] == [1e-3] * k and lrs[k] == pytest.approx(1e-3 * 20 / 21)  # linear decay from update 1


def test_kfac_flags_reach_the_same_config_fields():
    cfg = parse_args(["--micro-batch-size", "1", "--data-path", "x", "--kfac", "--kfac-factor-update-steps", "5",
                      "--kfac-inv-update-steps", "50", "--kfac-compute-method", "inverse"], world_size=1)
    assert (cfg.kfac.kfac, cfg.kfac.kfac_factor_update_steps, cfg.kfac.kfac_inv_update_steps,
            cfg.kfac.kfac_compute_method) == (True, 5, 50, "inverse")


@pytest.mark.slow
def test_load_with_shape_flags_that_contradict_the_checkpoint_is_one_line(tmp_path, capsys):
    # Issue 46 item 10: --load of a 2-layer checkpoint with --num-layers 3 trained the 2 layers silently.
    from gpt2forge.cli import megatron_main

    run = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "8",
           "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "1", "--log-interval", "1",
           "--eval-interval", "100", "--eval-iters", "1", "--num-workers", "0", "--mock-data",
           "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
    assert megatron_main(run) == 0
    again = [*run, "--load", str(tmp_path / "ckpt"), "--train-iters", "2"]
    assert megatron_main([*again, "--num-layers", "3", "--hidden-size", "48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --num-layers 3 contradicts the checkpoint ")
    assert "its n_layer is 2;" in err[0] and "--hidden-size 48 contradicts" in err[0] and "n_embd is 32" in err[0]
    assert megatron_main(again) == 0  # the seeds' lines: the same shape flags resume their own run
