"""The training run's configuration: typed sections composed into one TrainConfig, one parse.

Every field is a command-line flag (`learning_rate` -> `--learning-rate`); the reference's flag
names and its older aliases keep working, and flag names are flat (no section prefix). Precedence:
dataclass defaults < `--config FILE` (JSON or YAML, keys are field or flag names) < command line.
The resolved config is saved flat (`to_dict`) as `train_config.json` next to every checkpoint.

Sections (attribute: class): arch: ModelArgs, data: DataArgs, optim: OptimizerArgs, kfac: KfacArgs,
runtime: RuntimeArgs, memory: MemoryArgs, parallel: ParallelArgs, checkpoint: CheckpointArgs, logging:
LoggingArgs, eval: EvalArgs. The sections that packages below train/ consume are defined there
(ParallelArgs in parallel/topology.py, MemoryArgs in parallel/memory_plan.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from gpt2forge.core.errors import UsageError, collect
from gpt2forge.core.flags import flag, opt, positive
from gpt2forge.data.contract import WINDOWS
from gpt2forge.parallel.memory_plan import MemoryArgs
from gpt2forge.parallel.topology import ParallelArgs


@dataclasses.dataclass
class ModelArgs:
    """Model: its size or shape and the sequence length."""

    model: str = opt("gpt2", "model size, a file in config/",
                     choices=("gpt2-test", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"))
    """Name of a model-size file in config/ (ignored when model_config is given)."""
    model_config: str | None = opt(None, "(new) any Hugging Face GPT-2 config.json as the model shape; "
                                   "overrides --model")
    """Path of a Hugging Face GPT-2 config.json; None: use `model`."""
    max_len: int = opt(128, "sequence length in tokens; sets n_positions of a fresh model")
    """Sequence length in tokens of every training sample."""
    hidden_dropout: float | None = opt(None, "(new) override the model's residual and embedding dropout "
                                       "(Megatron's --hidden-dropout; fine-tuning often uses 0.0 or 0.1)")
    """Residual/embedding dropout probability; None: the model config's."""
    attention_dropout: float | None = opt(None, "(new) override the model's attention dropout (Megatron's "
                                          "--attention-dropout)")
    """Attention-probability dropout; None: the model config's."""
    num_layers: int | None = opt(None, "(new) override the model's number of blocks (Megatron's --num-layers)")
    """n_layer of a fresh model; None: the config's."""
    hidden_size: int | None = opt(None, "(new) override the model's width (Megatron's --hidden-size)")
    """n_embd of a fresh model; None: the config's."""
    num_attention_heads: int | None = opt(None, "(new) override the model's attention heads "
                                          "(Megatron's --num-attention-heads)")
    """n_head of a fresh model; None: the config's."""
    ffn_hidden_size: int | None = opt(None, "(new) override the MLP width (Megatron's --ffn-hidden-size; "
                                      "default 4 x width)")
    """n_inner of a fresh model; None: the config's (4 x n_embd)."""
    max_position_embeddings: int | None = opt(None, "(new) position-table size of a fresh model (Megatron's "
                                              "--max-position-embeddings; default: --max-len)")
    """n_positions of a fresh model (>= max_len); None: max_len."""
    init_method_std: float | None = opt(None, "(new) standard deviation of a fresh model's weight initialisation "
                                        "(Megatron's --init-method-std; GPT-2: 0.02)")
    """initializer_range of a fresh model; None: the config's."""

    def __post_init__(self) -> None:
        problems = positive(self, "max_len", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                            "max_position_embeddings", optional=True)
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.max_len:
            problems.append(f"--max-position-embeddings {self.max_position_embeddings} is smaller than --max-len "
                            f"{self.max_len}; the position table must cover the sequence")
        if self.init_method_std is not None and self.init_method_std <= 0:
            problems.append("--init-method-std must be > 0")
        problems += [f"--{flag(name)} must be in [0, 1) (got {value})"
                     for name in ("hidden_dropout", "attention_dropout")
                     if (value := getattr(self, name)) is not None and not 0 <= value < 1]
        collect(problems)


