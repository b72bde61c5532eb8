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
    Parsed,
    equivalent_command,
    group,
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
    """Sequences per update over all replicas (or ds.json's train_batch_size)."""
    pipeline: int = 1
    """Pipeline stages, the blocks split evenly."""
    sequence_parallel: bool = False
    """LayerNorm and dropout regions split along the sequence, with tensor parallelism (off at size 1, as in
    Megatron)."""
    static_loss_scale: float | None = None
    """A fixed fp16 loss scale (or ds.json's fp16.loss_scale; default: dynamic)."""
    load: str | None = None
    """Checkpoint directory to start from: resumes the run when it holds one (Megatron-LM checkpoints too); with
    --finetune, only its weights."""
    finetune: bool = False
    """Start from --load's weights: a new optimizer, iteration 0."""
    no_load_optim: bool = False
    """Leave --load's optimizer state (only with --finetune here, which implies it)."""
    no_load_rng: bool = False
    """Leave --load's RNG state (only with --finetune here, which implies it)."""
    vocab_file: str | None = None
    """GPT-2's BPE vocabulary (vocab.json), with --merge-file."""
    merge_file: str | None = None
    """GPT-2's BPE merges (merges.txt), with --vocab-file."""
    deepspeed: bool = False
    """Read --deepspeed_config (ds.json) as DeepSpeed's engine would."""
    deepspeed_config: str | None = None
    """The ds.json file: batch sizes, clipping, fp16/bf16, ZeRO, optimizer and scheduler (docs/megatron.md)."""


# -- the rules that take more than a rename -------------------------------------------------------------


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


def _recompute_granularity(value: str, values: dict) -> None:
    if value == "full":
        values["recompute_checkpoint_every_layer"] = True
    elif value != "selective":
        raise UsageError(f"--recompute-granularity {value}: full or selective")
    # selective recomputes the attention scores and softmax; attention here is fused (SDPA) and keeps
    # no probabilities, so there is nothing to recompute: Megatron does the same with flash attention.


def _optimizer(value: str, values: dict) -> None:
    if value in ("muon", "dist_muon"):
        raise UsageError(f"--optimizer {value}: Megatron's Muon (q, k and v orthogonalized apart, spectral scaling, "
                         "its --muon-* flags) is not run here; train_gpt2.py --optimizer Muon runs torch.optim.Muon "
                         "on the blocks' whole matrices (docs/training.md)")
    if value != "adam":
        raise UsageError(f"--optimizer {value}: only adam (Megatron's Adam with decoupled weight decay = AdamW) is "
                         "available through pretrain_gpt.py; train_gpt2.py also has LAMB and Muon")
    values["optimizer"] = "AdamW"


def _decay_style(value: str, values: dict) -> None:
    if value not in ("linear", "cosine", "constant"):
        raise UsageError(f"--lr-decay-style {value}: linear, cosine or constant here (Megatron also has "
                         "inverse-square-root and WSD, not available)")
    values["lr_schedule"] = value


def _csv(text: str) -> str:
    return text.replace(" ", "")


