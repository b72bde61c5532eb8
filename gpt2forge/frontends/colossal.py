"""Colossal-AI's Python config file -> TrainConfig values: `train_gpt2.py --config gpt2_configs/gpt2_zero3.py`
(seed 003's `torchrun ... train_gpt.py --config=gpt2_configs/gpt2_zero3.py --from_torch`).

A Colossal-AI config is a Python module whose top-level assignments are the settings (`BATCH_SIZE = 2`,
`zero = dict(model_config=dict(tensor_placement_policy='cpu', shard_strategy=TensorShardStrategy()), ...)`,
`optimizer = dict(type=HybridAdam, lr=0.00015, weight_decay=1e-2)`). The file is read, never run
(gpt2forge.frontends.python_config: literals, dict(...), imported names, arithmetic on numbers; anything else
is one line naming `file:line`).

`KEYS` lists every setting read and what it becomes here (docs/training.md shows it). The other
settings are named in one notice as ignored; values this trainer cannot reproduce (NVMe offload, 2D
tensor parallelism, an interleaved pipeline, another optimizer or model) stop with one line saying
what to write instead (exit 2). The command line still wins over the file.
"""

from __future__ import annotations

import os
from typing import Any

from gpt2forge.core import log
from gpt2forge.frontends.config_file import Key, Settings, key_table
from gpt2forge.frontends.python_config import Symbol, read_config_file

KEY_ROWS: tuple[Key, ...] = (
    Key(name="BATCH_SIZE", field="batch_size"),
    Key(name="NUM_EPOCHS", help="`--epochs`; and the schedule of Colossal-AI's train_gpt.py (LinearWarmupLR over "
                                "NUM_EPOCHS with 5 warm-up epochs): `--lr-schedule linear --lr-warmup 5/NUM_EPOCHS`"),
    Key(name="SEQ_LEN", field="max_len"),
    Key(name="gradient_accumulation", field="gradient_accumulation"),
    Key(name="clip_grad_norm", field="max_grad_norm"),
    Key(name="zero.model_config", help="a sharded model (Colossal-AI's ZeRO-3): `--zero-stage 3`"),
    Key(name="zero.model_config.tensor_placement_policy", help="cpu or auto: `--offload full`; cuda: `--offload none`"),
    Key(name="zero.model_config.offload_config.device", help="cpu: `--offload full`"),
    Key(name="zero.model_config.shard_strategy", help="(accepted: FSDP2 shards every tensor)"),
    Key(name="zero.model_config.reuse_fp16_shard", help="(accepted: FSDP2 keeps its own gathered copies)"),
    Key(name="zero.optimizer_config.cpu_offload",
        help="true: `--offload optimizer` (unless the model is offloaded: full)"),
    Key(name="zero.optimizer_config.initial_scale", field="initial_loss_scale", note="(fp16)"),
    Key(name="zero.optimizer_config.min_scale", field="min_loss_scale", note="(fp16)"),
    Key(name="zero.optimizer_config.growth_interval", field="loss_scale_window", note="(fp16)"),
    Key(name="zero.optimizer_config.hysteresis", field="loss_scale_hysteresis", note="(fp16)"),
    Key(name="zero.level", field="zero_stage", note="2 or 3 (Colossal-AI's older ZeRO config)"),
    Key(name="zero.cpu_offload", help="true: `--offload optimizer`"),
    Key(name="zero.offload_optimizer_config.device", help="cpu: `--offload optimizer`"),
    Key(name="zero.offload_param_config.device", help="cpu with level 3: `--offload full`"),
    Key(name="zero.clip_grad", field="max_grad_norm"),
    Key(name="zero.dynamic_loss_scale", field="auto_loss_scaling", note="(fp16)"),
    Key(name="zero.overlap_comm", help="(accepted: FSDP2 overlaps its communication)"),
    Key(name="fp16.mode", help="`--precision fp16 --auto-loss-scaling true` (Colossal-AI's DynamicGradScaler: initial "
                               "scale 2**16, window 1000, hysteresis 2)"),
    Key(name="fp16.initial_scale", field="initial_loss_scale"),
    Key(name="fp16.min_scale", field="min_loss_scale"),
    Key(name="fp16.growth_interval", field="loss_scale_window"),
    Key(name="fp16.hysteresis", field="loss_scale_hysteresis"),
    Key(name="optimizer.type", help="HybridAdam, CPUAdam, FusedAdam (adamw_mode true, their default), AdamW: "
                                    "`--optimizer AdamW`; Adam or adamw_mode false: `--optimizer Adam` (L2 weight "
                                    "decay); Lamb, FusedLAMB: `LAMB`"),
    Key(name="optimizer.lr", field="learning_rate"),
    Key(name="optimizer.weight_decay", field="weight_decay"),
    Key(name="optimizer.betas", help="`--adam-beta1`, `--adam-beta2`"),
    Key(name="optimizer.eps", field="adam_eps"),
    Key(name="optimizer.adamw_mode", help="see optimizer.type"),
    Key(name="model.type", help="gpt2_small, gpt2_medium, gpt2_large, gpt2_xl: `--model gpt2|gpt2-medium|gpt2-large|"
                                "gpt2-xl`; the example's GPT2_small_pipeline_1D/_hybrid: `gpt2`, "
                                "GPT2_exlarge_pipeline_1D/_hybrid: `gpt2-xl --num-attention-heads 32`"),
    Key(name="model.checkpoint", help="true: `--recompute-checkpoint-every-layer`"),
    Key(name="model.dim", field="hidden_size"),
    Key(name="model.hidden_size", field="hidden_size"),
    Key(name="model.depth", field="num_layers"),
    Key(name="model.num_layers", field="num_layers"),
    Key(name="model.num_heads", field="num_attention_heads"),
    Key(name="model.num_attention_heads", field="num_attention_heads"),
    Key(name="model.max_position_embeddings", field="max_position_embeddings"),
    Key(name="model.dtype", help="torch.half: `--precision fp16`; torch.bfloat16: `bf16`; torch.float: `fp32`"),
    Key(name="parallel.pipeline", help="`--ipus-per-replica` and `--layers-per-ipu`: the model's blocks split as "
                                       "Colossal-AI's uniform partition splits them (the later stages take the "
                                       "remainder)"),
    Key(name="NUM_MICRO_BATCHES", help="with parallel.pipeline: `--batch-size` BATCH_SIZE / NUM_MICRO_BATCHES, "
                                       "`--gradient-accumulation` x NUM_MICRO_BATCHES"),
    Key(name="model.num_chunks", help="1 (the interleaved schedule is not here)"),
    Key(name="parallel.tensor.size", help="with mode '1d': `--tensor-model-parallel-size`"),
    Key(name="parallel.tensor.mode", help="'1d' (Megatron's) or None"),
    Key(name="DATA", help="(environment variable, read by Colossal-AI's train_gpt.py) `--dataset jsonl --input-files "
                          "$DATA`, unless the command line names the data"),
)
"""Every setting read, with what it becomes here (docs/training.md shows it)."""
KEYS: dict[str, str] = key_table(KEY_ROWS)
"""Every setting read (dotted path) -> what it becomes here."""