@dataclasses.dataclass
class DataArgs:
    """Data: source, files, tokenizer, splits, loading and the seed."""

    dataset: str | None = opt(None, "data source: generated | pickle | tfrecord | mmap | jsonl | text | hf (old: "
                              "--train-path generated|<file.pkl>|tfrecord|dynamic); hf: a Hugging Face `datasets` "
                              "dataset or .txt/.json/.jsonl/.csv files read through the `datasets` library, each "
                              "record tokenized, concatenated and cut into blocks of --max-len tokens (run_clm's "
                              "group_texts)",
                              choices=("generated", "pickle", "tfrecord", "mmap", "jsonl", "text", "hf"))
    """Reader name; None only with --compile-only or --plan."""
    input_files: list[str] | None = opt(None, "data files: the .pkl for pickle, 'DIR/*.tfrecord' (with their "
                                        ".index files) for tfrecord, PREFIX of PREFIX.bin/.idx for mmap, or a "
                                        "weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' (Megatron's --data-path); "
                                        "files or globs for jsonl and text; for hf a datasets folder (save_to_disk, "
                                        "or data files), a dataset name in the local datasets cache, or "
                                        ".txt/.json/.jsonl/.csv files or globs (run_clm's --train_file)",
                                        "--data-prefix", "--tfrecord-path", "--data-path", kind="list_str")
    """Paths, glob patterns or prefixes the reader opens (mmap: optionally weighted, Megatron's syntax)."""
    train_data_path: list[str] | None = opt(None, "(new) mmap: training data alone ('[W1] PREFIX1 ...'), with "
                                            "--valid-data-path and --test-data-path instead of --split (Megatron's)",
                                            kind="list_str")
    """Training prefixes (optionally weighted); None: from input_files and split."""
    valid_data_path: list[str] | None = opt(None, "(new) mmap: validation data ('[W1] PREFIX1 ...'); jsonl and text: "
                                            "validation files, the --input-files still split by --split (seed "
                                            "001's Megatron --valid-data; mmap with --input-files too); hf: "
                                            "validation files of the --input-files kind (run_clm's --validation_file)",
                                            kind="list_str")
    """Validation prefixes (optionally weighted) for mmap; validation files for jsonl, text and hf."""
    test_data_path: list[str] | None = opt(None, "(new) mmap: test data ('[W1] PREFIX1 ...'); jsonl and text: test "
                                           "files, the --input-files still split by --split; evaluated at the end "
                                           "of training", kind="list_str")
    """Test prefixes (optionally weighted) for mmap, test files for jsonl and text; evaluated once after training."""
    json_key: str = opt("text", "(new) jsonl: the key holding each document's text (Megatron's --json-keys); hf: "
                        "the text column (when the data has no such column and this is `text`: the first column, "
                        "as run_clm)")
    """JSON key of the document text for --dataset jsonl; the text column for --dataset hf."""
    data_cache_dir: str | None = opt(None, "(new) jsonl, text and hf: where the tokenized cache (.bin/.idx; hf: "
                                     ".npy blocks) and its manifest are written (default: a .gpt2forge_cache folder "
                                     "beside the first input file or the dataset folder; hf dataset names: in the "
                                     "datasets cache)")
    """Cache folder of tokenized raw text; None: beside the inputs."""
    dataset_config_name: str | None = opt(None, "(new) hf: the dataset's configuration name (run_clm's "
                                          "--dataset_config_name)")
    """Configuration of a datasets dataset; None: its default."""
    validation_split_percentage: int = opt(5, "(new) hf with no validation split or --valid-data-path: the first "
                                           "N percent of the training records are the validation set, the rest train "
                                           "(run_clm's; 0: no validation)")
    """Percent of the training records held out for validation when the data has no validation split, in [0, 100)."""
    keep_linebreaks: bool = opt(True, "(new) hf: .txt records keep each line's newline (run_clm_no_trainer's "
                                "default; --keep-linebreaks False is its --no_keep_linebreaks)", kind="bool")
    """Keep the trailing newline of each .txt line."""
    preprocessing_workers: int | None = opt(None, "(new) hf: processes tokenizing (run_clm's "
                                            "--preprocessing_num_workers; default: this process); as in run_clm it "
                                            "changes the blocks, since each worker drops its batches' remainders")
    """datasets.map num_proc of the tokenizing; None: in this process."""
    overwrite_cache: bool = opt(False, "(new) hf: rebuild the tokenized blocks even when cached (run_clm's "
                                "--overwrite_cache)", kind="bool")
    """Rebuild the hf block cache."""
    loss_on: str = opt("all", "(new) which tokens carry loss: all | completion (prompt/completion JSONL: prompt "
                       "tokens are masked)", choices=("all", "completion"))
    """Loss on every token, or only on completion tokens of prompt/completion records."""
    reset_position_ids: bool = opt(False, "(new) positions restart at 0 after each end-of-document token "
                                   "(Megatron's)", kind="bool")
    """Restart position ids after every EOD token."""
    reset_attention_mask: bool = opt(False, "(new) a token attends only within its own document of a packed "
                                     "sample (block-causal mask; Megatron's)", kind="bool")
    """Block-diagonal causal attention over the documents of a sample."""
    eod_mask_loss: bool = opt(False, "(new) no loss where the input token is end-of-document, i.e. on the next "
                              "document's first token (Megatron's)", kind="bool")
    """Mask the loss at positions whose input token is the EOD token (Megatron's loss_mask)."""
    tokenizer_name_or_path: str | None = opt(None, "(new) local tokenizer folder the data was made with "
                                             "(data/train_tokenizer.py output: tokenizer.json, or vocab.json + "
                                             "merges.txt); a fresh model takes its vocab_size and checkpoints "
                                             "ship its files; default: GPT-2's BPE")
    """Tokenizer folder; None: GPT-2's BPE."""
    stride: int = opt(128, "pickle: sliding-window stride in tokens")
    """Tokens between the starts of consecutive pickle windows."""
    val_num: int = opt(0, "pickle: windows held out for validation (evaluated after each epoch)")
    """Pickle windows held out for validation."""
    windows: str = opt("document", "(new) pickle: how training windows are drawn: document (the reference's: "
                       "per document, overlapping tail, short documents padded) | packed (documents end to end, "
                       "cut every --stride tokens, as Megatron) | random (uniform starts in that stream each "
                       "epoch, as nanoGPT); validation windows are the same in all three", choices=WINDOWS)
    """Training-window sampling of the pickle reader; held-out windows do not depend on it."""
    split: str = opt("969,30,1", "(new) mmap and tfrecord: train,valid,test weights over documents (mmap) or "
                     "records (tfrecord), Megatron's --split; valid is evaluated as validation loss")
    """Comma-separated train,valid,test weights."""
    verify: bool = opt(False, "(new) tfrecord: read every record on open and check its CRCs, payload and "
                       "token ids (mmap data is always checked on open)", kind="bool")
    """Check every tfrecord record on open."""
    seed: int = opt(1234, "seeds weights, dropout and data order: CPU runs are bit-reproducible")
    """Seed of weights, dropout and data order."""
    num_workers: int = opt(4, "DataLoader worker processes (at most the CPUs this process may use)")
    """DataLoader worker processes (0: load in the training process)."""
    async_dataloader: bool = opt(False, "background prefetch of batches (pinned memory on CUDA)", kind="bool")
    """Prefetch batches in the background."""

    def __post_init__(self) -> None:
        problems = positive(self, "stride")
        problems += [f"--{flag(name)} must be >= 0" for name in ("val_num", "num_workers")
                     if getattr(self, name) < 0]
        problems += positive(self, "preprocessing_workers", optional=True)
        if not 0 <= self.validation_split_percentage < 100:
            problems.append("--validation-split-percentage must be in [0, 100) "
                            f"(got {self.validation_split_percentage})")
        held_out_ok = ("mmap", "jsonl", "text", "hf") if self.valid_data_path else ("mmap", "jsonl", "text")
        split_paths = self.train_data_path and self.dataset != "mmap" or (
            (self.valid_data_path or self.test_data_path) and self.dataset not in held_out_ok)
        if self.dataset in ("pickle", "tfrecord", "jsonl", "text", "hf") and not self.input_files:
            problems.append(f"--dataset {self.dataset} needs --input-files PATH")
        if self.dataset == "mmap" and not (self.input_files or self.train_data_path):
            problems.append("--dataset mmap needs --input-files PREFIX (or W1 PREFIX1 W2 PREFIX2 ...) or "
                            "--train-data-path")
        if split_paths:
            problems.append("--train-data-path needs --dataset mmap; --valid-data-path and --test-data-path go with "
                            "mmap, jsonl and text (--valid-data-path also with hf)")
        if self.loss_on == "completion" and self.dataset not in ("jsonl", None):
            problems.append("--loss-on completion needs --dataset jsonl with prompt/completion records")
        collect(problems)


