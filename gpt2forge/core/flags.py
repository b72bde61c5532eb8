"""Command-line value parsing shared by every entry point, and config fields that are also flags.

Booleans take the reference's syntax: `--flag` alone means True, `--flag True|False|yes|no|1|0`.
A config section is a dataclass whose fields are made with `opt(default, *aliases)`, each followed by
its attribute docstring, which is its `--help` text (`attribute_docs`): the parser, the `--config
FILE` reader and `--help` are generated from them (gpt2forge.frontends.graphcore), so a setting's
text is written once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
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


def opt(default: Any, *aliases: str, **kwargs: Any) -> Any:
    """A dataclass field that is also a flag, `aliases` its older names; its --help text is the attribute
    docstring under it. kwargs go to argparse (`choices`, `kind` = "bool" | "list_int" | "list_float" |
    "list_str")."""
    return dataclasses.field(default=default, metadata={"aliases": aliases, **kwargs})


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment in `cls`'s body (the
    attribute docstring), whitespace folded into single spaces."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {node.target.id: " ".join(after.value.value.split()) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


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
