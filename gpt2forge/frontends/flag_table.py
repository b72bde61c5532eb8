"""Other tools' command lines -> TrainConfig: the machinery every foreign front end shares.

A front end (`megatron` for Megatron-LM's `pretrain_gpt.py`, `run_clm` for Hugging Face's
`run_clm_no_trainer.py`) is one table of `Flag` rows: a flag's spellings, its `--help` group, what
it becomes here and its help line. A row's target is one of
- a TrainConfig field name: the value is stored there (after the row's type conversion);
- `Own("field")`: a setting of the other tool with no TrainConfig field (Megatron's global batch,
  run_clm's --output_dir): stored on the front end's typed record of such settings (`FrontEnd.own`,
  a dataclass), which the front end's named rules turn into TrainConfig values;
- a function `(value, values) -> None` for what takes more than a rename;
- `Refused("why")`: the flag exists in the other tool but has no meaning here; giving it stops with
  one line that names it and says why (exit 2). Nothing is dropped silently.
`FrontEnd.parse(argv)` returns a `Parsed`: the flat values the given flags set, the record of the
tool's own settings and which flag set each; the front end then applies its tool's defaults and
cross-flag rules and builds one TrainConfig, run by the one trainer. `equivalent_command(values)`
is the same run in `train_gpt2.py`'s own flags (`--print-equivalent`), which is what the tests
compare against.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from gpt2forge.core.errors import UsageError
from gpt2forge.core.flags import flag
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


@dataclasses.dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    group: str
    target: Target
    help: str
    type: Callable[[str], Any] | None = str
    """Converts the value; None: a switch (no value, True when given)."""
    nargs: str | None = None
    default: Any = argparse.SUPPRESS
    """What a bare flag means when `nargs` is "?" (argparse's `const`)."""
    stands_for: tuple[str, ...] = ()
    """The `train_gpt2.py` words this flag stands for when the target is a rule (`--dataset jsonl`,
    `--input-files`): an error naming them names this flag instead (a field target stands for its own flag)."""

    def our_words(self) -> tuple[str, ...]:
        """The `train_gpt2.py` flags (or flag-and-value phrases) this row stands for."""
        own = (f"--{flag(self.target)}",) if isinstance(self.target, str) else ()
        return own + self.stands_for


def switch_to(field_name: str, value: Any = True) -> Callable[[Any, dict], None]:
    """A target that sets `field_name` to `value` whatever the flag's own value."""
    def apply(_value, values: dict) -> None:
        values[field_name] = value
    return apply


def accept(_value, _values: dict) -> None:
    """The target of flags that ask for what this trainer always does."""


KFAC_FLAGS: tuple[Flag, ...] = (
    Flag(("--kfac",), "K-FAC", switch_to("kfac"), field_help("kfac"), None),
    *(Flag((f"--{flag(name)}",), "K-FAC", name, field_help(name), kind, nargs)
      for name, kind, nargs in (("kfac_factor_update_steps", int, None), ("kfac_inv_update_steps", int, None),
                                ("kfac_damping", float, None), ("kfac_factor_decay", float, None),
                                ("kfac_kl_clip", float, None), ("kfac_skip_layers", str, "+"),
                                ("kfac_compute_method", str, None))),
)
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
            kw: dict[str, Any] = {"dest": f"flag{i}", "help": _help(row)}
            if row.type is None:
                kw.update(action="store_const", const=True)
            else:
                kw.update(type=row.type, metavar=row.names[0].lstrip("-").replace("-", "_").upper())
                if row.nargs:
                    kw["nargs"] = row.nargs
                if row.nargs == "?":
                    kw["const"] = row.default
            groups[row.group].add_argument(*row.names, **kw)
        return parser

    def flag_table(self, tool: str) -> list[str]:
        """The Markdown table of the flags for the docs, one line per row ("refused" rows with their reason)."""
        lines = [f"| {tool} flag | Group | Here: `train_gpt2.py` flag, meaning |", "| --- | --- | --- |"]
        for row in self.flags:
            names = ", ".join(f"`{name}`" for name in row.names)
            if isinstance(row.target, Refused):
                here = f"refused: {row.target.why}"
            elif isinstance(row.target, str):
                here = f"`--{flag(row.target)}`: {row.help}"
            else:
                here = row.help
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
            if isinstance(row.target, Refused):
                raise UsageError(f"{row.names[0]}: {row.target.why}")
            if isinstance(row.target, Own):
                setattr(parsed.own, row.target.field, value)
                parsed.set_by[row.target] = row.names[0]
                continue
            before = dict(parsed.values)
            if isinstance(row.target, str):
                parsed.values[row.target] = value
            else:
                row.target(value, parsed.values)
            parsed.set_by.update({name: row.names[0] for name in parsed.values
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
            name = next((n for n in row.names if n in typed), row.names[0]) if i in given else row.names[0]
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


def _help(row: Flag) -> str:
    if isinstance(row.target, Refused):
        return f"refused here: {row.target.why}"
    if isinstance(row.target, str):
        return f"{row.help} (train_gpt2.py --{flag(row.target)})"
    return row.help


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
