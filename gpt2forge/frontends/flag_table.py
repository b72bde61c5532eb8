"""Other tools' command lines -> TrainConfig: the machinery every foreign front end shares.

A front end (`megatron` for Megatron-LM's `pretrain_gpt.py`, `run_clm` for Hugging Face's
`run_clm_no_trainer.py`) is one table of keyword `Flag` rows: a flag's spellings and exactly one of
what it becomes here:
- `field="learning_rate"`: a TrainConfig field; the value is stored there, and the row's type and
  `--help` are the field's own (written once, in the room that consumes it);
- `own="global_batch"`: a setting of the other tool with no TrainConfig field (Megatron's global batch,
  run_clm's --output_dir), stored on the front end's typed record of such settings (`FrontEnd.own`, a
  dataclass), whose field gives the type and the help; the front end's named rules turn it into
  TrainConfig values;
- `sets={"precision": "fp16"}`: a switch that sets fields to fixed values (a renaming of `--precision
  fp16`);
- `rule=function`: `(value, values) -> None`, for what takes more than a rename;
- `accepted="why"`: asks for what this trainer always does;
- `refused="why"`: the flag exists in the other tool but has no meaning here; giving it stops with one
  line that names it and says why (exit 2). Nothing is dropped silently.
`group(name, *rows)` puts rows in a `--help` group. `FrontEnd.parse(argv)` returns a `Parsed`: the flat
values the given flags set, the record of the tool's own settings and which flag set each; the front
end then applies its tool's defaults and cross-flag rules and builds one TrainConfig, run by the one
trainer. `equivalent_command(values)` is the same run in `train_gpt2.py`'s own flags
(`--print-equivalent`), which is what the tests compare against.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

from gpt2forge.core.errors import UsageError
from gpt2forge.core.flags import attribute_docs, flag, scalar_type
from gpt2forge.frontends.graphcore import field_argument
from gpt2forge.train.config import FIELD_SECTION, field_help


@dataclasses.dataclass(frozen=True)
class Refused:
    """A flag of the other tool with no meaning here: `why` is the second half of its one-line error."""

    why: str


@dataclasses.dataclass(frozen=True)
class Own:
    """A setting of the other tool with no TrainConfig field: stored as `field` of the front end's
    `own` record (a switch stores True)."""

    field: str


Target = str | Own | Callable[[Any, dict], None] | Refused


@dataclasses.dataclass
class Parsed:
    """What `FrontEnd.parse` read from one command line."""

    values: dict[str, Any]
    """TrainConfig field -> value, for the given flags only."""
    own: Any
    """The front end's `own` record: the tool's settings that have no TrainConfig field."""
    set_by: dict[str | Own, str]
    """A TrainConfig field (or an `Own` setting) -> the flag that set it, as the user spelt its row's first name."""


_OF_TARGET: Any = object()
"""`Flag.type` default: the type of the field the row stores (a switch for `sets`, else str)."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of the other tool (module doc): give `name` and exactly one of `field`, `own`, `sets`,
    `rule`, `accepted`, `refused`."""

    name: str
    aliases: tuple[str, ...] = ()
    """The flag's other spellings (older names)."""
    field: str | None = None
    own: str | None = None
    sets: dict[str, Any] | None = None
    rule: Callable[[Any, dict], None] | None = None
    accepted: str | None = None
    refused: str | None = None
    note: str = ""
    """A field or `own` row: what this tool's flag adds to the field's help (in parentheses after it)."""
    help: str | None = None
    """The `--help` line; None: the docstring of the field (or `own` setting) the row stores, or for `sets`
    of the field it sets. A row that only renames a field carries none."""
    type: Any = _OF_TARGET
    """Converts the value; None: a switch (no value, True when given)."""
    nargs: str | None = None
    const: Any = argparse.SUPPRESS
    """What a bare flag means when `nargs` is "?"."""
    stands_for: tuple[str, ...] = ()
    """The `train_gpt2.py` words this flag stands for when the target is not a field (`--dataset jsonl`,
    `--input-files`): an error naming them names this flag instead (a field target stands for its own flag)."""
    group: str = ""
    """The `--help` group (set by `group`)."""

    def __post_init__(self) -> None:
        targets = [t for t in (self.field, self.own, self.sets, self.rule, self.accepted, self.refused)
                   if t is not None]
        assert len(targets) == 1, f"{self.name}: give exactly one of field, own, sets, rule, accepted, refused"
        assert self.field is None or self.field in FIELD_SECTION, f"{self.name}: no TrainConfig field {self.field}"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def target(self) -> Target:
        """What the parser does with the value: a field name, an `Own` setting, a function or a `Refused`."""
        if self.field is not None:
            return self.field
        if self.own is not None:
            return Own(self.own)
        if self.refused is not None:
            return Refused(self.refused)
        if self.sets is not None:
            return _setter(self.sets)
        return self.rule or accept

    def our_words(self) -> tuple[str, ...]:
        """The `train_gpt2.py` flags (or flag-and-value phrases) this row stands for."""
        own = (f"--{flag(self.field)}",) if self.field is not None else ()
        return own + self.stands_for


