"""Megatron-LM / Megatron-DeepSpeed command lines -> TrainConfig: `pretrain_gpt.py` and the older
`pretrain_gpt2.py` take their users' flags and run the one trainer.

`FLAGS` is the whole mapping, one `flag_table.Flag` row per Megatron flag in Megatron's `--help`
groups: a TrainConfig field, a rule (batch sizes, the precision, checkpoint loading) or `Refused`.
Megatron's defaults that differ from this trainer's are applied first (`MEGATRON_DEFAULTS`), so an
omitted flag means what it means in Megatron (no warm-up, linear decay, weight decay 0.01, clip 1.0,
log every 100 iterations, ...). The global batch becomes gradient accumulation: global / (micro x
data-parallel size), where the data-parallel size is the world size over the pipeline size.
With `--deepspeed --deepspeed_config ds.json` the DeepSpeed config is applied on top
(gpt2forge.frontends.deepspeed: ds.json wins for what DeepSpeed's engine owns, the flags for the rest).
`translate(argv)` returns the flat values; `equivalent_command(values)` prints the same run in
`train_gpt2.py`'s own flags (`--print-equivalent`), which is what the tests compare against.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.deepspeed import apply_deepspeed_config
from gpt2forge.frontends.flag_table import (  # noqa: F401 -- equivalent_command, wants_equivalent: this front end's API
    KFAC_FLAGS,
    Flag,
    FrontEnd,
    Own,
    Parsed,
    Refused,
    accept,
    equivalent_command,
    switch_to,
    wants_equivalent,
)
from gpt2forge.text.tokenizer import is_gpt2_files
from gpt2forge.train.config import TrainConfig

GROUPS = ("model", "regularization", "training", "learning rate", "checkpointing", "mixed precision", "distributed",
          "validation", "data and dataloader", "logging", "DeepSpeed", "K-FAC")
"""Megatron's --help groups, in its order (Megatron-DeepSpeed's DeepSpeed flags, then gpt2forge's K-FAC)."""


@dataclasses.dataclass
class MegatronOnly:
    """Megatron's settings with no TrainConfig field of their own (`Own` rows store them); the rules
    that `translate` runs after the flags turn them into TrainConfig values."""

    global_batch: int | None = None
    """--global-batch-size (or ds.json's train_batch_size): sequences per update over all replicas."""
    pipeline: int = 1
    """--pipeline-model-parallel-size: stages, split evenly."""
    sequence_parallel: bool = False
    """--sequence-parallel: kept only with tensor parallelism, as Megatron does."""
    static_loss_scale: float | None = None
    """--loss-scale (or ds.json's fp16.loss_scale): a fixed fp16 scale; None: dynamic."""
    load: str | None = None
    """--load: the checkpoint folder to resume from, or with --finetune to take weights from."""
    finetune: bool = False
    """--finetune: --load's weights, a new optimizer, iteration 0."""
    no_load_optim: bool = False
    """--no-load-optim (only with --finetune here, which implies it)."""
    no_load_rng: bool = False
    """--no-load-rng (as --no-load-optim)."""
    vocab_file: str | None = None
    """--vocab-file: GPT-2's vocab.json, with --merge-file."""
    merge_file: str | None = None
    """--merge-file: GPT-2's merges.txt, with --vocab-file."""
    deepspeed: bool = False
    """--deepspeed: read --deepspeed_config as DeepSpeed's engine would."""
    deepspeed_config: str | None = None
    """--deepspeed_config: the ds.json file."""


# -- the rules that take more than a rename -------------------------------------------------------------


def _precision(name: str):
    def apply(_value, values: dict) -> None:
        values["precision"] = name
    return apply


def _loss_scaling(values: dict, own: MegatronOnly) -> None:
    """Megatron's fp16: dynamic scaling from --initial-loss-scale unless --loss-scale fixes the scale."""
    static = own.static_loss_scale
    if static is not None:
        values["loss_scaling"] = static
    if values.get("precision") == "fp16":
        values["auto_loss_scaling"] = static is None


