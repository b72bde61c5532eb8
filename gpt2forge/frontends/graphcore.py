"""Command line -> TrainConfig. The parser is generated from the section dataclasses' fields, so a
flag, its type, its --help line and its validation live in one place (train/config.py and the
sections it composes); --help lists the flags grouped by section.

Booleans take the reference's syntax: `--flag` alone means True, `--flag True|False|yes|no|1|0`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpt2forge.core.errors import UsageError
from gpt2forge.core.flags import LIST_KINDS, flag, scalar_type, str_to_bool
from gpt2forge.train.config import FIELD_SECTION, SECTIONS, TrainConfig, field_help


def _section_fields() -> list[tuple[str, dataclasses.Field, Any]]:
    """(section attribute, field, its type annotation) for every flag, in --help order."""
    out = []
    for attr, section_cls in SECTIONS.items():
        hints = typing.get_type_hints(section_cls)
        out += [(attr, f, hints[f.name]) for f in dataclasses.fields(section_cls)]
    return out


@functools.cache
def _fields() -> dict[str, tuple[dataclasses.Field, Any]]:
    return {f.name: (f, hint) for _, f, hint in _section_fields()}


def field_argument(name: str) -> dict[str, Any]:
    """The argparse keywords of TrainConfig field `name` as a flag (type, nargs, const, metavar): a bool takes
    `--flag [BOOL]` (bare: True), a list one or more values, anything else one value of the field's type.
    Every front end's row for the field takes its value so (gpt2forge.frontends.flag_table)."""
    f, hint = _fields()[name]
    kind = f.metadata.get("kind")
    if kind == "bool":
        return {"type": str_to_bool, "nargs": "?", "const": True, "metavar": "BOOL"}
    if kind in LIST_KINDS:
        return {"type": LIST_KINDS[kind], "nargs": "+"}
    return {"type": scalar_type(hint)}


REFERENCE_FLAGS = frozenset({
    "model", "max_len", "dataset", "input_files", "stride", "val_num", "seed", "num_workers", "async_dataloader",
    "epochs", "training_steps", "optimizer", "weight_decay", "learning_rate", "lr_schedule", "lr_warmup",
    "lr_warmup_steps", "lr_decay_steps", "batch_size", "gradient_accumulation", "replication_factor",
    "device_iterations", "layers_per_ipu", "ipus_per_replica", "replicated_tensor_sharding", "matmul_proportion",
    "enable_sequence_serialized", "serialized_seq_len", "embedding_serialization_factor", "remap_logit",
    "recompute_checkpoint_every_layer", "recompute_checkpoint_layers", "optimizer_state_offchip", "loss_scaling",
    "auto_loss_scaling", "enable_half_partials", "executable_cache_dir", "custom_ops", "compile_only",
    "checkpoint_input_dir", "checkpoint_output_dir", "save_per_epochs", "save_per_steps",
    "resume_training_from_checkpoint", "log_steps", "use_wandb"})
"""The fields whose flags the Graphcore application has (reference/graphcore_gpt2.md); every other flag is new
here, which the "New" column of docs/training.md's flag table says (`flag_file_table`)."""


def build_parser(prog: str = "train_gpt2.py") -> argparse.ArgumentParser:
    """The trainer's parser. Defaults are SUPPRESSed so the merge knows which flags were given."""
    parser = argparse.ArgumentParser(
        prog=prog, argument_default=argparse.SUPPRESS,
        description="Pretrain GPT-2 on CPUs and CUDA GPUs (Graphcore GPT-2 application flags).")
    parser.add_argument("--config", help="JSON or YAML file of flag values, or a Colossal-AI config (.py, read "
                                         "without running it: docs/training.md); the command line wins")
    parser.add_argument("--from_torch", "--from-torch", dest="from_torch", action="store_true",
                        help="(Colossal-AI's) accepted: torchrun's environment (RANK, WORLD_SIZE) is always read")
    parser.add_argument("--train-path", dest="train_path",
                        help="(old) generated | a .pkl path | tfrecord (with --tfrecord-path GLOB) | dynamic "
                             "(mmap, with --data-prefix PREFIX); sets --dataset (and --input-files for a .pkl)")
    groups = {attr: parser.add_argument_group(f"{attr} ({section_cls.__name__})", section_cls.__doc__)
              for attr, section_cls in SECTIONS.items()}
    for attr, f, _ in _section_fields():
        kw: dict[str, Any] = {"dest": f.name, "help": f"{field_help(f.name)} (default: {f.default})",
                              **field_argument(f.name)}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        groups[attr].add_argument(f"--{flag(f.name)}", *f.metadata.get("aliases", ()), **kw)
    return parser