@dataclasses.dataclass
class OptimizerArgs:
    """Optimizer, learning-rate schedule, run length and gradient safety."""

    epochs: int = opt(1, "passes over the training data")
    """Passes over the training data (0 only with training_steps)."""
    training_steps: int | None = opt(None, "stop after this many logged (host) steps; overrides --epochs")
    """Host steps to run; None: run `epochs`."""
    optimizer: str = opt("AdamW", "AdamW | Adam | LAMB | LAMBNoBiasCorrection",
                         choices=("AdamW", "Adam", "LAMB", "LAMBNoBiasCorrection"))
    """Optimizer name."""
    weight_decay: float = opt(0.0, "weight decay on parameters with 2 or more dimensions")
    """Decoupled weight decay of matrices (parameters with >= 2 dimensions)."""
    learning_rate: float = opt(1e-5, "peak learning rate")
    """Peak learning rate, reached at the end of warm-up."""
    adam_beta1: float = opt(0.9, "(new) Adam/AdamW/LAMB first-moment decay rate")
    """Decay rate of the gradient's running mean, in [0, 1)."""
    adam_beta2: float = opt(0.999, "(new) Adam/AdamW/LAMB second-moment decay rate")
    """Decay rate of the squared gradient's running mean, in [0, 1)."""
    adam_eps: float = opt(1e-8, "(new) Adam/AdamW/LAMB denominator epsilon (PyTorch, Hugging Face, Megatron and "
                          "nanoGPT use 1e-8; the reference's 1e-6 learns less per update: --adam-eps 1e-6 restores it)")
    """Added to the root of the second moment; the reference's QUIRK value 1e-6 is available by flag."""
    lr_schedule: str = opt("constant", "constant | linear | cosine, each after a linear warm-up",
                           choices=("constant", "linear", "cosine"))
    """Shape of the schedule after warm-up."""
    lr_warmup: float = opt(0.1, "warm-up as a fraction of the decay steps")
    """Warm-up length as a fraction of the schedule."""
    lr_warmup_steps: int | None = opt(None, "warm-up in optimizer updates (overrides --lr-warmup)")
    """Warm-up length in optimizer updates; None: from lr_warmup."""
    lr_decay_steps: int | None = opt(None, "schedule length in optimizer updates (default: the whole run)")
    """Schedule length in optimizer updates; None: the whole run."""
    max_grad_norm: float | None = opt(None, "(new) clip the global gradient norm to this value")
    """Global gradient-norm clip; None: no clipping."""
    min_lr: float = opt(0.0, "(new) linear and cosine decay end at this learning rate (Megatron's and nanoGPT's "
                        "--min-lr)")
    """Floor of the decayed learning rate."""
    train_samples: int | None = opt(None, "(new) train on this many samples (Megatron's --train-samples; the "
                                    "host steps are it / samples per step, rounded up); overrides --epochs")
    """Samples to train on; None: from training_steps or epochs."""
    lr_decay_samples: int | None = opt(None, "(new) schedule length in samples (Megatron's; overrides "
                                       "--lr-decay-steps)")
    """Schedule length in samples; None: lr_decay_steps."""
    lr_warmup_samples: int | None = opt(None, "(new) warm-up in samples (Megatron's; overrides --lr-warmup-steps)")
    """Warm-up length in samples; None: lr_warmup_steps or lr_warmup."""
    max_nonfinite_updates: int = opt(10, "(new) updates with non-finite gradients are skipped (the learning rate "
                                     "holds); stop the run after this many in a row. An fp16 overflow that dynamic "
                                     "loss scaling answers by lowering the scale (above --min-loss-scale) is not "
                                     "counted")
    """Consecutive skipped (non-finite) updates that stop the run, fp16 overflows above the dynamic scale's floor
    not counted."""

    def __post_init__(self) -> None:
        problems = positive(self, "training_steps", "lr_decay_steps", "train_samples", "lr_decay_samples",
                            optional=True)
        if self.lr_warmup_samples is not None and self.lr_warmup_samples < 0:
            problems.append("--lr-warmup-samples must be >= 0")
        if self.min_lr < 0 or self.min_lr > self.learning_rate:
            problems.append(f"--min-lr {self.min_lr} must be in [0, --learning-rate {self.learning_rate}]")
        if self.epochs < 0:
            problems.append("--epochs must be >= 0")
        if self.epochs == 0 and self.training_steps is None and self.train_samples is None:
            problems.append("--epochs 0 trains nothing; give --epochs >= 1 or --training-steps")
        if self.learning_rate < 0 or self.weight_decay < 0:
            problems.append("--learning-rate and --weight-decay must be >= 0")
        problems += positive(self, "max_nonfinite_updates")
        problems += [f"--adam-{name} must be in [0, 1) (got {value})"
                     for name, value in (("beta1", self.adam_beta1), ("beta2", self.adam_beta2)) if not 0 <= value < 1]
        if self.adam_eps < 0:
            problems.append(f"--adam-eps must be >= 0 (got {self.adam_eps})")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            problems.append("--max-grad-norm must be > 0")
        collect(problems)


