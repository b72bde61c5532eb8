"""Hugging Face run_clm command lines -> TrainConfig: `train_clm.py` takes the flags of transformers'
`run_clm_no_trainer.py` (and seed 002's K-FAC additions) and runs the one trainer.

`FLAGS` is the whole mapping, one `flag_table.Flag` row per run_clm flag: a TrainConfig field, a
rule, or `Refused` (one line, exit 2). run_clm's defaults are applied first (`CLM_DEFAULTS`: 3
epochs, learning rate 5e-5, linear decay to 0 without warm-up, 8 sequences per device, no weight
decay, no clipping), so an omitted flag means what it means there. What the flags become:

- data: `--dataset_name` (a `save_to_disk` folder, a local dataset folder or a name in the local
  `datasets` cache) or `--train_file`/`--validation_file` -> `--dataset hf` (gpt2forge.data.hf_datasets:
  run_clm's tokenize + group_texts blocks, the same blocks from the same records); `--block_size`
  -> `--max-len` (default: the model's positions, at most 1024, as run_clm);
- model: `--model_name_or_path DIR` (a Hugging Face GPT-2 folder, or a model in the local hub cache)
  -> `--checkpoint-input-dir` (fine-tuning from its weights, loaded without a second copy: run_clm's
  `--low_cpu_mem_usage` is how every checkpoint loads here); `--config_name` -> `--model-config`;
  `--tokenizer_name` -> `--tokenizer-name-or-path`;
- schedule: `--lr_scheduler_type` linear | cosine | cosine_with_restarts (one cycle: cosine) |
  polynomial (transformers' power 1 to 1e-7: linear to `--min-lr 1e-7`) | constant (warm-up ignored,
  as transformers' `get_constant_schedule`) | constant_with_warmup;
- batch: `--per_device_train_batch_size` x `--gradient_accumulation_steps` x the processes torchrun or
  `accelerate launch` started (one replica each);
- output: `--output_dir` receives the final model and tokenizer (`from_pretrained` opens it) and
  all_results.json; `--checkpointing_steps N|epoch` writes step_N/ or epoch_N/ there;
  `--resume_from_checkpoint` bare continues from the newest of them, with a path from that checkpoint;
- `--mixed_precision no|fp16|bf16` (default: `accelerate launch`'s choice, else no);
- `--with_tracking --report_to tensorboard|wandb|all`: TensorBoard under OUTPUT_DIR/clm_no_trainer
  (accelerate's place) and/or Weights & Biases.
After each epoch the run prints run_clm's `epoch N: perplexity: P eval_loss: L`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.core.flags import str_to_bool
from gpt2forge.frontends.flag_table import KFAC_FLAGS, Flag, FrontEnd, group
from gpt2forge.model.config import MODEL_TYPES, hf_config_positions
from gpt2forge.model.pretrained import local_or_hub_cached
from gpt2forge.text.tokenizer import HF_FILE, is_gpt2_files
from gpt2forge.text.vocab import MERGES_FILE, VOCAB_FILE
from gpt2forge.train.config import TrainConfig

GROUPS = ("data", "model", "training", "checkpointing and output", "tracking", "K-FAC")
"""The --help groups."""

SCHEDULERS = {  # run_clm's --lr_scheduler_type -> (--lr-schedule, warm-up used, --min-lr)
    "linear": ("linear", True, 0.0),
    "cosine": ("cosine", True, 0.0),
    "cosine_with_restarts": ("cosine", True, 0.0),  # num_cycles 1 (get_scheduler's): one cosine over the run
    "polynomial": ("linear", True, 1e-7),  # power 1.0, lr_end 1e-7 (get_scheduler's)
    "constant": ("constant", False, 0.0),
    "constant_with_warmup": ("constant", True, 0.0),
}
TRACKERS = ("tensorboard", "wandb", "all")
ACCELERATE_STATE = ("optimizer.bin", "random_states_0.pkl", "scheduler.bin")
"""Files of an `accelerate save_state` folder (pickles): told apart from this trainer's checkpoints."""