def _data_path(value: list[str], values: dict) -> None:
    values["dataset"] = "mmap"
    values["input_files"] = value


def _no_alias(flag_name: str, paths: list[str]) -> None:
    """A bare name that is no file (seed 001's corpus aliases of Megatron-LM's data_utils/corpora.py:
    `--train-data wikipedia`) is one line saying what to pass instead; a file, a mmap prefix (PATH.bin) or
    anything that looks like a path goes on, to the reader's own check."""
    for path in paths:
        if not path or not (Path(path).exists() or Path(f"{path}.bin").exists() or any(c in path for c in "/.*?[")):
            raise UsageError(f"{flag_name} {path}: not a file; Megatron-LM's corpora.py aliases (wikipedia, webtext) "
                             "are not kept here: pass the loose JSON file itself (one {\"text\": ...} per line; "
                             "docs/corpus.md: python data/prepare_corpus.py --input RAW.jsonl --output-dir out/)")


def _train_data(value: list[str], values: dict) -> None:
    _no_alias("--train-data", value)
    values["dataset"] = "jsonl"  # seed 001's loose JSON, one document per line
    values["input_files"] = value


def _held_out_data(flag_name: str, field: str):
    def apply(value: list[str], values: dict) -> None:
        _no_alias(flag_name, value)
        values[field] = value
    return apply


def _data_impl(value: str, _values: dict) -> None:
    if value not in ("mmap", "infer"):
        raise UsageError(f"--data-impl {value}: only the mmap format (.bin/.idx) is read here; convert with "
                         "`python data/preprocess_data.py --dataset-impl mmap`")


def _tokenizer_type(value: str, _values: dict) -> None:
    if value not in ("GPT2BPETokenizer", "PretrainedFromHF", "HuggingFaceTokenizer"):
        raise UsageError(f"--tokenizer-type {value}: this GPT-2 trainer reads GPT2BPETokenizer or a Hugging Face "
                         "tokenizer folder (PretrainedFromHF with --tokenizer-name-or-path DIR)")


def _recompute(_value, values: dict) -> None:
    values["recompute_checkpoint_every_layer"] = True


def _recompute_granularity(value: str, values: dict) -> None:
    if value == "full":
        values["recompute_checkpoint_every_layer"] = True
    elif value != "selective":
        raise UsageError(f"--recompute-granularity {value}: full or selective")
    # selective recomputes the attention scores and softmax; attention here is fused (SDPA) and keeps
    # no probabilities, so there is nothing to recompute: Megatron does the same with flash attention.


def _tensor_parallel(value: int, values: dict) -> None:
    values["tensor_model_parallel_size"] = value


def _optimizer(value: str, values: dict) -> None:
    if value in ("muon", "dist_muon"):
        raise UsageError(f"--optimizer {value}: Megatron's Muon (q, k and v orthogonalized apart, spectral scaling, "
                         "its --muon-* flags) is not run here; train_gpt2.py --optimizer Muon runs torch.optim.Muon "
                         "on the blocks' whole matrices (docs/training.md)")
    if value != "adam":
        raise UsageError(f"--optimizer {value}: only adam (Megatron's Adam with decoupled weight decay = AdamW) is "
                         "available through pretrain_gpt.py; train_gpt2.py also has LAMB and Muon")
    values["optimizer"] = "AdamW"


def _distributed_optimizer(_value, values: dict) -> None:
    values["zero_stage"] = 1


def _decay_style(value: str, values: dict) -> None:
    if value not in ("linear", "cosine", "constant"):
        raise UsageError(f"--lr-decay-style {value}: linear, cosine or constant here (Megatron also has "
                         "inverse-square-root and WSD, not available)")
    values["lr_schedule"] = value


def _csv(text: str) -> str:
    return text.replace(" ", "")


