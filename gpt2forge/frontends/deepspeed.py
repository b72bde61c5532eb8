"""DeepSpeed's `ds.json` -> TrainConfig values: what `--deepspeed --deepspeed_config ds.json` means on a
Megatron-DeepSpeed command line (`pretrain_gpt.py`, gpt2forge.frontends.megatron).

Precedence is Megatron-DeepSpeed's. Its DeepSpeed engine owns the batch sizes, gradient clipping, fp16/bf16
with the loss scaling, and the ZeRO stage with offload, so ds.json's values win there over Megatron's flags
(a flag given with another value is named in a notice). Megatron-DeepSpeed hands `deepspeed.initialize` its
own optimizer and LR scheduler, built from the flags, and DeepSpeed then never reads ds.json's `optimizer`
and `scheduler` blocks: here the flags still win, and the blocks (and `steps_per_print`) fill in what the
command line leaves out, in place of Megatron's defaults.

Batch sizes follow DeepSpeed's rule (`deepspeed/runtime/config.py`, `_set_batch_related_parameters` and
`_batch_assertion`): train_batch_size = micro batch x accumulation x data-parallel size; any two of the
three give the third, one alone means accumulation 1, and a disagreement stops with DeepSpeed's own words.
The data-parallel size is the world size over the pipeline stages.

`KEYS` lists every key read, with what it becomes here (docs/megatron.md shows it). Any other key is named in
one notice as ignored; values this trainer cannot reproduce (a log-shaped warm-up, NVMe offload, another
optimizer or scheduler) stop with one line that says what to write instead (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.config_file import Key, Settings, key_table
from gpt2forge.frontends.flag_table import Own, Parsed

KEY_ROWS: tuple[Key, ...] = (
    Key(name="train_batch_size", help="the global batch (gradient accumulation = it / (micro x data-parallel size))"),
    Key(name="train_micro_batch_size_per_gpu", field="batch_size", note="(Megatron's `--micro-batch-size`)"),
    Key(name="gradient_accumulation_steps", field="gradient_accumulation"),
    Key(name="gradient_clipping", field="max_grad_norm", note="(0: no clipping)"),
    Key(name="steps_per_print", field="log_steps", note="(unless `--log-interval` is given)"),
    Key(name="fp16.enabled", help="`--precision fp16`"),
    Key(name="fp16.loss_scale", help="0: `--auto-loss-scaling true` (dynamic); else `--loss-scaling` (static)"),
    Key(name="fp16.initial_scale_power", field="initial_loss_scale", note="2**power (dynamic scaling; default 16)"),
    Key(name="fp16.loss_scale_window", field="loss_scale_window", note="(default 1000)"),
    Key(name="fp16.hysteresis", field="loss_scale_hysteresis", note="(default 2)"),
    Key(name="fp16.min_loss_scale", field="min_loss_scale", note="(default 1)"),
    Key(name="fp16.consecutive_hysteresis",
        help="false only (the hysteresis refills when the scale grows, as Megatron's)"),
    Key(name="bf16.enabled", help="`--precision bf16` (also the older `bfloat16` block)"),
    Key(name="zero_optimization.stage", field="zero_stage", note="0-3"),
    Key(name="zero_optimization.offload_optimizer.device", help="cpu: `--offload optimizer`; none: `--offload none`"),
    Key(name="zero_optimization.offload_optimizer.pin_memory", help="(accepted: host buffers are always pinned here)"),
    Key(name="zero_optimization.offload_param.device",
        help="cpu with stage 3: `--offload full` (DeepSpeed reads it only in ZeRO-3)"),
    Key(name="zero_optimization.offload_param.pin_memory", help="(accepted: host buffers are always pinned here)"),
    Key(name="optimizer.type", help="Adam (with `adam_w_mode` true, DeepSpeed's default) and AdamW: `--optimizer "
                                    "AdamW`; Adam with `adam_w_mode` false: `--optimizer Adam` (L2 weight decay)"),
    Key(name="optimizer.params.lr", field="learning_rate", note="(DeepSpeed's default 1e-3)"),
    Key(name="optimizer.params.betas", help="`--adam-beta1`, `--adam-beta2`"),
    Key(name="optimizer.params.eps", field="adam_eps"),
    Key(name="optimizer.params.weight_decay", field="weight_decay", note="(DeepSpeed's default 0)"),
    Key(name="optimizer.params.adam_w_mode", help="see optimizer.type"),
    Key(name="optimizer.params.torch_adam", help="(accepted: torch's fused Adam runs here)"),
    Key(name="scheduler.type",
        help="WarmupLR: `--lr-schedule constant`; WarmupDecayLR: `linear`; WarmupCosineLR: `cosine`"),
    Key(name="scheduler.params.warmup_type", help="linear only (DeepSpeed's default is log: write \"linear\")"),
    Key(name="scheduler.params.warmup_num_steps", field="lr_warmup_steps",
        note="(at least 2, as DeepSpeed; default 1000)"),
    Key(name="scheduler.params.warmup_min_lr", help="0 only (the warm-up starts at 0 here)"),
    Key(name="scheduler.params.warmup_min_ratio", help="0 only (WarmupCosineLR)"),
    Key(name="scheduler.params.warmup_max_lr", field="learning_rate",
        note="(WarmupLR: default the optimizer's; WarmupDecayLR: 1e-3)"),
    Key(name="scheduler.params.total_num_steps", field="lr_decay_steps", note="(WarmupDecayLR, WarmupCosineLR)"),
    Key(name="scheduler.params.cos_min_ratio", field="min_lr",
        note="= ratio x learning rate (WarmupCosineLR; default 0.0001)"),
    Key(name="scheduler.params.last_batch_iteration", help="-1 only (resuming restores the schedule's position here)"),
)
"""Every ds.json key read, with what it becomes here (docs/megatron.md shows it)."""
KEYS: dict[str, str] = key_table(KEY_ROWS)
"""Every ds.json key read (dotted path) -> what it becomes here."""

SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def load_ds_config(path: str) -> dict[str, Any]:
    """The ds.json at `path` as a dict.

    Raises:
        UsageError: the file is missing, not JSON, or not one JSON object.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--deepspeed_config {path}: cannot read it ({e.strerror}); pass the path of the "
                         "DeepSpeed JSON config") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--deepspeed_config {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno});"
                         " fix the file (comments and trailing commas are not JSON)") from None
    if not isinstance(config, dict):
        raise UsageError(f"--deepspeed_config {path}: holds a JSON {type(config).__name__}, not an object; "
                         "DeepSpeed's config is one {...} object")
    return config