@dataclasses.dataclass
class RunClmOnly:
    """run_clm's settings with no TrainConfig field of their own (`Own` rows store them); the rules
    that `translate` runs after the flags turn them into TrainConfig values."""

    dataset_name: str | None = None
    """`--dataset hf --input-files NAME`: a `datasets` dataset: a save_to_disk folder, a local dataset folder, or a
    name in the local datasets cache."""
    train_file: str | None = None
    """`--dataset hf --input-files FILE`: training text: .txt (one record per line), .json/.jsonl, .csv."""
    validation_file: str | None = None
    """`--valid-data-path FILE`: validation text, the same formats."""
    block_size: int | None = None
    """`--max-len`: tokens per block (default: the model's positions, at most 1024)."""
    model: str | None = None
    """`--checkpoint-input-dir`: a Hugging Face GPT-2 folder (save_pretrained), or a model in the local hub cache:
    start from its weights."""
    config: str | None = None
    """`--model-config`: a GPT-2 config.json (or its folder): a new model of that shape."""
    tokenizer: str | None = None
    """`--tokenizer-name-or-path`: a local tokenizer folder (default: the model's, else GPT-2's)."""
    scheduler: str = "linear"
    """`--lr-schedule` (and `--min-lr`): linear | cosine | cosine_with_restarts | polynomial | constant |
    constant_with_warmup."""
    warmup: int = 0
    """`--lr-warmup-steps`: warm-up updates."""
    precision: str | None = None
    """`--precision`: no | fp16 | bf16 (default: accelerate launch's, ACCELERATE_MIXED_PRECISION)."""
    output_dir: str | None = None
    """`--final-model-dir` (and `--checkpoint-output-dir`): the final model, tokenizer and all_results.json; the
    checkpoints."""
    checkpointing: str | None = None
    """`--save-per-steps N` | `--save-per-epochs 1` (epoch): checkpoints in --output_dir."""
    resume: str | None = None
    """`--checkpoint-input-dir PATH --resume-training-from-checkpoint`; bare: `--auto-resume`, the newest checkpoint
    in --output_dir."""
    tracking: bool = False
    """`--tensorboard-dir` / `--use-wandb`: log the run to the --report_to trackers."""
    report_to: str = "all"
    """tensorboard | wandb | all."""


def _model_type(value: str, _values: dict) -> None:
    if value != "gpt2":
        raise UsageError(f"--model_type {value}: this trainer builds GPT-2 (model_type gpt2) only")