M = Flag
FLAGS: tuple[Flag, ...] = (
    # model
    M(("--num-layers",), "model", "num_layers", "transformer blocks", int),
    M(("--hidden-size",), "model", "hidden_size", "hidden (embedding) width", int),
    M(("--num-attention-heads",), "model", "num_attention_heads", "attention heads", int),
    M(("--ffn-hidden-size",), "model", "ffn_hidden_size", "MLP width (default 4 x hidden)", int),
    M(("--seq-length",), "model", "max_len", "tokens per training sequence", int),
    M(("--max-position-embeddings",), "model", "max_position_embeddings", "position table size (>= seq length)",
      int),
    M(("--init-method-std",), "model", "init_method_std", "standard deviation of the weight initialisation", float),
    M(("--make-vocab-size-divisible-by",), "model",
      Refused("the vocabulary is padded to a multiple of 64 here, as GPT-2 checkpoints do (padded rows never get "
              "probability)"), "", int),
    M(("--fp32-residual-connection", "--apply-query-key-layer-scaling", "--openai-gelu"), "model",
      Refused("GPT-2's numerics are fixed here (exact GELU, fp32 LayerNorm and softmax statistics)"), "", None),
    # regularization
    M(("--hidden-dropout",), "regularization", "hidden_dropout", "residual and embedding dropout", float),
    M(("--attention-dropout",), "regularization", "attention_dropout", "attention-probability dropout", float),
    M(("--weight-decay",), "regularization", "weight_decay", "decoupled weight decay of the matrices", float),
    M(("--clip-grad",), "regularization", "max_grad_norm", "clip the global gradient norm", float),
    M(("--adam-beta1",), "regularization", "adam_beta1", "Adam beta1", float),
    M(("--adam-beta2",), "regularization", "adam_beta2", "Adam beta2", float),
    M(("--adam-eps",), "regularization", "adam_eps", "Adam epsilon", float),
    # training
    M(("--micro-batch-size", "--batch-size"), "training", "batch_size",
      "sequences per forward/backward (--batch-size: the old name)", int),
    M(("--global-batch-size",), "training", Own("global_batch"), "sequences per update, all replicas", int,
      stands_for=("--gradient-accumulation",)),
    M(("--train-iters",), "training", "training_steps", "updates to train", int),
    M(("--train-samples",), "training", "train_samples", "sequences to train (instead of --train-iters)", int),
    M(("--optimizer",), "training", _optimizer, "adam"),
    M(("--checkpoint-activations", "--recompute-activations"), "training", _recompute,
      "recompute every block's activations in backward", None, stands_for=("--recompute-checkpoint-every-layer",)),
    M(("--recompute-granularity",), "training", _recompute_granularity, "full | selective"),
    M(("--checkpoint-num-layers", "--recompute-num-layers"), "training", accept,
      "blocks per recomputed chunk (every block is its own chunk here)", int),
    M(("--recompute-method",), "training", accept, "uniform | block (every block is recomputed here)"),
    M(("--deterministic-mode",), "training", switch_to("deterministic", "true"),
      "deterministic algorithms: a run repeats bit for bit (on the CPU by default here)", None),
    M(("--exit-signal-handler",), "training", switch_to("exit_signal_handler"),
      "save and exit on SIGTERM (on by default here)", None),
    M(("--max-nonfinite-updates",), "training", "max_nonfinite_updates",
      "(gpt2forge's) stop after N updates in a row skipped for non-finite gradients; an fp16 overflow that the "
      "dynamic loss scale can still answer by halving (above --min-loss-scale) is not counted, so, as Megatron, "
      "a --fp16 run never stops while its scale comes down from 2^32", int),
    M(("--exit-interval", "--exit-duration-in-mins"), "training",
      Refused("stop with --train-iters or a signal (SIGTERM/SIGUSR1 save a checkpoint and exit 0)"), "", int),
    # learning rate
    M(("--lr",), "learning rate", "learning_rate", "peak learning rate", float),
    M(("--min-lr",), "learning rate", "min_lr", "learning-rate floor of the decay", float),
    M(("--lr-decay-style",), "learning rate", _decay_style, "linear | cosine | constant",
      stands_for=("--lr-schedule",)),
    M(("--lr-decay-iters",), "learning rate", "lr_decay_steps", "decay length in updates", int),
    M(("--lr-decay-samples",), "learning rate", "lr_decay_samples", "decay length in samples", int),
    M(("--lr-warmup-fraction", "--warmup"), "learning rate", "lr_warmup",
      "warm-up as a fraction of the decay (--warmup: the old name)", float),
    M(("--lr-warmup-iters",), "learning rate", "lr_warmup_steps", "warm-up in updates", int),
    M(("--lr-warmup-samples",), "learning rate", "lr_warmup_samples", "warm-up in samples", int),
    # checkpointing
    M(("--save",), "checkpointing", "checkpoint_output_dir", "checkpoint directory to write"),
    M(("--load",), "checkpointing", Own("load"),
      "checkpoint directory to start from: resumes the run when it holds one (Megatron-LM checkpoints too)",
      stands_for=("--checkpoint-input-dir",)),
    M(("--save-interval",), "checkpointing", "save_per_steps", "save every N updates", int),
    M(("--finetune",), "checkpointing", Own("finetune"), "start from --load's weights: new optimizer, iteration 0",
      None),
    M(("--no-load-optim",), "checkpointing", Own("no_load_optim"),
      "with --finetune (implied there)", None),
    M(("--no-load-rng",), "checkpointing", Own("no_load_rng"), "with --finetune (implied there)", None),
    M(("--no-save-optim", "--no-save-rng"), "checkpointing",
      Refused("checkpoints always hold the optimizer and RNG state so that a run resumes exactly"), "", None),
    # mixed precision
    M(("--fp16",), "mixed precision", _precision("fp16"), "fp16 autocast with loss scaling", None,
      stands_for=("--precision fp16",)),
    M(("--bf16",), "mixed precision", _precision("bf16"), "bf16 autocast", None, stands_for=("--precision bf16",)),
    M(("--loss-scale",), "mixed precision", Own("static_loss_scale"), "static loss scale (default: dynamic)", float,
      stands_for=("--loss-scaling",)),
    M(("--initial-loss-scale",), "mixed precision", "initial_loss_scale", "first dynamic loss scale", float),
    M(("--min-loss-scale",), "mixed precision", "min_loss_scale", "floor of the dynamic loss scale", float),
    M(("--loss-scale-window",), "mixed precision", "loss_scale_window",
      "clean updates before the dynamic scale doubles", int),
    M(("--hysteresis",), "mixed precision", "loss_scale_hysteresis",
      "overflowing updates tolerated before the scale halves", int),
    M(("--fp32-embedding",), "mixed precision", accept, "the weights are fp32 masters here", None),
    # distributed
    M(("--tensor-model-parallel-size", "--model-parallel-size"), "distributed", _tensor_parallel,
      "tensor-parallel size: heads, MLP, embedding and LM head split over N processes (train_gpt2.py "
      "--tensor-model-parallel-size)", int),
    M(("--pipeline-model-parallel-size",), "distributed", Own("pipeline"),
      "pipeline stages (blocks split evenly)", int, stands_for=("--layers-per-ipu", "--ipus-per-replica")),
    M(("--sequence-parallel",), "distributed", Own("sequence_parallel"),
      "LayerNorm and dropout regions split along the sequence (with tensor parallelism; off at size 1, as in "
      "Megatron)", None),
    M(("--distributed-backend",), "distributed", accept, "nccl | gloo: chosen by the device here"),
    M(("--DDP-impl",), "distributed", accept, "local | torch: torch's DDP here"),
    M(("--use-distributed-optimizer",), "distributed", _distributed_optimizer,
      "shard the optimizer state across replicas (ZeRO-1)", None),
    M(("--local_rank", "--local-rank"), "distributed", accept, "set by the launcher", int),
    # validation
    M(("--eval-interval",), "validation", "eval_every_steps", "validate every N updates", int),
    M(("--eval-iters",), "validation", "eval_iters", "validation batches (of the global batch) each time", int),
    # data and dataloader
    M(("--data-path",), "data and dataloader", _data_path,
      "mmap prefixes, optionally weighted: W1 P1 W2 P2 ...", str, "+", stands_for=("--dataset mmap", "--input-files")),
    M(("--train-data",), "data and dataloader", _train_data, "loose JSON files, one document per line", str, "+",
      stands_for=("--dataset jsonl", "--input-files")),
    M(("--valid-data",), "data and dataloader", _held_out_data("--valid-data", "valid_data_path"),
      "(seed 001) validation files (mmap prefixes with --data-path); the training data is still split by --split",
      str, "+", stands_for=("--valid-data-path",)),
    M(("--test-data",), "data and dataloader", _held_out_data("--test-data", "test_data_path"),
      "(seed 001) test files (mmap prefixes with --data-path), evaluated after training", str, "+",
      stands_for=("--test-data-path",)),
    M(("--mock-data",), "data and dataloader", switch_to("dataset", "generated"),
      "synthetic token ids instead of a corpus (our --dataset generated)", None,
      stands_for=("--dataset generated",)),
    M(("--text-key", "--json-key"), "data and dataloader", "json_key", "the text field of --train-data"),
    M(("--split",), "data and dataloader", "split", "train,valid,test proportions", _csv),
    M(("--data-impl",), "data and dataloader", _data_impl, "mmap"),
    M(("--vocab-file",), "data and dataloader", Own("vocab_file"), "GPT-2 BPE vocabulary (json)"),
    M(("--merge-file",), "data and dataloader", Own("merge_file"), "GPT-2 BPE merges"),
    M(("--tokenizer-type",), "data and dataloader", _tokenizer_type, "GPT2BPETokenizer | PretrainedFromHF"),
    M(("--tokenizer-name-or-path", "--tokenizer-model"), "data and dataloader", "tokenizer_name_or_path",
      "a local Hugging Face tokenizer folder"),
    M(("--seed",), "data and dataloader", "seed", "random seed", int),
    M(("--num-workers",), "data and dataloader", "num_workers", "data-loader worker processes", int),
    M(("--cache-dir",), "data and dataloader", "data_cache_dir", "where tokenized --train-data is cached"),
    M(("--lazy-loader", "--presplit-sentences", "--resume-dataloader"), "data and dataloader", accept,
      "(seed 001) the JSON is read lazily, sentences need no presplit, and resuming restores the data position "
      "here", None),
    M(("--reset-position-ids",), "data and dataloader", switch_to("reset_position_ids"),
      "positions restart after each end-of-document", None),
    M(("--reset-attention-mask",), "data and dataloader", switch_to("reset_attention_mask"),
      "attention stays within each document", None),
    M(("--eod-mask-loss",), "data and dataloader", switch_to("eod_mask_loss"), "no loss after end-of-document",
      None),
    # logging
    M(("--log-interval",), "logging", "log_steps", "print the step line every N updates", int),
    M(("--tensorboard-dir",), "logging", "tensorboard_dir", "TensorBoard event files"),
    *KFAC_FLAGS,  # gpt2forge's own, the same in every front end (docs/training.md#k-fac)
    # DeepSpeed (Megatron-DeepSpeed's arguments.py and deepspeed.add_config_arguments)
    M(("--deepspeed", "--deepscale"), "DeepSpeed", Own("deepspeed"),
      "read --deepspeed_config (ds.json) as DeepSpeed's engine would", None),
    M(("--deepspeed_config", "--deepspeed-config", "--deepscale_config"), "DeepSpeed", Own("deepspeed_config"),
      "ds.json: batch sizes, clipping, fp16/bf16, ZeRO, optimizer and scheduler (docs/megatron.md)"),
    M(("--zero-stage", "--zero_stage"), "DeepSpeed", "zero_stage",
      "ZeRO stage 0-3 (ds.json's zero_optimization.stage wins)", int),
    M(("--cpu-optimizer",), "DeepSpeed", switch_to("offload", "optimizer"),
      "optimizer state and update in host memory (--offload optimizer)", None, stands_for=("--offload optimizer",)),
    M(("--deepspeed-activation-checkpointing",), "DeepSpeed", accept,
      "DeepSpeed's implementation of --checkpoint-activations: torch's here", None),
    M(("--partition-activations",), "DeepSpeed", accept,
      "no effect without tensor parallelism (as in DeepSpeed)", None),
    M(("--checkpoint-in-cpu",), "DeepSpeed",
      Refused("checkpointed activations stay on the device here; --checkpoint-activations recomputes them"), "",
      None),
    M(("--no-pipeline-parallel",), "DeepSpeed", accept,
      "the model runs unsplit without --pipeline-model-parallel-size", None),
)