def flag_file_table() -> list[str]:
    """docs/training.md's table of every `train_gpt2.py` flag: the file that defines it (its section's, beside
    the code that consumes it) and whether the reference has it."""
    root = Path(__file__).resolve().parents[2]
    lines = ["| `train_gpt2.py` flag | Defined in | New |", "| --- | --- | --- |"]
    here = Path(__file__).resolve().relative_to(root)
    lines += [f"| `--config` | `{here}` | new |", f"| `--train-path` | `{here}` |  |",
              f"| `--from_torch`, `--from-torch` | `{here}` | new |"]
    for attr, f, _ in _section_fields():
        names = ", ".join(f"`{name}`" for name in (f"--{flag(f.name)}", *f.metadata.get("aliases", ())))
        path = Path(inspect.getsourcefile(SECTIONS[attr])).resolve().relative_to(root)
        lines.append(f"| {names} | `{path}` | {'' if f.name in REFERENCE_FLAGS else 'new'} |")
    return lines


def load_config_file(path: str, data_given: bool = False) -> dict[str, Any]:
    """A JSON/YAML mapping of field or flag names to values, or a Colossal-AI .py config's values
    (`data_given`: the command line names the data, see gpt2forge.frontends.colossal)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: file not found")
    if p.suffix == ".py":
        from gpt2forge.frontends.colossal import colossal_values  # lazy: read only for a .py config

        return colossal_values(path, data_given)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        if p.suffix in (".yml", ".yaml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml and json raise different types; both mean "not parseable"
        raise UsageError(f"--config {path}: cannot parse ({type(exc).__name__}); fix the file") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of flag names to values")
    names = set(FIELD_SECTION)
    out = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in names:
            raise UsageError(f"--config {path}: unknown key {key!r}; keys are the trainer's flag names")
        out[name] = value
    return out


def _apply_train_path(given: dict[str, Any]) -> None:
    """The pre-SDK-3.0 `--train-path`: 'generated', a tfrecord pattern, 'dynamic' (mmap) or a .pkl."""
    value = given.pop("train_path", None)
    if value is None:
        return
    if value == "generated":
        given.setdefault("dataset", "generated")
    elif "tfrecord" in value:
        given.setdefault("dataset", "tfrecord")
    elif "dynamic" in value:
        given.setdefault("dataset", "mmap")
    else:
        given.setdefault("dataset", "pickle")
        given.setdefault("input_files", [value])


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """defaults < --config file < command line; raises UsageError for invalid combinations.

    argparse itself reports unknown flags and bad values (exit code 2, one line + usage).
    """
    parser = build_parser()
    given = vars(parser.parse_args(sys.argv[1:] if argv is None else list(argv)))
    _apply_train_path(given)
    given.pop("from_torch", None)
    merged: dict[str, Any] = {}
    config_file = given.pop("config", None)
    if config_file:
        merged.update(load_config_file(config_file, data_given="dataset" in given or "input_files" in given))
    merged.update(given)
    _coerce_file_values(merged)
    return TrainConfig.from_flat(merged)


def _coerce_file_values(values: dict[str, Any]) -> None:
    """Values from a config file arrive as YAML/JSON types: apply the flags' types to them."""
    for _, f, hint in _section_fields():
        if f.name not in values:
            continue
        if values[f.name] is None:
            if f.default is not None:  # `key:` with no value in YAML, or null in JSON
                raise UsageError(f"--{flag(f.name)}: no value given; give one or leave the key out")
            continue
        v = values[f.name]
        kind = f.metadata.get("kind")
        try:
            if kind == "bool":
                values[f.name] = str_to_bool(v)
            elif kind in LIST_KINDS:
                elem = LIST_KINDS[kind]
                values[f.name] = [elem(x) for x in (v if isinstance(v, list) else str(v).split())]
            else:
                values[f.name] = scalar_type(hint)(v)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise UsageError(f"--{flag(f.name)}: invalid value {v!r}") from None
        choices = f.metadata.get("choices")
        if choices and values[f.name] not in choices:
            raise UsageError(f"--{flag(f.name)} {v!r} is not one of {', '.join(choices)}")