@dataclasses.dataclass
class KfacArgs:
    """K-FAC: a second-order preconditioner of the blocks' nn.Linear gradients (docs/training.md#k-fac)."""

    kfac: bool = opt(False, "(new) precondition the gradients of the blocks' nn.Linear layers with K-FAC "
                     "(kfac-pytorch's design) before clipping and the optimizer's step", kind="bool")
    """Turn the K-FAC preconditioner on."""
    kfac_factor_update_steps: int = opt(5, "(new) K-FAC: fold the layers' activation and output-gradient "
                                        "covariances into their running averages every N updates")
    """Updates between factor updates (the hooks run only on those updates)."""
    kfac_inv_update_steps: int = opt(50, "(new) K-FAC: recompute the factors' eigendecompositions (or inverses) "
                                     "every N updates")
    """Updates between decompositions of the factors."""
    kfac_damping: float = opt(0.001, "(new) K-FAC: Tikhonov damping added to the Kronecker product's "
                              "eigenvalues (eigen) or to each factor's diagonal (inverse)")
    """Damping lambda, > 0."""
    kfac_factor_decay: float = opt(0.95, "(new) K-FAC: running average of the factors: decay x old + (1 - decay) "
                                   "x new")
    """Running-average coefficient of the factors, in (0, 1]."""
    kfac_kl_clip: float = opt(0.001, "(new) K-FAC: scale the preconditioned gradients by min(1, sqrt(kl_clip / "
                              "(lr^2 sum(v . g)))); 0 turns the scaling off")
    """KL clipping bound; 0: no scaling."""
    kfac_skip_layers: list[str] | None = opt(None, "(new) K-FAC: regular expressions; an nn.Linear whose name or "
                                             "class name matches one is not preconditioned (default: wte wpe "
                                             "lm_head, the embeddings and the tied LM head)", kind="list_str")
    """Skip patterns (re.search against the module's name and class name); None: the embeddings and the LM head."""
    kfac_compute_method: str = opt("eigen", "(new) K-FAC: eigen (eigendecompositions, damping on the Kronecker "
                                   "product) | inverse (damped inverses of each factor)", choices=("eigen", "inverse"))
    """How the factors are turned into a preconditioner."""

    def __post_init__(self) -> None:
        problems = positive(self, "kfac_factor_update_steps", "kfac_inv_update_steps")
        if not self.kfac_damping > 0:
            problems.append(f"--kfac-damping must be > 0 (got {self.kfac_damping})")
        if not 0 < self.kfac_factor_decay <= 1:
            problems.append(f"--kfac-factor-decay must be in (0, 1] (got {self.kfac_factor_decay})")
        if self.kfac_kl_clip < 0:
            problems.append(f"--kfac-kl-clip must be >= 0 (got {self.kfac_kl_clip})")
        for pattern in self.kfac_skip_layers or ():
            try:
                re.compile(pattern)
            except re.error as exc:
                problems.append(f"--kfac-skip-layers {pattern!r}: not a regular expression ({exc})")
        collect(problems)


