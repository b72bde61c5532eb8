"""A data setting is declared once, as a `DataArgs` field: the reader request carries the section itself
(`DataRequest.data`) beside what the run decided, and re-declares none of its fields, under its name or
another (issue 55: the request used to copy 26 of them, 4 renamed)."""

from __future__ import annotations

import dataclasses

import pytest

from gpt2forge.core.flags import attribute_docs, flag
from gpt2forge.data.args import DataArgs
from gpt2forge.data.contract import DataRequest


def data_flags() -> set[str]:
    """Every flag a DataArgs field answers to, its older names included."""
    names = set()
    for field in dataclasses.fields(DataArgs):
        names.add(f"--{flag(field.name)}")
        names.update(field.metadata.get("aliases", ()))
    return names


def redeclared(record: type) -> list[str]:
    """Fields of `record` (besides the section it holds) that restate a DataArgs field: its name, or its
    flag in the field's docstring (a copy under another name)."""
    section = {f.name for f in dataclasses.fields(DataArgs)}
    flags, docs = data_flags(), attribute_docs(record)
    found = []
    for field in dataclasses.fields(record):
        if field.type in (DataArgs, "DataArgs"):
            continue
        named = [f for f in flags if f"``{f}``" in docs.get(field.name, "") or f"`{f}`" in docs.get(field.name, "")]
        if field.name in section or named:
            found.append(f"{field.name} ({', '.join(named) or 'a DataArgs field'})")
    return found


def test_the_request_declares_no_data_setting_twice():
    assert not redeclared(DataRequest), "declare data settings in DataArgs; read them as req.data.<field>"
    assert [f.name for f in dataclasses.fields(DataRequest) if f.type in (DataArgs, "DataArgs")] == ["data"]


@dataclasses.dataclass(frozen=True)
class NamedCopy:
    max_len: int
    """Sequence length."""
    seed: int = 0
    """The data order's seed."""


@dataclasses.dataclass(frozen=True)
class RenamedCopy:
    data: DataArgs
    """The data section."""
    cache_dir: str | None = None
    """``--data-cache-dir``: where the tokenized cache goes."""


@pytest.mark.parametrize("record,found", [(NamedCopy, ["seed (a DataArgs field)"]),
                                          (RenamedCopy, ["cache_dir (--data-cache-dir)"])])
def test_a_copied_setting_is_found(record, found):
    assert redeclared(record) == found