_EXLARGE = {"model": "gpt2-xl", "num_attention_heads": 32}  # 48 blocks of 1600 as GPT-2 XL, 32 heads (XL: 25)
MODELS: dict[str, dict[str, Any]] = {
    "gpt2_small": {"model": "gpt2"}, "gpt2_medium": {"model": "gpt2-medium"}, "gpt2_large": {"model": "gpt2-large"},
    "gpt2_xl": {"model": "gpt2-xl"}, "GPT2_small_pipeline_1D": {"model": "gpt2"},
    "GPT2_small_pipeline_hybrid": {"model": "gpt2"}, "GPT2_exlarge_pipeline_1D": _EXLARGE,
    "GPT2_exlarge_pipeline_hybrid": _EXLARGE}
"""model.type (titans' and the example's pipeline models) -> the values of its shape here."""
DEPTHS = {"gpt2": 12, "gpt2-medium": 24, "gpt2-large": 36, "gpt2-xl": 48}
"""Blocks of each --model, for the pipeline's split."""
OPTIMIZERS = {"HybridAdam": "AdamW", "CPUAdam": "AdamW", "FusedAdam": "AdamW", "AdamW": "AdamW", "Adam": "Adam",
              "Lamb": "LAMB", "FusedLAMB": "LAMB"}
"""optimizer.type -> --optimizer (the Adam kinds with adamw_mode false are Adam)."""
_ADAMW_MODE = ("HybridAdam", "CPUAdam", "FusedAdam")
KNOWN_NAMES = {*MODELS, *OPTIMIZERS, "TensorShardStrategy", "BucketTensorShardStrategy", "AMP_TYPE", "torch"}
"""Names a config may use without importing them (the seed's snippet uses HybridAdam after importing CPUAdam)."""
DTYPES = {"half": "fp16", "float16": "fp16", "bfloat16": "bf16", "float": "fp32", "float32": "fp32"}
_ACCEPTED = ("zero.model_config.shard_strategy", "zero.model_config.reuse_fp16_shard", "zero.overlap_comm")


