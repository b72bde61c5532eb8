"""The training run's configuration: typed sections composed into one TrainConfig, one parse.

Every field is a command-line flag (`learning_rate` -> `--learning-rate`); the reference's flag
names and its older aliases keep working, and flag names are flat (no section prefix). Precedence:
dataclass defaults < `--config FILE` (JSON or YAML, keys are field or flag names) < command line.
The resolved config is saved flat (`to_dict`) as `train_config.json` next to every checkpoint.

Sections (attribute: class): arch: ModelArgs, data: DataArgs, documents: DocumentArgs, optim: OptimizerArgs,
kfac: KfacArgs, parallel: ParallelArgs, memory: MemoryArgs, runtime: RuntimeArgs, loss_scale: LossScaleArgs,
checkpoint: CheckpointArgs, logging: LoggingArgs, eval: EvalArgs. A section lives beside the code that reads
it: those that packages below train/ consume are defined there (ModelArgs in model/args.py, DocumentArgs in
model/documents.py, DataArgs in data/args.py, ParallelArgs in parallel/topology.py, MemoryArgs in
parallel/memory_plan.py, LossScaleArgs in core/loss_scaler.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from gpt2forge.core.errors import UsageError, collect
from gpt2forge.core.flags import attribute_docs, flag, opt, positive
from gpt2forge.core.loss_scaler import LossScaleArgs
from gpt2forge.data.args import DataArgs
from gpt2forge.model.args import ModelArgs
from gpt2forge.model.build import ModelSource, resolve_model
from gpt2forge.model.documents import DocumentArgs
from gpt2forge.parallel.memory_plan import MemoryArgs
from gpt2forge.parallel.topology import ParallelArgs

WARMUP_FORMS = ("nanogpt", "transformers")
"""`--lr-warmup-form`: the multiplier of warm-up update u (from 0) is (u + o) / (W + o), o = 1 or 0."""


@dataclasses.dataclass
class OptimizerArgs:
    """Optimizer, learning-rate schedule, run length and gradient safety."""

    epochs: int = opt(1)
    """Passes over the training data."""
    training_steps: int | None = opt(None)
    """Stop after this many logged (host) steps; overrides --epochs."""
    optimizer: str = opt("AdamW", choices=("AdamW", "Adam", "LAMB", "LAMBNoBiasCorrection", "Muon"))
    """AdamW | Adam | LAMB | LAMBNoBiasCorrection | Muon (torch.optim.Muon for the 2-D weights of the transformer
    blocks: attention qkv and projection, MLP in and out; AdamW at --learning-rate for the embeddings, the LM head,
    LayerNorms and biases; one process or DDP replicas)"""
    weight_decay: float = opt(0.0)
    """Weight decay on parameters with 2 or more dimensions."""
    learning_rate: float = opt(1e-5)
    """Peak learning rate."""
    muon_learning_rate: float | None = opt(None)
    """--optimizer Muon: peak learning rate of the blocks' matrices, in AdamW's units (Muon's update RMS is
    matched to AdamW's; default: --learning-rate)"""
    muon_momentum: float = opt(0.95)
    """--optimizer Muon: Nesterov momentum of the blocks' matrices."""
    adam_beta1: float = opt(0.9)
    """Adam/AdamW/LAMB first-moment decay rate."""
    adam_beta2: float = opt(0.999)
    """Adam/AdamW/LAMB second-moment decay rate."""
    adam_eps: float = opt(1e-8)
    """Adam/AdamW/LAMB denominator epsilon (PyTorch, Hugging Face, Megatron and nanoGPT use 1e-8; the reference's
    1e-6 learns less per update: --adam-eps 1e-6 restores it)"""
    lr_schedule: str = opt("constant", choices=("constant", "linear", "cosine"))
    """Constant | linear | cosine, each after a linear warm-up."""
    lr_warmup: float = opt(0.1)
    """Warm-up as a fraction of the decay steps."""
    lr_warmup_steps: int | None = opt(None)
    """Warm-up in optimizer updates (overrides --lr-warmup)"""
    lr_decay_steps: int | None = opt(None)
    """Schedule length in optimizer updates (default: the whole run)"""
    max_grad_norm: float | None = opt(None)
    """clip the global gradient norm to this value."""
    min_lr: float = opt(0.0)
    """linear and cosine decay end at this learning rate (Megatron's and nanoGPT's --min-lr)"""
    train_samples: int | None = opt(None)
    """train on this many samples (Megatron's --train-samples; the host steps are it / samples per step, rounded
    up); overrides --epochs."""
    lr_decay_samples: int | None = opt(None)
    """schedule length in samples (Megatron's; overrides --lr-decay-steps)"""
    lr_warmup_samples: int | None = opt(None)
    """warm-up in samples (Megatron's; overrides --lr-warmup-steps)"""
    lr_warmup_form: str = opt("nanogpt", choices=WARMUP_FORMS)
    """the warm-up's first updates: nanogpt (nanoGPT's, torchtitan's, Colossal-AI's LinearWarmupLR) runs update u
    (from 0) at (u + 1) / (W + 1) of the peak; transformers (the reference's, transformers', Megatron-LM's and
    DeepSpeed's) at u / W, so its first update runs at LR 0 and only fills Adam's moments"""
    max_nonfinite_updates: int = opt(10)
    """updates with non-finite gradients are skipped (the learning rate holds); stop the run after this many in a
    row. An fp16 overflow that dynamic loss scaling answers by lowering the scale (above --min-loss-scale) is not
    counted."""

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
        if self.muon_learning_rate is not None and self.muon_learning_rate < 0:
            problems.append(f"--muon-learning-rate must be >= 0 (got {self.muon_learning_rate})")
        if not 0 <= self.muon_momentum < 1:
            problems.append(f"--muon-momentum must be in [0, 1) (got {self.muon_momentum})")
        collect(problems)


@dataclasses.dataclass
class KfacArgs:
    """K-FAC: a second-order preconditioner of the blocks' nn.Linear gradients (docs/training.md#k-fac)."""

    kfac: bool = opt(False, kind="bool")
    """precondition the gradients of the blocks' nn.Linear layers with K-FAC (kfac-pytorch's design) before
    clipping and the optimizer's step."""
    kfac_factor_update_steps: int = opt(5)
    """K-FAC: fold the layers' activation and output-gradient covariances into their running averages every N
    updates."""
    kfac_inv_update_steps: int = opt(50)
    """K-FAC: recompute the factors' eigendecompositions (or inverses) every N updates."""
    kfac_damping: float = opt(0.001)
    """K-FAC: Tikhonov damping added to the Kronecker product's eigenvalues (eigen) or to each factor's diagonal
    (inverse)"""
    kfac_factor_decay: float = opt(0.95)
    """K-FAC: running average of the factors: decay x old + (1 - decay) x new."""
    kfac_kl_clip: float = opt(0.001)
    """K-FAC: scale the preconditioned gradients by min(1, sqrt(kl_clip / (lr^2 sum(v . g)))); 0 turns the scaling
    off."""
    kfac_skip_layers: list[str] | None = opt(None, kind="list_str")
    """K-FAC: regular expressions; an nn.Linear whose name or class name matches one is not preconditioned
    (default: wte wpe lm_head, the embeddings and the tied LM head)"""
    kfac_compute_method: str = opt("eigen", choices=("eigen", "inverse"))
    """K-FAC: eigen (eigendecompositions, damping on the Kronecker product) | inverse (damped inverses of each
    factor)"""

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

    device: str = opt("auto")
    """auto | cpu | cuda | cuda:N."""
    precision: str = opt("auto", choices=("auto", "fp32", "bf16", "fp16"))
    """auto | fp32 | bf16 | fp16 (auto: bf16 on CUDA, fp32 on CPU)"""
    enable_half_partials: bool = opt(False, kind="bool")
    """Reduced-precision matmul accumulation where the device allows it."""
    torch_compile: str = opt("auto", choices=("auto", "true", "false"))
    """torch.compile the model: auto (on CUDA) | true | false."""
    deterministic: str = opt("auto", choices=("auto", "true", "false"))
    """deterministic algorithms, so a run repeats bit for bit, compiled too: auto (on the CPU, where it costs
    nothing measurable) | true | false (Megatron's --deterministic-mode)"""
    executable_cache_dir: str | None = opt(None)
    """Torch.compile cache directory (the IPU executable cache); each CPU class compiles into a folder of its own"""
    custom_ops: bool = opt(True, kind="bool")
    """Load the C++ custom ops library built by `make` when present."""
    compile_only: bool = opt(False, kind="bool")
    """Compile the training step on generated data, print the time, exit."""
    plan: bool = opt(False, "--dry-run", kind="bool")
    """print the memory each process of the layout needs, per pipeline stage, and whether it fits this machine;
    trains nothing."""


@dataclasses.dataclass
class CheckpointArgs:
    """Checkpoints: initial weights, where and when to save, resuming."""

    checkpoint_input_dir: str = opt("", "--pretrained-checkpoint")
    """Initial weights: our checkpoint or a Hugging Face GPT-2 directory (or a checkpoint root holding a `latest`
    file)"""
    checkpoint_output_dir: str | None = opt(None, "--save-model-path")
    """Where step_N/ and epoch_N/ checkpoints are written; nothing is saved when unset."""
    save_per_epochs: int = opt(1)
    """Save epoch_N/ every N epochs (0: no epoch checkpoints)"""
    save_per_steps: int | None = opt(None)
    """Save step_N/ every N host steps."""
    resume_training_from_checkpoint: bool = opt(False, kind="bool")
    """Continue the run saved in --checkpoint-input-dir (optimizer, schedule, step, data position, RNG)"""
    auto_resume: bool = opt(False, kind="bool")
    """continue from the latest checkpoint in --checkpoint-output-dir when there is one, else start as asked (for
    requeued or restarted jobs)"""
    exit_signal_handler: bool = opt(True, kind="bool")
    """on SIGTERM or SIGUSR1 (Slurm preemption) finish the current update, save a checkpoint (with
    --checkpoint-output-dir) and exit 0, so a requeued job continues with --auto-resume (Megatron's
    --exit-signal-handler)"""
    keep_checkpoints: int | None = opt(None)
    """keep only the N newest checkpoints in --checkpoint-output-dir (older step_N/ and epoch_N/ are deleted after
    each save)"""
    final_model_dir: str | None = opt(None)
    """after training, write the final model and its tokenizer here in the Hugging Face layout (from_pretrained
    opens it), with all_results.json (the last validation perplexity): what run_clm leaves in --output_dir."""

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

    log_steps: int = opt(1)
    """Print the step line every N host steps."""
    use_wandb: bool = opt(False, kind="bool")
    """Log metrics to Weights & Biases (needs the wandb package)"""
    metrics_file: str | None = opt(None)
    """JSON-lines file of every step's and evaluation's metrics (plot it with gpt2forge-plot); default:
    metrics.jsonl in --checkpoint-output-dir, else runs/<run name>/metrics.jsonl."""
    tensorboard_dir: str | None = opt(None)
    """also write TensorBoard scalars here (loss, lr, throughput, MFU, memory, grad norm when known,
    validation)"""
    profile_steps: str | None = opt(None)
    """profile host steps A to B (counting from 1, both included), e.g. 3:4, with the PyTorch profiler (CPU and
    CUDA)"""
    profile_dir: str | None = opt(None)
    """where --profile-steps writes trace.json (Chrome/Perfetto) and top_ops.txt; default: profile/ beside the
    metrics file."""

    log_format: str = opt("graphcore", choices=("graphcore", "megatron", "run_clm"))
    """the step line: graphcore (the reference's) | megatron (Megatron-LM's `iteration N/ M | consumed samples:
    ...` for its users' log parsers) | run_clm (the graphcore step line, and Hugging Face run_clm's `epoch N:
    perplexity: P eval_loss: L` after each validation)"""

    def __post_init__(self) -> None:
        collect(positive(self, "log_steps"))


@dataclasses.dataclass
class EvalArgs:
    """Evaluation during training and the sample printed after it."""

    eval_every_steps: int | None = opt(None, "--eval-steps")
    """evaluate the validation set every N host steps."""
    eval_wikitext: str | None = opt(None)
    """WikiText file: log a quick perplexity (first 16 windows of --max-len tokens) whenever the validation set is
    evaluated."""
    eval_lambada: str | None = opt(None)
    """LAMBADA jsonl: log a quick cloze accuracy (first 128 passages, non-strict) whenever the validation set is
    evaluated."""
    sample_tokens: int = opt(0)
    """after training, print a sample of this many generated tokens."""
    sample_prompt: str = opt("\n")
    """prompt of that sample."""
    eval_iters: int | None = opt(None)
    """score at most this many validation batches of one update's samples each time (Megatron's --eval-iters;
    default: the whole validation set)"""

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
    "arch": ModelArgs, "data": DataArgs, "documents": DocumentArgs, "optim": OptimizerArgs, "kfac": KfacArgs,
    "parallel": ParallelArgs, "memory": MemoryArgs, "runtime": RuntimeArgs, "loss_scale": LossScaleArgs,
    "checkpoint": CheckpointArgs, "logging": LoggingArgs, "eval": EvalArgs,
}
"""TrainConfig attribute -> section class, in --help order."""

