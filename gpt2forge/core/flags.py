"""Command-line value parsing shared by every entry point, and config fields that are also flags.

Booleans take the reference's syntax: `--flag` alone means True, `--flag True|False|yes|no|1|0`.
A config section is a dataclass whose fields are made with `opt(default, help, *aliases)`: the
parser, the `--config FILE` reader and the `--help` text are generated from them
(gpt2forge.frontends.graphcore).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

_TRUE = {"true", "t", "1", "yes", "y"}
_FALSE = {"false", "f", "0", "no", "n"}

LIST_KINDS: dict[str, type] = {"list_int": int, "list_float": float, "list_str": str}
"""`kind` of a list-valued flag -> the type of one element (the flag takes one or more values)."""


def str_to_bool(value: str | bool) -> bool:
    """'True'/'false'/'yes'/'0'/... -> bool; argparse.ArgumentTypeError for anything else."""
    if isinstance(value, bool):
        return value
    v = str(value).lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")


def scalar_type(tp: Any) -> type:
    """The value type of an annotation: `int | None` -> int, `str` -> str."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def opt(default: Any, help: str, *aliases: str, **kwargs: Any) -> Any:
    """A dataclass field that is also a flag: `help` is its --help line, `aliases` older names.
    kwargs go to argparse (`choices`, `kind` = "bool" | "list_int" | "list_float" | "list_str")."""
    return dataclasses.field(default=default, metadata={"help": help, "aliases": aliases, **kwargs})


def flag(name: str) -> str:
    """Field name -> flag name without dashes (`learning_rate` -> `learning-rate`)."""
    return name.replace("_", "-")


def positive(section: Any, *names: str, optional: bool = False) -> list[str]:
    """Problems for fields of `section` that must be >= 1 (None allowed when `optional`)."""
    problems = []
    for name in names:
        value = getattr(section, name)
        if optional and value is None:
            continue
        if value < 1:
            problems.append(f"--{flag(name)} must be >= 1 (got {value})")
    return problems