FLAGS: tuple[Flag, ...] = (
    *group(
        "data",
        Flag(name="--dataset_name", own="dataset_name", stands_for=("--dataset hf", "--input-files")),
        Flag(name="--dataset_config_name", field="dataset_config_name"),
        Flag(name="--train_file", own="train_file", stands_for=("--dataset hf", "--input-files")),
        Flag(name="--validation_file", own="validation_file", stands_for=("--valid-data-path",)),
        Flag(name="--validation_split_percentage", field="validation_split_percentage"),
        Flag(name="--no_keep_linebreaks", sets={"keep_linebreaks": False}),
        Flag(name="--block_size", own="block_size", stands_for=("--max-len",)),
        Flag(name="--preprocessing_num_workers", field="preprocessing_workers"),
        Flag(name="--overwrite_cache", field="overwrite_cache"),
        Flag(name="--streaming", type=None, refused="the blocks are tokenized once into a memory-mapped cache, which "
                                                    "any corpus size fits; drop --streaming"),
    ),
    *group(
        "model",
        Flag(name="--model_name_or_path", own="model", stands_for=("--checkpoint-input-dir",)),
        Flag(name="--config_name", own="config", stands_for=("--model-config",)),
        Flag(name="--tokenizer_name", own="tokenizer", stands_for=("--tokenizer-name-or-path",)),
        Flag(name="--model_type", rule=_model_type, help="gpt2 (the model built without --model_name_or_path)"),
        Flag(name="--use_slow_tokenizer", type=None, accepted="the same ids as the fast tokenizer here"),
        Flag(name="--low_cpu_mem_usage", type=None,
             accepted="always: a checkpoint's model is built on the meta device and takes the file's tensors"),
        Flag(name="--trust_remote_code", type=str_to_bool, nargs="?", const=True,
             refused="no code from a model folder runs here: GPT-2 is built in; drop --trust_remote_code"),
    ),
    *group(
        "training",
        Flag(name="--per_device_train_batch_size", field="batch_size"),
        Flag(name="--per_device_eval_batch_size", type=int,
             accepted="validation sequences per batch (the eval loss does not depend on it here)"),
        Flag(name="--learning_rate", field="learning_rate"),
        Flag(name="--weight_decay", field="weight_decay"),
        Flag(name="--num_train_epochs", field="epochs"),
        Flag(name="--max_train_steps", field="training_steps"),
        Flag(name="--gradient_accumulation_steps", field="gradient_accumulation"),
        Flag(name="--lr_scheduler_type", own="scheduler", stands_for=("--lr-schedule",)),
        Flag(name="--num_warmup_steps", own="warmup", stands_for=("--lr-warmup-steps",)),
        Flag(name="--seed", field="seed"),
        Flag(name="--mixed_precision", own="precision", stands_for=("--precision",)),
    ),
    *group(
        "checkpointing and output",
        Flag(name="--output_dir", own="output_dir", stands_for=("--final-model-dir", "--checkpoint-output-dir")),
        Flag(name="--checkpointing_steps", own="checkpointing", stands_for=("--save-per-steps", "--save-per-epochs")),
        Flag(name="--resume_from_checkpoint", own="resume", nargs="?", const=""),
        Flag(name="--push_to_hub", aliases=("--hub_model_id", "--hub_token"), nargs="?", const="",
             refused="nothing is uploaded from a training run here; push --output_dir with huggingface-cli upload"),
    ),
    *group(
        "tracking",
        Flag(name="--with_tracking", own="tracking"),
        Flag(name="--report_to", own="report_to"),
    ),
    *KFAC_FLAGS,
)

CLM_DEFAULTS: dict[str, Any] = {
    "model": "gpt2", "learning_rate": 5e-5, "weight_decay": 0.0, "epochs": 3, "batch_size": 8,
    "gradient_accumulation": 1, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "optimizer": "AdamW",
    "log_format": "run_clm", "device_iterations": 1, "precision": "fp32", "lr_warmup_form": "transformers",
}
"""run_clm_no_trainer.py's defaults (and torch.optim.AdamW's) where they differ from train_gpt2.py's."""

FRONT_END = FrontEnd("train_clm.py", "Hugging Face run_clm_no_trainer.py flags, run by gpt2forge's trainer.", GROUPS,
                     FLAGS, "; train_clm.py takes run_clm_no_trainer.py's flags listed by --help (docs/run_clm.md has "
                     "the mapping); train_gpt2.py's own flags go to train_gpt2.py", RunClmOnly)


def build_parser() -> argparse.ArgumentParser:
    return FRONT_END.build_parser()


def translate(argv: Sequence[str], world_size: int | None = None) -> dict[str, Any]:
    """run_clm argv -> the flat TrainConfig values (field name -> value) of the same run.

    Raises:
        UsageError: a refused or unknown flag, a bad value, data or a model that is not there.
    """
    parsed = FRONT_END.parse(argv)
    values: dict[str, Any] = {**CLM_DEFAULTS, **parsed.values}
    own: RunClmOnly = parsed.own
    if world_size is None:
        _one_accelerate_process_notice()
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    values["replication_factor"] = world_size  # one replica per process, as accelerate's DDP
    _data(values, own)
    positions = _model(values, own)
    _block_size(values, own.block_size, positions)
    _schedule(values, own)
    _precision(values, own.precision)
    _output(values, own)
    _tracking(values, own)
    return values


def parse_args(argv: Sequence[str], world_size: int | None = None) -> TrainConfig:
    return TrainConfig.from_flat(translate(argv, world_size))