@dataclasses.dataclass
class RuntimeArgs:
    """Device, precision, compilation and the run modes that train nothing."""

    device: str = opt("auto", "(new) auto | cpu | cuda | cuda:N")
    """Device to train on; auto: CUDA when present."""
    precision: str = opt("auto", "(new) auto | fp32 | bf16 | fp16 (auto: bf16 on CUDA, fp32 on CPU)",
                         choices=("auto", "fp32", "bf16", "fp16"))
    """Compute precision (fp32 master weights in every case)."""
    loss_scaling: float = opt(50000.0, "fp16: static loss scale (initial scale with --auto-loss-scaling)")
    """fp16 loss scale, > 0."""
    auto_loss_scaling: bool = opt(False, "fp16: dynamic loss scaling", kind="bool")
    """Adjust the fp16 loss scale as gradients overflow."""
    initial_loss_scale: float = opt(1.0, "(new) fp16 dynamic scaling: the first scale (Megatron's "
                                    "--initial-loss-scale; 1.0 as the reference's --auto-loss-scaling)")
    """First scale of dynamic loss scaling."""
    loss_scale_window: int = opt(2000, "(new) fp16 dynamic scaling: clean updates before the scale doubles "
                                 "(Megatron's --loss-scale-window)")
    """Updates without overflow before the dynamic scale doubles."""
    min_loss_scale: float = opt(1.0, "(new) fp16 dynamic scaling: the scale never goes below this "
                                "(Megatron's --min-loss-scale)")
    """Floor of the dynamic loss scale."""
    loss_scale_hysteresis: int = opt(1, "(new) fp16 dynamic scaling: overflowing updates tolerated before the scale "
                                     "halves (Megatron's --hysteresis)")
    """Overflows before the dynamic scale halves (each one's update is skipped)."""
    enable_half_partials: bool = opt(False, "reduced-precision matmul accumulation where the device allows it",
                                     kind="bool")
    """Allow reduced-precision matmul accumulation."""
    torch_compile: str = opt("auto", "(new) torch.compile the model: auto (on CUDA) | true | false",
                             choices=("auto", "true", "false"))
    """Whether to torch.compile the model."""
    deterministic: str = opt("auto", "(new) deterministic algorithms, so a run repeats bit for bit, compiled too: "
                             "auto (on the CPU, where it costs nothing measurable) | true | false (Megatron's "
                             "--deterministic-mode)", choices=("auto", "true", "false"))
    """torch.use_deterministic_algorithms for the run (runtime.deterministic_algorithms)."""
    executable_cache_dir: str | None = opt(None, "torch.compile cache directory (the IPU executable cache)")
    """torch.compile cache directory; None: the default."""
    custom_ops: bool = opt(True, "load the C++ custom ops library built by `make` when present", kind="bool")
    """Load the built custom-op library when present (else the PyTorch references)."""
    compile_only: bool = opt(False, "compile the training step on generated data, print the time, exit",
                             kind="bool")
    """Compile and time the step, then exit."""
    plan: bool = opt(False, "(new) print the memory each process of the layout needs, per pipeline stage, and "
                     "whether it fits this machine; trains nothing", "--dry-run", kind="bool")
    """Print the memory plan, then exit."""

    def __post_init__(self) -> None:
        problems = positive(self, "loss_scale_window", "loss_scale_hysteresis")
        problems += [f"--{flag(name)} must be > 0" for name in ("loss_scaling", "initial_loss_scale", "min_loss_scale")
                     if getattr(self, name) <= 0]
        collect(problems)