MEGATRON_DEFAULTS: dict[str, Any] = {
    "model": "gpt2", "lr_schedule": "linear", "lr_warmup": 0.0, "lr_warmup_form": "transformers",
    "weight_decay": 0.01, "max_grad_norm": 1.0,
    "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "log_steps": 100, "eval_every_steps": 1000,
    "eval_iters": 100, "seed": 1234, "split": "969,30,1", "device_iterations": 1, "num_workers": 2,
    "log_format": "megatron", "optimizer": "AdamW", "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "init_method_std": 0.02, "initial_loss_scale": 2.0 ** 32, "loss_scale_window": 1000, "min_loss_scale": 1.0,
    "loss_scale_hysteresis": 2, "save_per_epochs": 0,  # Megatron saves every --save-interval and at the end only
}
"""Megatron-LM's defaults where they differ from train_gpt2.py's (arguments.py of Megatron-LM)."""


FRONT_END = FrontEnd("pretrain_gpt.py", "Megatron-LM / Megatron-DeepSpeed GPT flags, run by gpt2forge's trainer.",
                     GROUPS, FLAGS, "; pretrain_gpt.py takes the Megatron-LM flags listed by --help (docs/megatron.md "
                     "has the mapping); train_gpt2.py's own flags go to train_gpt2.py", MegatronOnly)