def resolve_batch(train: int | None, micro: int | None, accumulation: int | None,
                  world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro batch, accumulation) by DeepSpeed's rule, any two giving the third.

    Args:
        train, micro, accumulation: ds.json's `train_batch_size`, `train_micro_batch_size_per_gpu`,
            `gradient_accumulation_steps` (None: not given).
        world_size: the data-parallel size DeepSpeed divides by.

    Raises:
        UsageError: with DeepSpeed's assertion text, when they disagree or too few are given.
    """
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // world_size
    elif train is not None and accumulation is not None and micro is None:
        micro = train // world_size // accumulation
    elif micro is not None and accumulation is not None and train is None:
        train = micro * accumulation * world_size
    elif train is not None and micro is None and accumulation is None:
        accumulation, micro = 1, train // world_size
    elif micro is not None and train is None and accumulation is None:
        train, accumulation = micro * world_size, 1
    elif train is None or micro is None or accumulation is None:
        raise UsageError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    for value, what in ((train, f"Train batch size: {train}"), (micro, f"Micro batch size per gpu: {micro}"),
                        (accumulation, f"Gradient accumulation steps: {accumulation}")):
        if value <= 0:
            raise UsageError(f"{what} has to be greater than 0")
    if train != micro * accumulation * world_size:
        raise UsageError("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                         f"gradient_acc_step * world_size {train} != {micro} * {accumulation} * {world_size}")
    return train, micro, accumulation


class _Apply(Settings):
    """One ds.json applied to one run's values (`run`: a Megatron command line's, whose `set_by` maps the
    fields and settings the command line gave to its flag), with Megatron-DeepSpeed's precedence."""

    def __init__(self, path: str, config: dict, run: Parsed):
        super().__init__(path, config, KEY_ROWS, where=path, show=json.dumps)
        self.values, self.own, self.set_by = run.values, run.own, run.set_by
        self.ignored: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        value = super().get(key, default)
        if isinstance(value, str) and value == "auto":
            raise UsageError(f"{self.path}: {key} is \"auto\", which Hugging Face's Trainer fills in, not DeepSpeed; "
                             "write the value")
        return value

    def engine(self, key: str, value: Any, field: str | Own | None = None) -> None:
        """ds.json's `key` wins (DeepSpeed's engine owns it): a command-line value that differs is named. `field`: a
        TrainConfig field, or an `Own` Megatron setting (its `MegatronOnly` record); default: the key's row's."""
        field = field or self.keys[key].field
        own = isinstance(field, Own)
        before = getattr(self.own, field.field) if own else self.values.get(field)
        flag = self.set_by.get(field)
        if flag is not None and before != value:
            log.notice(f"{key} {value} in {self.path} replaces {flag} {before}: DeepSpeed's engine takes ds.json's")
        if own:
            setattr(self.own, field.field, value)
        else:
            self.values[field] = value

    def fill(self, key: str, value: Any, fields: tuple[str, ...] = ()) -> None:
        """The command line wins (Megatron-DeepSpeed builds it from the flags): ds.json's `key` fills fields[0]
        (default: the key's row's field) when none of `fields` (one setting's spellings, e.g. the warm-up in
        updates, samples or as a fraction) was given."""
        fields = fields or (self.keys[key].field,)
        given = next((f for f in fields if f in self.set_by), None)
        if given is None:
            self.values[fields[0]] = value
        elif given != fields[0] or self.values.get(given) != value:
            log.notice(f"{self.set_by[given]} {self.values.get(given)} wins over {key} {value} in {self.path}: "
                       "Megatron-DeepSpeed builds the optimizer, its schedule and its log from the flags")