@dataclasses.dataclass
class CheckpointArgs:
    """Checkpoints: initial weights, where and when to save, resuming."""

    checkpoint_input_dir: str = opt("", "initial weights: our checkpoint or a Hugging Face GPT-2 directory "
                                    "(or a checkpoint root holding a `latest` file)", "--pretrained-checkpoint")
    """Directory of initial weights; '': a fresh model."""
    checkpoint_output_dir: str | None = opt(None, "where step_N/ and epoch_N/ checkpoints are written; "
                                            "nothing is saved when unset", "--save-model-path")
    """Root of the run's checkpoints; None: nothing is saved."""
    save_per_epochs: int = opt(1, "save epoch_N/ every N epochs (0: no epoch checkpoints)")
    """Epochs between epoch_N/ checkpoints; 0: none."""
    save_per_steps: int | None = opt(None, "save step_N/ every N host steps")
    """Host steps between step_N/ checkpoints; None: none."""
    resume_training_from_checkpoint: bool = opt(False, "continue the run saved in --checkpoint-input-dir "
                                                "(optimizer, schedule, step, data position, RNG)", kind="bool")
    """Restore the whole training state, not only the weights."""
    auto_resume: bool = opt(False, "(new) continue from the latest checkpoint in --checkpoint-output-dir when "
                            "there is one, else start as asked (for requeued or restarted jobs)", kind="bool")
    """Resume from the newest checkpoint of checkpoint_output_dir when there is one."""
    exit_signal_handler: bool = opt(True, "(new) on SIGTERM or SIGUSR1 (Slurm preemption) finish the current "
                                    "update, save a checkpoint (with --checkpoint-output-dir) and exit 0, so a "
                                    "requeued job continues with --auto-resume (Megatron's --exit-signal-handler)",
                                    kind="bool")
    """Save and exit cleanly on SIGTERM/SIGUSR1."""
    keep_checkpoints: int | None = opt(None, "(new) keep only the N newest checkpoints in --checkpoint-output-dir "
                                       "(older step_N/ and epoch_N/ are deleted after each save)")
    """Checkpoints kept; None: all."""
    final_model_dir: str | None = opt(None, "(new) after training, write the final model and its tokenizer here in "
                                      "the Hugging Face layout (from_pretrained opens it), with all_results.json "
                                      "(the last validation perplexity): what run_clm leaves in --output_dir")
    """Folder of the final model; None: only the checkpoints."""

    def __post_init__(self) -> None:
        problems = positive(self, "save_per_steps", optional=True)
        if self.save_per_epochs < 0:
            problems.append(f"--save-per-epochs must be >= 0 (got {self.save_per_epochs})")
        if self.resume_training_from_checkpoint and not self.checkpoint_input_dir:
            problems.append("--resume-training-from-checkpoint needs --checkpoint-input-dir DIR")
        if self.auto_resume and not self.checkpoint_output_dir:
            problems.append("--auto-resume needs --checkpoint-output-dir DIR (where the run's checkpoints are)")
        problems += positive(self, "keep_checkpoints", optional=True)
        collect(problems)