def _one_accelerate_process_notice() -> None:
    """`accelerate launch --num_processes N` (N > 1) without GPUs takes its simple launcher: one process,
    given MASTER_ADDR but no WORLD_SIZE (accelerate 1.x has no --multi_cpu launch flag; CPU processes
    come from an mpirun hostfile). Say so in one line instead of training alone silently."""
    env = os.environ
    if "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        log.notice("accelerate launch started one process here (without GPUs its --num_processes N starts one "
                   "unless given --mpirun_hostfile); for N processes on this machine run torchrun "
                   "--nproc_per_node N train_clm.py ...")


def _data(values: dict, own: RunClmOnly) -> None:
    """--dataset_name, or --train_file (and --validation_file): the `hf` reader's inputs."""
    name, train, valid = own.dataset_name, own.train_file, own.validation_file
    if name is None and train is None:
        raise UsageError("Need either a dataset name or a training file: pass --dataset_name (a local datasets "
                         "folder or cached name) or --train_file")
    values["dataset"] = "hf"
    if name is not None:
        if train is not None or valid is not None:
            log.notice(f"--dataset_name {name} is read; --train_file/--validation_file are ignored (as in run_clm)")
        values["input_files"] = [name]
        return
    for flag_name, path in (("--train_file", train), ("--validation_file", valid)):
        if path is not None and Path(path).suffix.lower() not in (".txt", ".json", ".jsonl", ".csv"):
            raise UsageError(f"{flag_name} {path}: should be a .txt, .json, .jsonl or .csv file")
    values["input_files"] = [train]
    if valid is not None:
        values["valid_data_path"] = [valid]


def resolve_model_folder(value: str, flag_name: str) -> Path:
    """A local folder, or a hub id found in the local Hugging Face cache (never downloaded)."""
    folder = local_or_hub_cached(value)
    if folder is not None and folder.is_dir():
        return folder
    raise UsageError(f"{flag_name} {value}: no such folder, and not in the local Hugging Face cache (nothing is "
                     "downloaded at run time); on a machine with internet run `huggingface-cli download "
                     f"{value} --local-dir DIR` and pass DIR")


def _model_positions(path: Path, flag_name: str) -> int:
    """The positions of a GPT-2 or GPT-Neo config.json (UsageError, one line, for anything else)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag_name} {path}: not a readable config.json ({type(exc).__name__}); pass a folder "
                         "written by save_pretrained") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag_name} {path}: not a model config (a JSON object)")
    model_type = config.get("model_type", "gpt2")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"{flag_name} {path}: model_type {model_type!r}; this trainer trains GPT-2 (gpt2) and "
                         "GPT-Neo (gpt_neo), whose nn.Linear layers K-FAC preconditions")
    return hf_config_positions(config, source=f"{flag_name} {path}")


def _model(values: dict, own: RunClmOnly) -> int:
    """--model_name_or_path / --config_name / --tokenizer_name; returns the model's positions."""
    model, config, tokenizer = own.model, own.config, own.tokenizer
    positions = 1024  # GPT2Config()'s, the model run_clm builds from --model_type gpt2
    if config is not None:
        path = Path(config) if Path(config).is_file() else resolve_model_folder(config, "--config_name") / "config.json"
        positions = _model_positions(path, "--config_name")
        values["model_config"] = str(path)
        values["max_position_embeddings"] = positions  # a new model keeps its config's position table
    if model is not None:
        folder = resolve_model_folder(model, "--model_name_or_path")
        positions = _model_positions(folder / "config.json", "--model_name_or_path")
        values["checkpoint_input_dir"] = str(folder)
        if tokenizer is None and _own_tokenizer(folder):
            tokenizer = str(folder)
    if tokenizer is not None:
        values["tokenizer_name_or_path"] = str(resolve_model_folder(tokenizer, "--tokenizer_name"))
    if model is None and config is None:
        values["max_position_embeddings"] = positions  # GPT2Config()'s position table, whatever the block size
    return positions


def _own_tokenizer(folder: Path) -> bool:
    """Whether a model folder ships a tokenizer other than GPT-2's (GPT-2's is the default here)."""
    if (folder / HF_FILE).is_file():
        return True
    vocab, merges = folder / VOCAB_FILE, folder / MERGES_FILE
    return vocab.is_file() and merges.is_file() and not is_gpt2_files(vocab, merges)