def build_parser() -> argparse.ArgumentParser:
    """Megatron's flags in Megatron's groups; defaults SUPPRESSed, so only given flags appear."""
    return FRONT_END.build_parser()


def translate(argv: Sequence[str], world_size: int | None = None) -> dict[str, Any]:
    """Megatron argv -> the flat TrainConfig values (field name -> value) of the same run.

    Raises:
        UsageError: a refused flag, an unknown flag, a bad value, or batch sizes that do not divide.
    """
    parsed = FRONT_END.parse(argv)  # its set_by: field -> its flag, for ds.json's precedence notices
    run = Parsed({**MEGATRON_DEFAULTS, **parsed.values}, parsed.own, parsed.set_by)
    values, own = run.values, run.own
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    _deepspeed(run, world_size)
    _batches(values, own, world_size)
    _sequence_parallel(values, own)
    _loss_scaling(values, own)
    _checkpoints(values, own)
    _tokenizer(own)
    if "batch_size" not in values:
        raise UsageError("--micro-batch-size is required (sequences per forward/backward)")
    return values


def _data_parallel(values: dict, own: MegatronOnly, world_size: int) -> int:
    """Replicas: the world size over tensor x pipeline parallel sizes (Megatron's rule and words)."""
    stages, tp = own.pipeline, values.get("tensor_model_parallel_size", 1)
    for name, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", stages)):
        if size < 1:
            raise UsageError(f"{name} {size}: must be >= 1 (1: not split)")
    if world_size % (tp * stages):
        raise UsageError(f"world size ({world_size}) is not divisible by tensor model parallel size ({tp}) times "
                         f"pipeline model parallel size ({stages})")
    return world_size // (tp * stages)


