"""The training run's configuration: one typed dataclass, one parse.

Every field is a command-line flag (`learning_rate` -> `--learning-rate`); the reference's flag
names and its older aliases keep working. Precedence: dataclass defaults < `--config FILE`
(JSON or YAML, keys are field or flag names) < command line. The resolved config is saved as
`train_config.json` next to every checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from gpt2forge.core.errors import collect


def opt(default: Any, help: str, *aliases: str, **kwargs: Any) -> Any:
    """A dataclass field that is also a flag: `help` is its --help line, `aliases` older names.
    kwargs go to argparse (`choices`, `nargs`, `kind` = "bool" | "list_int" | "list_float" | "list_str")."""
    return field(default=default, metadata={"help": help, "aliases": aliases, **kwargs})


@dataclasses.dataclass
class TrainConfig:
    # -- model / checkpoint (reference §1.1) ---------------------------------------------------------
    model: str = opt("gpt2", "model size, a file in config/",
                     choices=("gpt2-test", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"))
    model_config: str | None = opt(None, "(new) any Hugging Face GPT-2 config.json as the model shape; "
                                   "overrides --model")
    max_len: int = opt(128, "sequence length in tokens; sets n_positions of a fresh model")
    checkpoint_input_dir: str = opt("", "initial weights: our checkpoint or a Hugging Face GPT-2 directory "
                                    "(or a checkpoint root holding a `latest` file)", "--pretrained-checkpoint")
    checkpoint_output_dir: str | None = opt(None, "where step_N/ and epoch_N/ checkpoints are written; "
                                            "nothing is saved when unset", "--save-model-path")
    custom_ops: bool = opt(True, "load the C++ custom ops library built by `make` when present", kind="bool")

    # -- data (§1.2) -----------------------------------------------------------------------------
    dataset: str | None = opt(None, "data source: generated | pickle | tfrecord | mmap (old: --train-path "
                              "generated|<file.pkl>|tfrecord|dynamic)",
                              choices=("generated", "pickle", "tfrecord", "mmap"))
    input_files: list[str] | None = opt(None, "data files: the .pkl for pickle, 'DIR/*.tfrecord' (with their "
                                        ".index files) for tfrecord, PREFIX of PREFIX.bin/.idx for mmap",
                                        "--data-prefix",
                                        "--tfrecord-path", kind="list_str")
    tokenizer_name_or_path: str | None = opt(None, "(new) local tokenizer folder the data was made with "
                                             "(data/train_tokenizer.py output: tokenizer.json, or vocab.json + "
                                             "merges.txt); a fresh model takes its vocab_size and checkpoints "
                                             "ship its files; default: GPT-2's BPE")
    stride: int = opt(128, "pickle: sliding-window stride in tokens")
    val_num: int = opt(0, "pickle: windows held out for validation (evaluated after each epoch)")
    split: str = opt("969,30,1", "(new) mmap and tfrecord: train,valid,test weights over documents (mmap) or "
                     "records (tfrecord), Megatron's --split; valid is evaluated as validation loss")
    verify: bool = opt(False, "(new) tfrecord: read every record on open and check its CRCs, payload and "
                       "token ids (mmap data is always checked on open)", kind="bool")
    seed: int = opt(1234, "seeds weights, dropout and data order: CPU runs are bit-reproducible")
    num_workers: int = opt(4, "DataLoader worker processes")
    async_dataloader: bool = opt(False, "background prefetch of batches (pinned memory on CUDA)", kind="bool")
    enable_sequence_serialized: bool = opt(False, "fused LM loss: chunks of --serialized-seq-len tokens (rows of "
                                           "the flattened batch) instead of the default ~128 MB of logits",
                                           kind="bool")
    serialized_seq_len: int = opt(128, "token chunk length for --enable-sequence-serialized")

    # -- schedule / bookkeeping (§1.3) -------------------------------------------------------------
    epochs: int = opt(1, "passes over the training data")
    training_steps: int | None = opt(None, "stop after this many logged (host) steps; overrides --epochs")
    batch_size: int = opt(1, "micro-batch size per replica")
    gradient_accumulation: int = opt(1, "micro-batches per optimizer update (gradients averaged)")
    log_steps: int = opt(1, "print the step line every N host steps")
    save_per_epochs: int = opt(1, "save epoch_N/ every N epochs")
    save_per_steps: int | None = opt(None, "save step_N/ every N host steps")
    resume_training_from_checkpoint: bool = opt(False, "continue the run saved in --checkpoint-input-dir "
                                                "(optimizer, schedule, step, data position, RNG)", kind="bool")
    auto_resume: bool = opt(False, "(new) continue from the latest checkpoint in --checkpoint-output-dir when "
                            "there is one, else start as asked (for requeued or restarted jobs)", kind="bool")
    keep_checkpoints: int | None = opt(None, "(new) keep only the N newest checkpoints in --checkpoint-output-dir "
                                       "(older step_N/ and epoch_N/ are deleted after each save)")
    use_wandb: bool = opt(False, "log metrics to Weights & Biases (needs the wandb package)", kind="bool")

    # -- optimizer / LR (§1.4) ---------------------------------------------------------------------
    optimizer: str = opt("AdamW", "AdamW | Adam | LAMB | LAMBNoBiasCorrection",
                         choices=("AdamW", "Adam", "LAMB", "LAMBNoBiasCorrection"))
    weight_decay: float = opt(0.0, "weight decay on parameters with 2 or more dimensions")
    learning_rate: float = opt(1e-5, "peak learning rate")
    lr_schedule: str = opt("constant", "constant | linear | cosine, each after a linear warm-up",
                           choices=("constant", "linear", "cosine"))
    lr_warmup: float = opt(0.1, "warm-up as a fraction of the decay steps")
    lr_warmup_steps: int | None = opt(None, "warm-up in optimizer updates (overrides --lr-warmup)")
    lr_decay_steps: int | None = opt(None, "schedule length in optimizer updates (default: the whole run)")
    max_grad_norm: float | None = opt(None, "(new) clip the global gradient norm to this value")
    max_nonfinite_updates: int = opt(10, "(new) updates with non-finite gradients are skipped; stop the run after "
                                 "this many in a row")

    # -- precision (§1.5) --------------------------------------------------------------------------
    precision: str = opt("auto", "(new) auto | fp32 | bf16 | fp16 (auto: bf16 on CUDA, fp32 on CPU)",
                         choices=("auto", "fp32", "bf16", "fp16"))
    loss_scaling: float = opt(50000.0, "fp16: static loss scale (initial scale with --auto-loss-scaling)")
    auto_loss_scaling: bool = opt(False, "fp16: dynamic loss scaling", kind="bool")
    enable_half_partials: bool = opt(False, "reduced-precision matmul accumulation where the device allows it",
                                     kind="bool")

    # -- parallel layout and IPU-era flags (§1.6, §1.7) --------------------------------------------
    layers_per_ipu: list[int] | None = opt(None, "blocks per pipeline stage, e.g. 0 4 4 4 (stage 0 holds the "
                                           "embeddings); must add up to n_layer", kind="list_int")
    ipus_per_replica: int = opt(4, "pipeline stages per model replica")
    replication_factor: int = opt(1, "data-parallel replicas (one process each; run alone, missing replicas "
                                  "become extra gradient accumulation)")
    device_iterations: int = opt(4, "optimizer updates per host (logged) step")
    matmul_proportion: list[float] | None = opt(None, "IPU matmul memory proportion (no equivalent: ignored)",
                                                kind="list_float")
    recompute_checkpoint_every_layer: bool = opt(False, "activation checkpointing of every block (recomputed "
                                                 "in backward)", kind="bool")
    recompute_checkpoint_layers: list[int] | None = opt(None, "checkpoint only these block indices", kind="list_int")
    embedding_serialization_factor: int = opt(1, "fused LM loss: split the vocabulary into this many chunks "
                                              "(1/F the logits buffer for one extra head matmul)")
    remap_logit: bool = opt(False, "use the fused LM-head loss (the default already; contradicts --lm-loss plain)",
                            kind="bool")
    optimizer_state_offchip: bool | None = opt(None, "keep optimizer state in host memory and update there "
                                               "(CUDA; on CPU it is there already)", kind="bool")
    replicated_tensor_sharding: bool = opt(False, "shard optimizer state across replicas (ZeRO-1)", kind="bool")
    zero_stage: int | None = opt(None, "(new) ZeRO sharding across replicas: 0 none | 1 optimizer state | 2 + "
                                 "gradients | 3 + parameters (2 and 3 with FSDP2); default 1 with "
                                 "--replicated-tensor-sharding, else 0", choices=(0, 1, 2, 3))
    pipeline_schedule: str = opt("1F1B", "(new) pipeline schedule over the --gradient-accumulation micro-batches "
                                 "when stages run in their own processes: GPipe | 1F1B",
                                 choices=("GPipe", "1F1B"))
    executable_cache_dir: str | None = opt(None, "torch.compile cache directory (the IPU executable cache)")
    plan: bool = opt(False, "(new) print the memory each process of the layout needs, per pipeline stage, and "
                     "whether it fits this machine; trains nothing", "--dry-run", kind="bool")
    compile_only: bool = opt(False, "compile the training step on generated data, print the time, exit",
                             kind="bool")

    # -- new flags ---------------------------------------------------------------------------------
    device: str = opt("auto", "(new) auto | cpu | cuda | cuda:N", )
    torch_compile: str = opt("auto", "(new) torch.compile the model: auto (on CUDA) | true | false",
                             choices=("auto", "true", "false"))
    lm_loss: str = opt("fused", "(new) fused: chunked LM head + loss that never holds the (B*T, V) logits "
                       "(C++ op when built) | plain: full logits + cross-entropy", choices=("fused", "plain"))
    eval_every_steps: int | None = opt(None, "(new) evaluate the validation set every N host steps",
                                       "--eval-steps")
    eval_wikitext: str | None = opt(None, "(new) WikiText file: log a quick perplexity (first 16 windows of "
                                    "--max-len tokens) whenever the validation set is evaluated")
    eval_lambada: str | None = opt(None, "(new) LAMBADA jsonl: log a quick cloze accuracy (first 128 passages, "
                                   "non-strict) whenever the validation set is evaluated")
    sample_tokens: int = opt(0, "(new) after training, print a sample of this many generated tokens")
    sample_prompt: str = opt("\n", "(new) prompt of that sample")
    metrics_file: str | None = opt(None, "(new) JSON-lines file of every step's and evaluation's metrics (plot it "
                                   "with gpt2forge-plot); default: metrics.jsonl in --checkpoint-output-dir, "
                                   "else runs/<run name>/metrics.jsonl")
    tensorboard_dir: str | None = opt(None, "(new) also write TensorBoard scalars here (loss, lr, throughput, MFU, "
                                      "memory, grad norm when known, validation)")
    profile_steps: str | None = opt(None, "(new) profile host steps A to B (counting from 1, both included), "
                                    "e.g. 3:4, with the PyTorch profiler (CPU and CUDA)")
    profile_dir: str | None = opt(None, "(new) where --profile-steps writes trace.json (Chrome/Perfetto) and "
                                  "top_ops.txt; default: profile/ beside the metrics file")

    def __post_init__(self) -> None:
        problems = []
        positive = ("max_len", "batch_size", "gradient_accumulation", "log_steps", "save_per_epochs",
                    "ipus_per_replica", "replication_factor", "device_iterations", "stride",
                    "embedding_serialization_factor", "serialized_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                problems.append(f"--{flag(name)} must be >= 1 (got {getattr(self, name)})")
        for name in ("training_steps", "save_per_steps", "lr_decay_steps", "eval_every_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"--{flag(name)} must be >= 1 (got {value})")
        for name in ("val_num", "num_workers", "sample_tokens", "epochs"):
            if getattr(self, name) < 0:
                problems.append(f"--{flag(name)} must be >= 0")
        if self.epochs == 0 and self.training_steps is None:
            problems.append("--epochs 0 trains nothing; give --epochs >= 1 or --training-steps")
        if self.learning_rate < 0 or self.weight_decay < 0:
            problems.append("--learning-rate and --weight-decay must be >= 0")
        if self.max_nonfinite_updates < 1:
            problems.append(f"--max-nonfinite-updates must be >= 1 (got {self.max_nonfinite_updates})")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            problems.append("--max-grad-norm must be > 0")
        if self.loss_scaling <= 0:
            problems.append("--loss-scaling must be > 0")
        if self.resume_training_from_checkpoint and not self.checkpoint_input_dir:
            problems.append("--resume-training-from-checkpoint needs --checkpoint-input-dir DIR")
        if self.auto_resume and not self.checkpoint_output_dir:
            problems.append("--auto-resume needs --checkpoint-output-dir DIR (where the run's checkpoints are)")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            problems.append(f"--keep-checkpoints must be >= 1 (got {self.keep_checkpoints})")
        if self.layers_per_ipu is not None and any(n < 0 for n in self.layers_per_ipu):
            problems.append("--layers-per-ipu entries must be >= 0")
        if self.dataset in ("pickle", "tfrecord", "mmap") and not self.input_files:
            problems.append(f"--dataset {self.dataset} needs --input-files PATH")
        if self.dataset is None and not (self.compile_only or self.plan):
            problems.append("--dataset is required: generated | pickle | tfrecord | mmap (with --input-files PATH)")
        collect(problems)

    # -- derived numbers ---------------------------------------------------------------------------
    @property
    def samples_per_update(self) -> int:
        """Global batch in sequences: micro-batch x accumulation x replicas."""
        return self.batch_size * self.gradient_accumulation * self.replication_factor

    @property
    def samples_per_step(self) -> int:
        """Sequences per host (logged) step: global batch x device iterations."""
        return self.samples_per_update * self.device_iterations

    @property
    def tokens_per_step(self) -> int:
        return self.samples_per_step * self.max_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flag(name: str) -> str:
    """Field name -> flag name without dashes (`learning_rate` -> `learning-rate`)."""
    return name.replace("_", "-")