FIELD_SECTION: dict[str, str] = {f.name: attr for attr, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
"""Flat field (flag) name -> the TrainConfig attribute of its section."""


def field_help(name: str) -> str:
    """The --help text of flat field `name`: its attribute docstring, the one text of the setting."""
    return attribute_docs(SECTIONS[FIELD_SECTION[name]])[name]


def _not_finite(value: Any) -> bool:
    """A float flag's value (or one of a list's) that is nan or +-inf: no flag means anything by them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, float) and not math.isfinite(v) for v in items)


@dataclasses.dataclass
class TrainConfig:
    """The whole run: one section per concern; `from_flat` builds it from flat flag values."""

    arch: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    data: DataArgs = dataclasses.field(default_factory=DataArgs)
    documents: DocumentArgs = dataclasses.field(default_factory=DocumentArgs)
    optim: OptimizerArgs = dataclasses.field(default_factory=OptimizerArgs)
    kfac: KfacArgs = dataclasses.field(default_factory=KfacArgs)
    parallel: ParallelArgs = dataclasses.field(default_factory=ParallelArgs)
    memory: MemoryArgs = dataclasses.field(default_factory=MemoryArgs)
    runtime: RuntimeArgs = dataclasses.field(default_factory=RuntimeArgs)
    loss_scale: LossScaleArgs = dataclasses.field(default_factory=LossScaleArgs)
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

    def model_source(self) -> ModelSource:
        """The model this run trains (gpt2forge.model.build.resolve_model): its shape, and the checkpoint
        whose weights it loads or the seed of its initialisation."""
        ckpt = self.checkpoint
        return resolve_model(self.arch, ckpt.checkpoint_input_dir, tokenizer=self.data.tokenizer_name_or_path,
                             resume=ckpt.resume_training_from_checkpoint, seed=self.data.seed)

    # -- derived numbers ---------------------------------------------------------------------------
    @property
    def samples_per_update(self) -> int:
        """Global batch in sequences: micro-batch x accumulation x replicas."""
        return self.parallel.samples_per_update

    @property
    def samples_per_step(self) -> int:
        """Sequences per host (logged) step: global batch x device iterations."""
        return self.parallel.samples_per_step

    @property
    def tokens_per_step(self) -> int:
        """Tokens per host (logged) step."""
        return self.samples_per_step * self.arch.max_len