@dataclasses.dataclass
class LoggingArgs:
    """Logging: the step line, metrics files, dashboards and the profiler."""

    log_steps: int = opt(1, "print the step line every N host steps")
    """Host steps between step lines."""
    use_wandb: bool = opt(False, "log metrics to Weights & Biases (needs the wandb package)", kind="bool")
    """Also log to Weights & Biases."""
    metrics_file: str | None = opt(None, "(new) JSON-lines file of every step's and evaluation's metrics (plot it "
                                   "with gpt2forge-plot); default: metrics.jsonl in --checkpoint-output-dir, "
                                   "else runs/<run name>/metrics.jsonl")
    """Path of the metrics JSON-lines file; None: the default place."""
    tensorboard_dir: str | None = opt(None, "(new) also write TensorBoard scalars here (loss, lr, throughput, MFU, "
                                      "memory, grad norm when known, validation)")
    """TensorBoard log directory; None: no TensorBoard."""
    profile_steps: str | None = opt(None, "(new) profile host steps A to B (counting from 1, both included), "
                                    "e.g. 3:4, with the PyTorch profiler (CPU and CUDA)")
    """'A:B' host steps to profile; None: no profiling."""
    profile_dir: str | None = opt(None, "(new) where --profile-steps writes trace.json (Chrome/Perfetto) and "
                                  "top_ops.txt; default: profile/ beside the metrics file")
    """Profiler output directory; None: profile/ beside the metrics file."""

    log_format: str = opt("graphcore", "(new) the step line: graphcore (the reference's) | megatron (Megatron-LM's "
                          "`iteration N/ M | consumed samples: ...` for its users' log parsers) | run_clm (the "
                          "graphcore step line, and Hugging Face run_clm's `epoch N: perplexity: P eval_loss: L` "
                          "after each validation)", choices=("graphcore", "megatron", "run_clm"))
    """Layout of the step and validation lines."""

    def __post_init__(self) -> None:
        collect(positive(self, "log_steps"))


@dataclasses.dataclass
class EvalArgs:
    """Evaluation during training and the sample printed after it."""

    eval_every_steps: int | None = opt(None, "(new) evaluate the validation set every N host steps",
                                       "--eval-steps")
    """Host steps between validation runs; None: after each epoch only."""
    eval_wikitext: str | None = opt(None, "(new) WikiText file: log a quick perplexity (first 16 windows of "
                                    "--max-len tokens) whenever the validation set is evaluated")
    """WikiText file for a quick perplexity; None: none."""
    eval_lambada: str | None = opt(None, "(new) LAMBADA jsonl: log a quick cloze accuracy (first 128 passages, "
                                   "non-strict) whenever the validation set is evaluated")
    """LAMBADA jsonl for a quick cloze accuracy; None: none."""
    sample_tokens: int = opt(0, "(new) after training, print a sample of this many generated tokens")
    """Tokens to generate after training; 0: no sample."""
    sample_prompt: str = opt("\n", "(new) prompt of that sample")
    """Prompt of the sample."""
    eval_iters: int | None = opt(None, "(new) score at most this many validation batches of one update's samples "
                                 "each time (Megatron's --eval-iters; default: the whole validation set)")
    """Validation batches (of samples_per_update sequences) per evaluation; None: all."""

    def __post_init__(self) -> None:
        problems = positive(self, "eval_every_steps", "eval_iters", optional=True)
        if self.sample_tokens < 0:
            problems.append("--sample-tokens must be >= 0")
        collect(problems)