def _sequence_parallel(values: dict, own: MegatronOnly) -> None:
    """--sequence-parallel is kept with tensor parallelism and dropped at size 1, as Megatron does."""
    if not own.sequence_parallel:
        return
    if values.get("tensor_model_parallel_size", 1) > 1:
        values["sequence_parallel"] = True
    else:
        log.notice("--sequence-parallel: disabled because the tensor model parallel size is 1 (as in Megatron)")


def _deepspeed(run: Parsed, world_size: int) -> None:
    """--deepspeed --deepspeed_config ds.json: DeepSpeed's config on top of the flags (as Megatron-DeepSpeed,
    without --deepspeed the file is not read)."""
    path, enabled = run.own.deepspeed_config, run.own.deepspeed
    if enabled and path is None:
        raise UsageError("--deepspeed needs --deepspeed_config ds.json (DeepSpeed's engine reads its batch sizes, "
                         "precision and ZeRO stage from it)")
    if path is not None and not enabled:
        log.notice(f"--deepspeed_config {path} is not read without --deepspeed (as in Megatron-DeepSpeed)")
    elif path is not None:
        apply_deepspeed_config(path, run, _data_parallel(run.values, run.own, world_size))


def _batches(values: dict, own: MegatronOnly, world_size: int) -> None:
    """--global-batch-size -> gradient accumulation; --pipeline-model-parallel-size -> even stages."""
    data_parallel = _data_parallel(values, own, world_size)
    stages = own.pipeline
    if stages > 1:
        layers = values.get("num_layers", 12)
        if layers % stages:
            raise UsageError(f"number of layers ({layers}) should be divisible by the pipeline model parallel size "
                             f"({stages})")
        values["layers_per_ipu"] = [layers // stages] * stages
        values["ipus_per_replica"] = stages
    else:
        values["ipus_per_replica"] = 1
    micro = values.get("batch_size")
    glob = own.global_batch
    if micro is None:
        return
    if micro < 1:
        raise UsageError(f"--micro-batch-size {micro}: must be >= 1")
    if glob is None:
        glob = micro * data_parallel  # Megatron's default global batch
    if glob % (micro * data_parallel):
        raise UsageError(f"global batch size ({glob}) is not divisible by micro batch size ({micro}) times data "
                         f"parallel size ({data_parallel})")
    values["gradient_accumulation"] = glob // (micro * data_parallel)
    values["replication_factor"] = data_parallel


def _checkpoints(values: dict, own: MegatronOnly) -> None:
    """--load / --finetune / --no-load-*: resume, or start from the weights."""
    load, finetune = own.load, own.finetune
    no_load = [name for name, given in (("--no-load-optim", own.no_load_optim), ("--no-load-rng", own.no_load_rng))
               if given]
    if no_load and not finetune:
        raise UsageError(f"{no_load[0]} without --finetune: resuming restores the whole training state here; add "
                         "--finetune to start from --load's weights with a new optimizer and iteration 0")
    if finetune and not load:
        raise UsageError("--finetune needs --load DIR (the checkpoint whose weights the run starts from)")
    if load is None:
        return
    if finetune:
        values["checkpoint_input_dir"] = load
    elif load == values.get("checkpoint_output_dir"):
        values["auto_resume"] = True  # Megatron's --load = --save: continue when a checkpoint is there
    elif Path(load).exists():
        values["checkpoint_input_dir"] = load
        values["resume_training_from_checkpoint"] = True
    # else: as Megatron, a --load with nothing in it starts from scratch


def _tokenizer(own: MegatronOnly) -> None:
    """--vocab-file with --merge-file: GPT-2's own BPE files (the built-in tokenizer), or one line."""
    files = {name: path for name, path in (("--vocab-file", own.vocab_file), ("--merge-file", own.merge_file))
             if path is not None}
    if not files:
        return
    if len(files) == 1:
        raise UsageError(f"{next(iter(files))} needs its partner (--vocab-file and --merge-file come together)")
    vocab, merges = Path(files["--vocab-file"]), Path(files["--merge-file"])
    for name, path in files.items():
        if not Path(path).is_file():
            raise UsageError(f"{name} {path}: file not found")
    if not is_gpt2_files(vocab, merges):
        raise UsageError(f"--vocab-file {vocab}: not GPT-2's BPE vocabulary; put it and its merges in a folder as "
                         "vocab.json + merges.txt and pass --tokenizer-type PretrainedFromHF "
                         "--tokenizer-name-or-path FOLDER")
    # GPT-2's own files: the built-in tokenizer is the same BPE


def parse_args(argv: Sequence[str], world_size: int | None = None) -> TrainConfig:
    """Megatron argv -> TrainConfig (validated as train_gpt2.py's flags are)."""
    return TrainConfig.from_flat(translate(argv, world_size))