def apply_deepspeed_config(path: str, run: Parsed, data_parallel: int) -> None:
    """Apply the ds.json at `path` to a Megatron command line's `run`, in place.

    Args:
        path: the `--deepspeed_config` file.
        run: its flat TrainConfig values (Megatron's defaults, then the flags) and its `MegatronOnly` record,
            where the global batch and fp16's static scale go, as the flags put them; `run.set_by` names
            what the command line gave (for the precedence notices).
        data_parallel: the data-parallel size (world size / pipeline stages), DeepSpeed's `world_size`.

    Raises:
        UsageError: an unreadable file, batch sizes that disagree, or a value that cannot be reproduced here.
    """
    config = load_ds_config(path)
    if "bfloat16" in config and "bf16" not in config:  # the older name, read by DeepSpeed when bf16 is absent
        config["bf16"] = config.pop("bfloat16")
    a = _Apply(path, config, run)
    _batches(a, data_parallel)
    clip = a.get("gradient_clipping")
    if clip is not None:
        a.engine("gradient_clipping", float(clip) if clip else None)
    _precision(a)
    _zero(a)
    _optimizer(a)
    _scheduler(a)
    if a.get("steps_per_print") is not None:
        a.fill("steps_per_print", int(a.get("steps_per_print")))
    ignored = [key for key in a.leaves(empty_dicts=True) if key not in KEYS] + a.ignored
    if ignored:
        log.notice(f"{path}: no meaning here, ignored: {', '.join(ignored)}")


def _whole(a: _Apply, key: str) -> int | None:
    value = a.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise a.refuse(key, value, "must be a whole number")
    return value


def _batches(a: _Apply, data_parallel: int) -> None:
    train, micro, _ = resolve_batch(_whole(a, "train_batch_size"), _whole(a, "train_micro_batch_size_per_gpu"),
                                    _whole(a, "gradient_accumulation_steps"), data_parallel)
    a.engine("train_micro_batch_size_per_gpu", micro)
    a.engine("train_batch_size", train, Own("global_batch"))


def _precision(a: _Apply) -> None:
    fp16, bf16 = bool(a.get("fp16.enabled", False)), bool(a.get("bf16.enabled", False))
    if fp16 and bf16:
        raise UsageError(f"{a.path}: bfloat16 and fp16 modes cannot be simultaneously enabled")
    if bf16:
        a.engine("bf16.enabled", "bf16", "precision")
    elif not fp16:
        if "fp16" in a.settings or "bf16" in a.settings:  # blocks present, both off: DeepSpeed runs fp32
            a.engine("fp16.enabled", "fp32", "precision")
        return  # no block: the flags decide
    else:
        a.engine("fp16.enabled", "fp16", "precision")
        if a.get("fp16.consecutive_hysteresis", False):
            raise a.refuse("fp16.consecutive_hysteresis", True, "the hysteresis refills only when the scale grows "
                           "here (Megatron's and DeepSpeed's default); remove the key")
        static = a.get("fp16.loss_scale", 0)
        if static:
            a.engine("fp16.loss_scale", float(static), Own("static_loss_scale"))
            return
        if a.own.static_loss_scale is not None:
            log.notice(f"fp16.loss_scale 0 (dynamic) in {a.path} replaces {a.set_by[Own('static_loss_scale')]} "
                       f"{a.own.static_loss_scale}: DeepSpeed's engine takes ds.json's")
            a.own.static_loss_scale = None
        a.engine("fp16.initial_scale_power", 2.0 ** a.get("fp16.initial_scale_power", 16))
        a.engine("fp16.loss_scale_window", int(a.get("fp16.loss_scale_window", 1000)))
        a.engine("fp16.hysteresis", int(a.get("fp16.hysteresis", 2)))
        a.engine("fp16.min_loss_scale", float(a.get("fp16.min_loss_scale", 1)))