FLAGS: tuple[Flag, ...] = (
    *group(
        "model",
        Flag(name="--num-layers", field="num_layers"),
        Flag(name="--hidden-size", field="hidden_size"),
        Flag(name="--num-attention-heads", field="num_attention_heads"),
        Flag(name="--ffn-hidden-size", field="ffn_hidden_size"),
        Flag(name="--seq-length", field="max_len"),
        Flag(name="--max-position-embeddings", field="max_position_embeddings"),
        Flag(name="--init-method-std", field="init_method_std"),
        Flag(name="--make-vocab-size-divisible-by", type=int,
             refused="the vocabulary is padded to a multiple of 64 here, as GPT-2 checkpoints do (padded rows never "
                     "get probability)"),
        Flag(name="--fp32-residual-connection", aliases=("--apply-query-key-layer-scaling", "--openai-gelu"),
             type=None, refused="GPT-2's numerics are fixed here (exact GELU, fp32 LayerNorm and softmax statistics)"),
    ),
    *group(
        "regularization",
        Flag(name="--hidden-dropout", field="hidden_dropout"),
        Flag(name="--attention-dropout", field="attention_dropout"),
        Flag(name="--weight-decay", field="weight_decay"),
        Flag(name="--clip-grad", field="max_grad_norm"),
        Flag(name="--adam-beta1", field="adam_beta1"),
        Flag(name="--adam-beta2", field="adam_beta2"),
        Flag(name="--adam-eps", field="adam_eps"),
    ),
    *group(
        "training",
        Flag(name="--micro-batch-size", aliases=("--batch-size",), field="batch_size"),
        Flag(name="--global-batch-size", own="global_batch", stands_for=("--gradient-accumulation",)),
        Flag(name="--train-iters", field="training_steps"),
        Flag(name="--train-samples", field="train_samples"),
        Flag(name="--optimizer", rule=_optimizer, help="adam"),
        Flag(name="--checkpoint-activations", aliases=("--recompute-activations",),
             sets={"recompute_checkpoint_every_layer": True}, stands_for=("--recompute-checkpoint-every-layer",)),
        Flag(name="--recompute-granularity", rule=_recompute_granularity, help="full | selective"),
        Flag(name="--checkpoint-num-layers", aliases=("--recompute-num-layers",), type=int,
             accepted="blocks per recomputed chunk (every block is its own chunk here)"),
        Flag(name="--recompute-method", accepted="uniform | block (every block is recomputed here)"),
        Flag(name="--deterministic-mode", sets={"deterministic": "true"}),
        Flag(name="--exit-signal-handler", sets={"exit_signal_handler": True}),
        Flag(name="--max-nonfinite-updates", field="max_nonfinite_updates"),
        Flag(name="--exit-interval", aliases=("--exit-duration-in-mins",), type=int,
             refused="stop with --train-iters or a signal (SIGTERM/SIGUSR1 save a checkpoint and exit 0)"),
    ),
    *group(
        "learning rate",
        Flag(name="--lr", field="learning_rate"),
        Flag(name="--min-lr", field="min_lr"),
        Flag(name="--lr-decay-style", rule=_decay_style, help="linear | cosine | constant",
             stands_for=("--lr-schedule",)),
        Flag(name="--lr-decay-iters", field="lr_decay_steps"),
        Flag(name="--lr-decay-samples", field="lr_decay_samples"),
        Flag(name="--lr-warmup-fraction", aliases=("--warmup",), field="lr_warmup"),
        Flag(name="--lr-warmup-iters", field="lr_warmup_steps"),
        Flag(name="--lr-warmup-samples", field="lr_warmup_samples"),
    ),
    *group(
        "checkpointing",
        Flag(name="--save", field="checkpoint_output_dir"),
        Flag(name="--load", own="load", stands_for=("--checkpoint-input-dir",)),
        Flag(name="--save-interval", field="save_per_steps"),
        Flag(name="--finetune", own="finetune"),
        Flag(name="--no-load-optim", own="no_load_optim"),
        Flag(name="--no-load-rng", own="no_load_rng"),
        Flag(name="--no-save-optim", aliases=("--no-save-rng",), type=None,
             refused="checkpoints always hold the optimizer and RNG state so that a run resumes exactly"),
    ),
    *group(
        "mixed precision",
        Flag(name="--fp16", sets={"precision": "fp16"}, help="fp16 autocast with loss scaling",
             stands_for=("--precision fp16",)),
        Flag(name="--bf16", sets={"precision": "bf16"}, help="bf16 autocast", stands_for=("--precision bf16",)),
        Flag(name="--loss-scale", own="static_loss_scale", stands_for=("--loss-scaling",)),
        Flag(name="--initial-loss-scale", field="initial_loss_scale"),
        Flag(name="--min-loss-scale", field="min_loss_scale"),
        Flag(name="--loss-scale-window", field="loss_scale_window"),
        Flag(name="--hysteresis", field="loss_scale_hysteresis"),
        Flag(name="--fp32-embedding", type=None, accepted="the weights are fp32 masters here"),
    ),
    *group(
        "distributed",
        Flag(name="--tensor-model-parallel-size", aliases=("--model-parallel-size",),
             field="tensor_model_parallel_size"),
        Flag(name="--pipeline-model-parallel-size", own="pipeline",
             stands_for=("--layers-per-ipu", "--ipus-per-replica")),
        Flag(name="--sequence-parallel", own="sequence_parallel"),
        Flag(name="--distributed-backend", accepted="nccl | gloo: chosen by the device here"),
        Flag(name="--DDP-impl", accepted="local | torch: torch's DDP here"),
        Flag(name="--use-distributed-optimizer", sets={"zero_stage": 1}),
        Flag(name="--local_rank", aliases=("--local-rank",), type=int, accepted="set by the launcher"),
    ),
    *group(
        "validation",
        Flag(name="--eval-interval", field="eval_every_steps"),
        Flag(name="--eval-iters", field="eval_iters"),
    ),
    *group(
        "data and dataloader",
        Flag(name="--data-path", rule=_data_path, nargs="+", help="mmap prefixes, optionally weighted: W1 P1 W2 P2 ...",
             stands_for=("--dataset mmap", "--input-files")),
        Flag(name="--train-data", rule=_train_data, nargs="+", help="loose JSON files, one document per line",
             stands_for=("--dataset jsonl", "--input-files")),
        Flag(name="--valid-data", rule=_held_out_data("--valid-data", "valid_data_path"), nargs="+",
             help="(seed 001) validation files (mmap prefixes with --data-path); the training data is still split "
                  "by --split", stands_for=("--valid-data-path",)),
        Flag(name="--test-data", rule=_held_out_data("--test-data", "test_data_path"), nargs="+",
             help="(seed 001) test files (mmap prefixes with --data-path), evaluated after training",
             stands_for=("--test-data-path",)),
        Flag(name="--mock-data", sets={"dataset": "generated"}, help="synthetic token ids instead of a corpus",
             stands_for=("--dataset generated",)),
        Flag(name="--text-key", aliases=("--json-key",), field="json_key"),
        Flag(name="--split", field="split", type=_csv),
        Flag(name="--data-impl", rule=_data_impl, help="mmap"),
        Flag(name="--vocab-file", own="vocab_file"),
        Flag(name="--merge-file", own="merge_file"),
        Flag(name="--tokenizer-type", rule=_tokenizer_type, help="GPT2BPETokenizer | PretrainedFromHF"),
        Flag(name="--tokenizer-name-or-path", aliases=("--tokenizer-model",), field="tokenizer_name_or_path"),
        Flag(name="--seed", field="seed"),
        Flag(name="--num-workers", field="num_workers"),
        Flag(name="--cache-dir", field="data_cache_dir"),
        Flag(name="--lazy-loader", aliases=("--presplit-sentences", "--resume-dataloader"), type=None,
             accepted="(seed 001) the JSON is read lazily, sentences need no presplit, and resuming restores the "
                      "data position here"),
        Flag(name="--reset-position-ids", sets={"reset_position_ids": True}),
        Flag(name="--reset-attention-mask", sets={"reset_attention_mask": True}),
        Flag(name="--eod-mask-loss", sets={"eod_mask_loss": True}),
    ),
    *group(
        "logging",
        Flag(name="--log-interval", field="log_steps"),
        Flag(name="--tensorboard-dir", field="tensorboard_dir"),
    ),
    *KFAC_FLAGS,  # gpt2forge's own, the same in every front end (docs/training.md#k-fac)
    *group(  # Megatron-DeepSpeed's arguments.py and deepspeed.add_config_arguments
        "DeepSpeed",
        Flag(name="--deepspeed", aliases=("--deepscale",), own="deepspeed"),
        Flag(name="--deepspeed_config", aliases=("--deepspeed-config", "--deepscale_config"), own="deepspeed_config"),
        Flag(name="--zero-stage", aliases=("--zero_stage",), field="zero_stage",
             note="ds.json's zero_optimization.stage wins"),
        Flag(name="--cpu-optimizer", sets={"offload": "optimizer"}, stands_for=("--offload optimizer",)),
        Flag(name="--deepspeed-activation-checkpointing", type=None,
             accepted="DeepSpeed's implementation of --checkpoint-activations: torch's here"),
        Flag(name="--partition-activations", type=None,
             accepted="no effect without tensor parallelism (as in DeepSpeed)"),
        Flag(name="--checkpoint-in-cpu", type=None,
             refused="checkpointed activations stay on the device here; --checkpoint-activations recomputes them"),
        Flag(name="--no-pipeline-parallel", type=None,
             accepted="the model runs unsplit without --pipeline-model-parallel-size"),
    ),
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