def _cross_section_problems(dataset: str | None, compile_only: bool, plan: bool) -> list[str]:
    if dataset is None and not (compile_only or plan):
        return ["--dataset is required: generated | pickle | tfrecord | mmap (with --input-files PATH)"]
    return []


SECTIONS: dict[str, type] = {
    "arch": ModelArgs, "data": DataArgs, "optim": OptimizerArgs, "kfac": KfacArgs, "parallel": ParallelArgs,
    "memory": MemoryArgs, "runtime": RuntimeArgs, "checkpoint": CheckpointArgs, "logging": LoggingArgs,
    "eval": EvalArgs,
}
"""TrainConfig attribute -> section class, in --help order."""

FIELD_SECTION: dict[str, str] = {f.name: attr for attr, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
"""Flat field (flag) name -> the TrainConfig attribute of its section."""


def _not_finite(value: Any) -> bool:
    """A float flag's value (or one of a list's) that is nan or +-inf: no flag means anything by them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, float) and not math.isfinite(v) for v in items)


@dataclasses.dataclass
class TrainConfig:
    """The whole run: one section per concern; `from_flat` builds it from flat flag values."""

    arch: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    data: DataArgs = dataclasses.field(default_factory=DataArgs)
    optim: OptimizerArgs = dataclasses.field(default_factory=OptimizerArgs)
    kfac: KfacArgs = dataclasses.field(default_factory=KfacArgs)
    parallel: ParallelArgs = dataclasses.field(default_factory=ParallelArgs)
    memory: MemoryArgs = dataclasses.field(default_factory=MemoryArgs)
    runtime: RuntimeArgs = dataclasses.field(default_factory=RuntimeArgs)
    checkpoint: CheckpointArgs = dataclasses.field(default_factory=CheckpointArgs)
    logging: LoggingArgs = dataclasses.field(default_factory=LoggingArgs)
    eval: EvalArgs = dataclasses.field(default_factory=EvalArgs)

    def __post_init__(self) -> None:
        collect(_cross_section_problems(self.data.dataset, self.runtime.compile_only, self.runtime.plan))

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Flat field names -> TrainConfig; every section's problems are collected and raised once."""
        unknown = sorted(set(values) - set(FIELD_SECTION))
        if unknown:
            raise TypeError(f"unknown TrainConfig fields: {', '.join(unknown)}")
        sections = {}
        problems = [f"--{flag(name)} {value}: not a finite number; pass a finite value"
                    for name, value in values.items() if _not_finite(value)]
        for attr, section_cls in SECTIONS.items():
            kwargs = {name: v for name, v in values.items() if FIELD_SECTION[name] == attr}
            try:
                sections[attr] = section_cls(**kwargs)
            except UsageError as exc:
                problems.append(str(exc))
        if problems:  # the cross-section checks on the raw values, so that every problem is reported once
            problems += _cross_section_problems(values.get("dataset"), values.get("compile_only", False),
                                                values.get("plan", False))
            collect(problems)
        return cls(**sections)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with flat fields changed, validated again (`cfg.replace(auto_resume=False)`)."""
        return TrainConfig.from_flat({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every field under its flat (flag) name: the content of train_config.json."""
        return {k: v for attr in SECTIONS for k, v in dataclasses.asdict(getattr(self, attr)).items()}

    # -- derived numbers ---------------------------------------------------------------------------
    @property
    def samples_per_update(self) -> int:
        """Global batch in sequences: micro-batch x accumulation x replicas."""
        return self.parallel.samples_per_update

    @property
    def samples_per_step(self) -> int:
        """Sequences per host (logged) step: global batch x device iterations."""
        return self.samples_per_update * self.parallel.device_iterations

    @property
    def tokens_per_step(self) -> int:
        """Tokens per host (logged) step."""
        return self.samples_per_step * self.arch.max_len