def _block_size(values: dict, block: int | None, positions: int) -> None:
    """run_clm: --block_size, at most the model's positions; by default the positions, at most 1024."""
    if block is None:
        values["max_len"] = min(1024, positions)
    elif block > positions:
        log.notice(f"--block_size {block} is larger than the model's {positions} positions; using {positions} "
                   "(as run_clm)")
        values["max_len"] = positions
    else:
        values["max_len"] = block


def _schedule(values: dict, own: RunClmOnly) -> None:
    """--lr_scheduler_type and --num_warmup_steps: transformers' get_scheduler as this trainer's schedule."""
    name = own.scheduler
    if name not in SCHEDULERS:
        raise UsageError(f"--lr_scheduler_type {name}: choose one of {', '.join(SCHEDULERS)}")
    schedule, warms, floor = SCHEDULERS[name]
    warmup = own.warmup
    if warmup and not warms:
        log.notice(f"--num_warmup_steps {warmup}: --lr_scheduler_type constant has no warm-up (transformers' "
                   "get_constant_schedule); use constant_with_warmup")
    values.update(lr_schedule=schedule, lr_warmup_steps=warmup if warms else 0, min_lr=floor)


def _precision(values: dict, asked: str | None) -> None:
    """--mixed_precision (or accelerate launch's): the precision, with GradScaler's fp16 scaling."""
    name = asked or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    precisions = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
    if name not in precisions:
        raise UsageError(f"--mixed_precision {name}: no, fp16 or bf16 here (fp8 is not available)")
    values["precision"] = precisions[name]
    if name == "fp16":  # torch.amp.GradScaler's dynamic scaling, which accelerate uses
        values.update(auto_loss_scaling=True, initial_loss_scale=2.0 ** 16, loss_scale_window=2000,
                      loss_scale_hysteresis=1)


def _output(values: dict, own: RunClmOnly) -> None:
    """--output_dir, --checkpointing_steps, --resume_from_checkpoint: the final model, checkpoints, resuming."""
    out, every, resume = own.output_dir, own.checkpointing, own.resume
    if out is not None:
        values["final_model_dir"] = out
    root = out or "."  # run_clm saves step_N/ in the working directory without --output_dir
    if every is not None:
        values["checkpoint_output_dir"] = root
        if every == "epoch":
            values["save_per_epochs"] = 1
        elif every.isdigit() and int(every) > 0:
            values.update(save_per_steps=int(every), save_per_epochs=0)
        else:
            raise UsageError(f"--checkpointing_steps {every}: a number of updates or 'epoch'")
    if resume is None:
        return
    if resume == "":  # bare: the newest checkpoint of the run's folder, or a new run when there is none
        values.setdefault("checkpoint_output_dir", root)
        values.setdefault("save_per_epochs", 0)
        values["auto_resume"] = True
        return
    path = Path(resume)
    if any((path / f).is_file() for f in ACCELERATE_STATE):
        raise UsageError(f"--resume_from_checkpoint {resume}: an accelerate save_state folder (pickled optimizer and "
                         "RNG state, not read here); resume from a step_N/ this trainer wrote, or start from the "
                         "weights with --model_name_or_path")
    values.update(checkpoint_input_dir=resume, resume_training_from_checkpoint=True)


def _tracking(values: dict, own: RunClmOnly) -> None:
    """--with_tracking --report_to: TensorBoard where accelerate's tracker writes, W&B."""
    report = own.report_to
    if not own.tracking:
        return
    if report not in TRACKERS:
        raise UsageError(f"--report_to {report}: tensorboard, wandb or all here")
    root = values.get("final_model_dir") or "."
    if report in ("tensorboard", "all"):
        values["tensorboard_dir"] = str(Path(root) / "clm_no_trainer")  # accelerate's project_dir / run name
    if report == "wandb" or (report == "all" and _installed("wandb")):
        values["use_wandb"] = True


def _installed(module: str) -> bool:
    import importlib.util  # lazy, as this is asked once
    return importlib.util.find_spec(module) is not None