def _offload_device(a: _Apply, key: str) -> str:
    device = a.get(key, "none")
    if device not in ("cpu", "none"):
        raise a.refuse(key, device, "only cpu offload (pinned host memory) is available here; write \"cpu\"")
    return device


def _zero(a: _Apply) -> None:
    if "zero_optimization" not in a.settings:
        return
    stage = a.get("zero_optimization.stage", 0)
    if stage not in (0, 1, 2, 3):
        raise a.refuse("zero_optimization.stage", stage, "ZeRO stages are 0, 1, 2 and 3")
    a.engine("zero_optimization.stage", stage)
    optimizer = _offload_device(a, "zero_optimization.offload_optimizer.device")
    params = _offload_device(a, "zero_optimization.offload_param.device")
    if params == "cpu" and stage != 3:
        a.ignored.append("zero_optimization.offload_param (read by DeepSpeed in stage 3 only)")
    if params == "cpu" and stage == 3:
        a.engine("zero_optimization.offload_param.device", "full", "offload")
    elif a.has("zero_optimization.offload_optimizer.device"):
        a.engine("zero_optimization.offload_optimizer.device", "optimizer" if optimizer == "cpu" else "none", "offload")


def _optimizer(a: _Apply) -> None:
    if "optimizer" not in a.settings:
        return
    kind = str(a.get("optimizer.type", ""))
    if kind.lower() not in ("adam", "adamw"):
        raise a.refuse("optimizer.type", kind, "Adam or AdamW through pretrain_gpt.py (train_gpt2.py also has LAMB)")
    adam_w = kind.lower() == "adamw" or bool(a.get("optimizer.params.adam_w_mode", True))
    a.fill("optimizer.type", "AdamW" if adam_w else "Adam", ("optimizer",))
    a.fill("optimizer.params.lr", float(a.get("optimizer.params.lr", 1e-3)))
    beta1, beta2 = a.get("optimizer.params.betas", [0.9, 0.999])
    a.fill("optimizer.params.betas", float(beta1), ("adam_beta1",))
    a.fill("optimizer.params.betas", float(beta2), ("adam_beta2",))
    a.fill("optimizer.params.eps", float(a.get("optimizer.params.eps", 1e-8)))
    a.fill("optimizer.params.weight_decay", float(a.get("optimizer.params.weight_decay", 0.0)))


_WARMUP = ("lr_warmup_steps", "lr_warmup", "lr_warmup_samples")
_DECAY = ("lr_decay_steps", "lr_decay_samples")


def _scheduler(a: _Apply) -> None:
    if "scheduler" not in a.settings:
        return
    kind = a.get("scheduler.type")
    if kind not in SCHEDULES:
        raise a.refuse("scheduler.type", kind, f"{', '.join(SCHEDULES)} here (or drop the block and use "
                       "--lr-decay-style)")
    warmup_type = a.get("scheduler.params.warmup_type", "log")
    if warmup_type != "linear":
        raise a.refuse("scheduler.params.warmup_type", warmup_type, "the warm-up here is linear (DeepSpeed's "
                       "default is log): add \"warmup_type\": \"linear\" to the scheduler's params")
    for key in ("scheduler.params.warmup_min_lr", "scheduler.params.warmup_min_ratio"):
        if a.get(key, 0):
            raise a.refuse(key, a.get(key), "the warm-up starts at 0 here; write 0")
    if a.get("scheduler.params.last_batch_iteration", -1) != -1:
        raise a.refuse("scheduler.params.last_batch_iteration", a.get("scheduler.params.last_batch_iteration"),
                       "resuming restores the schedule's position here; remove the key")
    steps = a.get("scheduler.params.warmup_num_steps", 1000)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        raise UsageError(f"{a.path}: warmup_num_steps must be a positive integer, got {steps}")  # DeepSpeed's words
    peak = a.get("scheduler.params.warmup_max_lr", 1e-3 if kind == "WarmupDecayLR" else None)
    if peak is not None and kind != "WarmupCosineLR":
        a.fill("scheduler.params.warmup_max_lr", float(peak))
    a.fill("scheduler.type", SCHEDULES[kind], ("lr_schedule",))
    a.fill("scheduler.params.warmup_num_steps", max(2, steps), _WARMUP)
    if kind == "WarmupLR":
        return
    total = a.get("scheduler.params.total_num_steps")
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        raise a.refuse("scheduler.params.total_num_steps", total, f"{kind} needs the schedule length in updates")
    a.fill("scheduler.params.total_num_steps", total, _DECAY)
    floor = float(a.get("scheduler.params.cos_min_ratio", 0.0001)) if kind == "WarmupCosineLR" else 0.0
    a.fill("scheduler.params.cos_min_ratio", floor * a.values.get("learning_rate", 0.0))