def group(name: str, *rows: Flag) -> tuple[Flag, ...]:
    """`rows` in the `--help` group `name`."""
    return tuple(dataclasses.replace(row, group=name) for row in rows)


def _setter(fields: dict[str, Any]) -> Callable[[Any, dict], None]:
    def apply(_value, values: dict) -> None:
        values.update(fields)
    return apply


def accept(_value, _values: dict) -> None:
    """The target of flags that ask for what this trainer always does."""


def _sets_words(fields: dict[str, Any]) -> str:
    """`{"precision": "fp16"}` -> `--precision fp16` (True: the bare flag)."""
    return " ".join(f"--{flag(k)}" if v is True else f"--{flag(k)} {str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in fields.items())


KFAC_FLAGS: tuple[Flag, ...] = group(
    "K-FAC", Flag(name="--kfac", sets={"kfac": True}),
    *(Flag(name=f"--{flag(name)}", field=name) for name in (
        "kfac_factor_update_steps", "kfac_inv_update_steps", "kfac_damping", "kfac_factor_decay", "kfac_kl_clip",
        "kfac_skip_layers", "kfac_compute_method")))
"""K-FAC (docs/training.md#k-fac): gpt2forge's own flags, spelt the same in every front end."""


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    prog: str
    description: str
    groups: tuple[str, ...]
    """The --help groups, in the other tool's order."""
    flags: tuple[Flag, ...]
    unknown_hint: str
    """Appended to argparse's "unrecognized arguments" message: where the mapping is documented."""
    own: type | None = None
    """The dataclass (every field with a default) of the tool's settings that `Own` rows store."""

    def build_parser(self) -> argparse.ArgumentParser:
        """The flags in their groups; defaults SUPPRESSed, so only given flags appear."""
        parser = _Parser(prog=self.prog, argument_default=argparse.SUPPRESS, description=self.description)
        parser.unknown_hint = self.unknown_hint
        parser.add_argument("--print-equivalent", action="store_true",
                            help="print the same run as a train_gpt2.py command line, then exit")
        groups = {name: parser.add_argument_group(name) for name in self.groups}
        for i, row in enumerate(self.flags):
            kw: dict[str, Any] = {"dest": f"flag{i}", "help": self.help_line(row)}
            kind, nargs, const = self.value_kind(row)
            if kind is None:
                kw.update(action="store_const", const=True)
            else:
                kw.update(type=kind, metavar=row.name.lstrip("-").replace("-", "_").upper())
                if nargs:
                    kw["nargs"] = nargs
                if nargs == "?":
                    kw["const"] = const
            groups[row.group].add_argument(*row.names, **kw)
        return parser

    def value_kind(self, row: Flag) -> tuple[Any, str | None, Any]:
        """(type, nargs, const) of `row`: its own, else its field's (a bool field takes `--flag [BOOL]`),
        else its `own` setting's (a bool setting is a switch); `sets` rows are switches, the rest take a string."""
        if row.type is not _OF_TARGET:
            return row.type, row.nargs, row.const
        if row.field is not None:
            arg = field_argument(row.field)
            return arg["type"], arg.get("nargs"), arg.get("const", argparse.SUPPRESS)
        if row.own is not None:
            hint = scalar_type(typing.get_type_hints(self.own)[row.own])
            return (None if hint is bool else hint), row.nargs, row.const
        return (None if row.sets is not None else str), row.nargs, row.const

    def row_help(self, row: Flag) -> str:
        """What the row means here: its own help, else its field's (or `own` setting's) docstring."""
        if row.help is not None:
            return row.help
        if row.note:
            return f"{self.row_help(dataclasses.replace(row, note=''))} ({row.note})"
        if row.refused is not None or row.accepted is not None:
            return row.refused or row.accepted
        if row.own is not None:
            return attribute_docs(self.own)[row.own]
        if row.sets is not None:
            return field_help(next(iter(row.sets)))
        assert row.field is not None, f"{row.name}: a rule row needs help"
        return field_help(row.field)

    def help_line(self, row: Flag) -> str:
        """The row's `--help` text: what it means, and the `train_gpt2.py` flag it stands for."""
        if row.refused is not None:
            return f"refused here: {row.refused}"
        ours = self.our_flag(row)
        return f"{self.row_help(row)} (train_gpt2.py {ours})" if ours else self.row_help(row)

    @staticmethod
    def our_flag(row: Flag) -> str:
        """The `train_gpt2.py` flag a renaming row stands for (`--learning-rate`, `--precision fp16`), else ""."""
        if row.field is not None:
            return f"--{flag(row.field)}"
        return _sets_words(row.sets) if row.sets is not None else ""

    def flag_table(self, tool: str) -> list[str]:
        """The Markdown table of the flags for the docs, one line per row ("refused" rows with their reason)."""
        lines = [f"| {tool} flag | Group | Here: `train_gpt2.py` flag, meaning |", "| --- | --- | --- |"]
        for row in self.flags:
            names = ", ".join(f"`{name}`" for name in row.names)
            ours = self.our_flag(row)
            if row.refused is not None:
                here = f"refused: {row.refused}"
            elif ours:
                here = f"`{ours}`: {self.row_help(row)}"
            else:
                here = self.row_help(row)
            lines.append(f"| {names} | {row.group} | {cell(here)} |")
        return lines

    def parse(self, argv: Sequence[str]) -> Parsed:
        """The given flags' values, the tool's own settings and which flag set each.

        Raises:
            UsageError: a refused flag, an unknown flag or a bad value (one line).
        """
        given = vars(self.build_parser().parse_args(list(argv)))
        given.pop("print_equivalent", None)
        parsed = Parsed({}, self.own() if self.own is not None else None, {})
        for key, value in given.items():
            row = self.flags[int(key.removeprefix("flag"))]
            if row.refused is not None:
                raise UsageError(f"{row.name}: {row.refused}")
            if row.own is not None:
                setattr(parsed.own, row.own, value)
                parsed.set_by[Own(row.own)] = row.name
                continue
            before = dict(parsed.values)
            if row.field is not None:
                parsed.values[row.field] = value
            else:
                row.target(value, parsed.values)
            parsed.set_by.update({name: row.name for name in parsed.values
                                  if name not in before or parsed.values[name] != before[name]})
        return parsed

    def own_words(self, argv: Sequence[str]) -> dict[str, str]:
        """`train_gpt2.py` words -> this tool's flag, for `in_own_words`: the row the user gave wins (in the
        spelling typed), else the first row that stands for them. Words no row stands for are absent."""
        argv = list(argv)
        typed = {arg.split("=", 1)[0] for arg in argv if arg.startswith("-")}
        try:
            parsed = self.build_parser().parse_known_args(argv)[0]
            given = {int(key.removeprefix("flag")) for key in vars(parsed) if key.startswith("flag")}
        except UsageError:  # the parser's own message already names this tool's flags
            given = set()
        words: dict[str, str] = {}
        order = sorted(range(len(self.flags)), key=lambda i: i not in given)  # given rows first, then table order
        for i in order:
            row = self.flags[i]
            name = next((n for n in row.names if n in typed), row.name) if i in given else row.name
            for phrase in row.our_words():
                words.setdefault(phrase, name)
        return words


def in_own_words(message: str, words: dict[str, str]) -> str:
    """`message` with each `train_gpt2.py` flag (or flag-and-value phrase) in `words` replaced by the
    front end's flag: errors raised below the front end (config checks, data, the trainer) name only
    flags the user can type. The longest phrase wins (`--dataset jsonl` before `--dataset`)."""
    if not words:
        return message
    phrases = sorted(words, key=len, reverse=True)
    pattern = re.compile("|".join(rf"(?<![\w-]){re.escape(p)}(?![\w-])" for p in phrases))
    return pattern.sub(lambda m: words[m.group(0)], message)


class _Parser(argparse.ArgumentParser):
    unknown_hint = ""

    def error(self, message: str):  # argparse's own message, as one line with the fix
        if "unrecognized arguments" in message:
            message += self.unknown_hint
        raise UsageError(message)


def cell(text: str) -> str:
    """`text` inside a Markdown table cell."""
    return text.replace("|", "\\|")


def equivalent_command(values: dict[str, Any]) -> list[str]:
    """`train_gpt2.py` arguments of the run `values` describes (one flag per field)."""
    out = []
    for name, value in values.items():
        if name not in FIELD_SECTION:
            continue
        out.append(f"--{flag(name)}")
        if isinstance(value, list):
            out += [str(v) for v in value]
        elif isinstance(value, bool):
            out.append(str(value).lower())
        else:
            out.append(str(value))
    return out


def wants_equivalent(argv: Sequence[str]) -> bool:
    """Whether argv asks for `--print-equivalent` (print the train_gpt2.py line instead of training)."""
    return "--print-equivalent" in argv
