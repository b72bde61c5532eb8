"""Another tool's config file -> TrainConfig values: the reader that DeepSpeed's ds.json
(gpt2forge.frontends.deepspeed) and Colossal-AI's .py configs (gpt2forge.frontends.colossal) share.

A file's settings are a nested mapping read by dotted key (`fp16.loss_scale_window`). Each front end lists the
keys it reads as `Key` rows, which name their target as flag rows do (gpt2forge.frontends.flag_table): `field=`
a TrainConfig field, whose flag and type the key takes (`copy` stores it), or `help=` what the front end's rule
does with it. The rows are the docs' tables (`key_table`); reading a key no row names is an internal error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpt2forge.core.errors import UsageError
from gpt2forge.core.flags import flag
from gpt2forge.frontends.graphcore import field_argument


@dataclasses.dataclass(frozen=True)
class Key:
    """One setting of the file: `name` (dotted) and `field` (a TrainConfig field) or `help`."""

    name: str
    field: str | None = None
    """The TrainConfig field the setting becomes (its flag is the docs' meaning, its type the value's)."""
    note: str = ""
    """After the field's flag in the docs: what the key adds (`(0: no clipping)`, a default)."""
    help: str | None = None
    """What the front end's rule makes of the setting (a key without a field)."""

    def __post_init__(self) -> None:
        assert (self.field is None) != (self.help is None), f"{self.name}: give field or help"

    def meaning(self) -> str:
        """The docs' "Here" cell: the field's flag and the note, or the help."""
        if self.help is not None:
            return self.help
        return f"`--{flag(self.field)}`" + (f" {self.note}" if self.note else "")


def key_table(keys: Iterable[Key]) -> dict[str, str]:
    """Dotted key -> what it becomes here, for the docs."""
    return {key.name: key.meaning() for key in keys}


_MISSING = object()


class Settings:
    """One file's settings applied to flat TrainConfig values (`values`): read by dotted key, with what was read.

    Args:
        where: how errors name the file (`--config PATH`, `PATH`).
        show: how errors show a refused value.
    """

    def __init__(self, path: str, settings: Mapping[str, Any], keys: Iterable[Key], where: str,
                 show: Callable[[Any], str] = repr):
        self.path, self.settings, self.where, self.show = path, settings, where, show
        self.keys = {key.name: key for key in keys}
        self.values: dict[str, Any] = {}
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        """The setting at dotted `key`, or `default` when the file does not have it."""
        assert key in self.keys, key  # every key read is documented
        node: Any = self.settings
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        self.read.append(key)
        return node

    def has(self, key: str) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def refuse(self, key: str, value: Any, fix: str) -> UsageError:
        """The one-line error for a value this trainer cannot reproduce: `fix` says what to write instead."""
        return UsageError(f"{self.where}: {key} {self.show(value)}: {fix}")

    def number(self, key: str, kind: type, default: Any = None) -> Any:
        """The setting as an int or float (a whole float counts as an int), `default` when absent."""
        value = self.get(key, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise self.refuse(key, value, f"must be {'a whole number' if kind is int else 'a number'}")
        return kind(value)

    def field_value(self, key: str, default: Any = None) -> Any:
        """The setting as a value of its row's field (`number` of the field's type)."""
        return self.number(key, field_argument(self.keys[key].field)["type"], default)

    def copy(self, *keys: str) -> None:
        """Each of `keys` the file has, stored in its row's field."""
        for key in keys:
            value = self.field_value(key)
            if value is not None:
                self.values[self.keys[key].field] = value

    def leaves(self, empty_dicts: bool = False) -> list[str]:
        """Dotted paths of every setting in the file (lists are leaves; `empty_dicts`: an empty dict is one)."""
        return _leaves(self.settings, "", empty_dicts)


def _leaves(node: Mapping[str, Any], prefix: str, empty_dicts: bool) -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and (value or not empty_dicts):
            out += _leaves(value, path + ".", empty_dicts)
        else:
            out.append(path)
    return out