def _show(value: Any) -> str:
    return repr(value.name if isinstance(value, Symbol) else value)


def colossal_values(path: str, data_given: bool = False, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Flat TrainConfig values for the Colossal-AI config at `path` (see `KEYS`); prints them as
    `train_gpt2.py` flags and, in one notice, names what was ignored.

    Args:
        path: the `--config` file (a .py).
        data_given: the command line names the data (`--dataset` or `--input-files`): `DATA` is not read.
        environ: the environment Colossal-AI's train_gpt.py reads `DATA` from (default os.environ).

    Raises:
        UsageError: see `read_config_file`, and values that cannot be reproduced here (one line with the fix).
    """
    a = Settings(path, read_config_file(path, KNOWN_NAMES), KEY_ROWS, where=f"--config {path}", show=_show)
    _batch(a)
    _zero(a)
    _precision(a)
    _optimizer(a)
    _model(a)
    data = (os.environ if environ is None else environ).get("DATA")
    if data and not data_given:
        a.values.update(dataset="jsonl", input_files=[data])
        a.read.append("DATA")
    if a.values:
        log.info(f"--config {path} (Colossal-AI's) stands for: {_as_flags(a.values)}")
    ignored = [key for key in a.leaves() if key not in a.read and key not in _ACCEPTED]
    if ignored:
        log.notice(f"--config {path}: no meaning here, ignored: {', '.join(ignored)}")
    return a.values


def _as_flags(values: dict[str, Any]) -> str:
    """`--batch-size 2 --offload full ...`: the values as train_gpt2.py's flags."""
    words = []
    for field, value in values.items():
        shown = " ".join(map(str, value)) if isinstance(value, list) else str(value).lower() \
            if isinstance(value, bool) else str(value)
        words.append(f"--{field.replace('_', '-')} {shown}")
    return " ".join(words)


def _batch(a: Settings) -> None:
    size, mode = a.number("parallel.tensor.size", int, 1), a.get("parallel.tensor.mode")
    if size and size > 1:
        if mode != "1d":
            raise a.refuse("parallel.tensor.mode", mode, "only 1d tensor parallelism (Megatron's) runs here; "
                                                         "write mode='1d'")
        a.values["tensor_model_parallel_size"] = size
    a.copy("BATCH_SIZE", "SEQ_LEN", "gradient_accumulation", "clip_grad_norm")
    epochs = a.number("NUM_EPOCHS", int)
    if epochs is not None:
        a.values.update(epochs=epochs, lr_schedule="linear", lr_warmup=min(1.0, 5 / max(epochs, 1)))
    pipeline = a.number("parallel.pipeline", int, 1)
    if pipeline and pipeline > 1:
        _pipeline(a, pipeline)


def _pipeline(a: Settings, stages: int) -> None:
    """parallel.pipeline: the blocks split as Colossal-AI's uniform partition splits them (the later
    stages take the remainder), and BATCH_SIZE cut into NUM_MICRO_BATCHES micro-batches."""
    depth = a.number("model.depth", int) or a.number("model.num_layers", int)
    kind = a.get("model.type")
    name = kind.leaf if isinstance(kind, Symbol) else kind
    depth = depth or (DEPTHS[MODELS[name]["model"]] if name in MODELS else None)
    if depth is None:
        raise a.refuse("parallel.pipeline", stages, "the blocks of this model are not known here: give "
                                                    "--layers-per-ipu N1 N2 ... on the command line")
    chunks = a.number("model.num_chunks", int, 1)
    if chunks != 1:
        raise a.refuse("model.num_chunks", chunks, "the interleaved schedule is not here; write num_chunks=1 "
                                                   "(1F1B over one chunk per stage)")
    left = stages - depth % stages
    a.values.update(layers_per_ipu=[depth // stages + (p >= left) for p in range(stages)], ipus_per_replica=stages)
    micro = a.number("NUM_MICRO_BATCHES", int)
    if micro:
        batch = a.values.get("batch_size", 1)
        if batch % micro:
            raise a.refuse("NUM_MICRO_BATCHES", micro, f"must divide BATCH_SIZE {batch}")
        a.values["batch_size"] = batch // micro
        a.values["gradient_accumulation"] = a.values.get("gradient_accumulation", 1) * micro


def _offload_device(a: Settings, key: str) -> str | None:
    device = a.get(key)
    if device not in (None, "cpu", "cuda", "auto"):
        raise a.refuse(key, device, "only cpu offload (pinned host memory) is available here; write 'cpu'")
    return device


def _zero(a: Settings) -> None:
    zero = a.settings.get("zero")
    if not isinstance(zero, dict):
        return
    if "model_config" in zero:  # Colossal-AI's sharded model: parameters, gradients and optimizer state
        a.get("zero.model_config")
        a.values["zero_stage"] = 3
        placement = _offload_device(a, "zero.model_config.tensor_placement_policy")
        offload = _offload_device(a, "zero.model_config.offload_config.device")
        if placement in ("cpu", "auto") or offload == "cpu":
            a.values["offload"] = "full"
        elif a.get("zero.optimizer_config.cpu_offload", False):
            a.values["offload"] = "optimizer"
        elif placement == "cuda":
            a.values["offload"] = "none"
        a.copy("zero.optimizer_config.initial_scale", "zero.optimizer_config.min_scale",
               "zero.optimizer_config.growth_interval", "zero.optimizer_config.hysteresis")
        return
    level = a.number("zero.level", int)  # the older config: DeepSpeed's ZeRO under Colossal-AI's names
    if level is not None:
        if level not in (2, 3):
            raise a.refuse("zero.level", level, "Colossal-AI's ZeRO levels are 2 and 3")
        a.values["zero_stage"] = level
    params = _offload_device(a, "zero.offload_param_config.device")
    optimizer = _offload_device(a, "zero.offload_optimizer_config.device")
    if params == "cpu" and level == 3:
        a.values["offload"] = "full"
    elif optimizer == "cpu" or a.get("zero.cpu_offload", False):
        a.values["offload"] = "optimizer"
    a.copy("zero.clip_grad")
    if a.get("zero.dynamic_loss_scale") is not None:
        a.values["auto_loss_scaling"] = bool(a.get("zero.dynamic_loss_scale"))


def _precision(a: Settings) -> None:
    if a.get("fp16.mode") is not None or isinstance(a.settings.get("fp16"), dict):
        a.values.update(precision="fp16", auto_loss_scaling=True, initial_loss_scale=2.0 ** 16,
                        loss_scale_window=1000, loss_scale_hysteresis=2)
        a.copy("fp16.initial_scale", "fp16.min_scale", "fp16.growth_interval", "fp16.hysteresis")


def _optimizer(a: Settings) -> None:
    if not isinstance(a.settings.get("optimizer"), dict):
        return
    kind = a.get("optimizer.type")
    name = kind.leaf if isinstance(kind, Symbol) else kind
    if name not in OPTIMIZERS:
        raise a.refuse("optimizer.type", kind, f"the optimizers here are {', '.join(OPTIMIZERS)} (AdamW, Adam "
                                               "and LAMB)")
    adamw = OPTIMIZERS[name]
    if name in _ADAMW_MODE and a.get("optimizer.adamw_mode", True) is False:
        adamw = "Adam"
    a.values["optimizer"] = adamw
    a.copy("optimizer.lr", "optimizer.weight_decay", "optimizer.eps")
    betas = a.get("optimizer.betas")
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2):
            raise a.refuse("optimizer.betas", betas, "write two numbers, (beta1, beta2)")
        a.values["adam_beta1"], a.values["adam_beta2"] = float(betas[0]), float(betas[1])


def _model(a: Settings) -> None:
    model = a.settings.get("model")
    if not isinstance(model, dict):
        return
    for name in ("dim", "hidden_size", "depth", "num_layers", "num_heads", "num_attention_heads",
                 "max_position_embeddings"):
        if name in model:
            a.values[a.keys[f"model.{name}"].field] = a.field_value(f"model.{name}")
    kind = a.get("model.type")
    name = kind.leaf if isinstance(kind, Symbol) else kind
    if name in MODELS:
        a.values.update({field: value for field, value in MODELS[name].items() if field not in a.values})
    elif kind is not None and not {"hidden_size", "num_layers", "num_attention_heads"} <= set(a.values):
        raise a.refuse("model.type", kind, f"the sizes here are {', '.join(MODELS)}; for another shape give dim, "
                                           "depth and num_heads in the model dict")
    if a.get("model.checkpoint", False):
        a.values["recompute_checkpoint_every_layer"] = True
    dtype = a.get("model.dtype")
    if dtype is not None:
        leaf = dtype.leaf if isinstance(dtype, Symbol) else str(dtype)
        if leaf not in DTYPES:
            raise a.refuse("model.dtype", dtype, "write torch.half, torch.bfloat16 or torch.float")
        a.values["precision"] = DTYPES[leaf]
