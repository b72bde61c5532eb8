"""Loose JSON in and out for the corpus-preparation tools: one JSON object per line.

Reading streams (one line in memory at a time) and checks every line: invalid UTF-8, a malformed
line, a line that is not an object, a missing or non-string text field and an empty file each stop
with a `UsageError` naming the file and line, unless `skip_bad_lines` counts and skips them (an
empty file is always an error). Blank lines are skipped silently; line numbers stay those of the
file. Each document carries a key: its `url` or `id` field (the first present of `key_fields`),
else `line:<n>`.

Writing is atomic: `atomic_jsonl(path)` writes `path`'s temporary sibling and renames it over
`path` only when the block ends without an exception, so an interrupted run leaves nothing that
looks complete.

    with atomic_jsonl("clean.jsonl") as out:
        for doc in read_documents("raw.jsonl", skip_bad_lines=True, bad=counter):
            out.write(doc.record)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from gpt2forge.core.atomic import fsync_path, write_atomic
from gpt2forge.core.errors import UsageError, naming
from gpt2forge.core.json_lines import json_object, string_field

KEY_FIELDS = ("url", "id")
"""Fields that name a document, first present wins; else its line number."""


@dataclasses.dataclass
class Document:
    """One line of a loose-JSON file."""

    line: int
    """1-based line number in the file."""
    key: str
    """The document's `url`/`id` field, or `line:<n>`."""
    text: str
    """The text field."""
    record: dict
    """The whole JSON object (written back out with its other fields)."""


def _problem(raw: bytes, text_key: str) -> tuple[str, dict | None]:
    """(what is wrong with the line, or ""; the parsed object when nothing is)."""
    problem, obj = json_object(raw)
    if not problem and (problem := string_field(obj, text_key)):
        if text_key not in obj:
            problem += "; choose it with --text-key"
        return problem, None
    return problem, obj


def read_documents(path: str | Path, text_key: str = "text", key_fields: tuple[str, ...] = KEY_FIELDS,
                   skip_bad_lines: bool = False, bad: Counter | None = None,
                   span: tuple[int, int] | None = None) -> Iterator[Document]:
    """The documents of a loose-JSON file, in file order (module docstring for the checks).

    Args:
        path: the file.
        text_key: the field holding the text.
        key_fields: fields naming a document, first present wins.
        skip_bad_lines: count and skip bad lines instead of stopping.
        bad: where skipped lines are counted (`bad["bad_lines"]`), when given.
        span: (start, end) byte offsets: only the lines that start at or after `start` and before
            `end` (a sharded run's part of the file; the spans of a file's parts tile it, so each line
            is read by exactly one part). Line numbers then count from the span's first line; an
            error names the file's own line. A span without documents is no error.

    Raises:
        UsageError: an unreadable or empty file, or a bad line without `skip_bad_lines`.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise unreadable(path, exc) from None
    seen_any = False
    start, end = span or (0, None)
    with f:
        if start:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                start += len(f.readline())  # the line under way at `start` belongs to the span before
        pos = start
        for n, raw in enumerate(f, start=1):
            if end is not None and pos >= end:
                break
            pos += len(raw)
            if not raw.strip():
                continue
            seen_any = True
            problem, obj = _problem(raw, text_key)
            if problem:
                if not skip_bad_lines:
                    line = _line_number(path, pos - len(raw)) if span else n
                    raise UsageError(f"{path}:{line}: {problem}; fix the line or pass --skip-bad-lines to skip "
                                     "and count such lines")
                if bad is not None:
                    bad["bad_lines"] += 1
                continue
            key = next((str(obj[k]) for k in key_fields if obj.get(k) not in (None, "")), f"line:{n}")
            yield Document(n, key, obj[text_key], obj)
    if not seen_any and span is None:
        raise empty_file(path)


def unreadable(path: str | Path, exc: OSError) -> UsageError:
    """The error for an input file that cannot be opened."""
    return UsageError(f"{path}: cannot read ({exc.strerror}); check the path")


def empty_file(path: str | Path) -> UsageError:
    """The error for an input file without a non-blank line."""
    return UsageError(f'{path}: the file is empty; expected loose JSON, one object per line (e.g. {{"text": "...", '
                      '"url": "..."}})')


def _line_number(path: Path, offset: int) -> int:
    """The 1-based line of `path` that starts at byte `offset` (read up to it: for error messages only)."""
    newlines = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 1 << 24))
            newlines += block.count(b"\n")
            offset -= len(block)
    return newlines + 1


def line_starts(path: str | Path, block: int = 1 << 24, upto: int | None = None) -> np.ndarray:
    """(lines,) int64: the byte offset where each line of `path` starts (line n at index n - 1), as
    `read_documents` numbers them; a final newline starts no line. `upto`: only the first `upto`
    lines' (fewer if the file has fewer), reading no further than needed."""
    found, pos, count = [np.zeros(1, np.int64)], 0, 1
    with open(path, "rb") as f:
        while (upto is None or count <= upto) and (chunk := f.read(block)):
            found.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + pos + 1)
            pos += len(chunk)
            count += len(found[-1])
    starts = np.concatenate(found)
    if upto is not None and len(starts) > upto:
        return starts[:upto]
    return starts[:-1] if len(starts) > 1 and starts[-1] == pos else starts


class JsonlWriter:
    """Writes one JSON object per line (UTF-8, non-ASCII kept as is) and counts them."""

    def __init__(self, f: IO[str]):
        self._f = f
        self.count = 0

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1


@contextlib.contextmanager
def atomic_jsonl(path: str | Path) -> Iterator[JsonlWriter]:
    """A `JsonlWriter` whose file appears at `path` only if the block completes (module docstring)."""
    path = Path(path)
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{path}: {path.parent} is a file, not a folder; write somewhere else")
    path.parent.mkdir(parents=True, exist_ok=True)  # as write_atomic: an output's folder is created
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming(path), open(tmp, "w", encoding="utf-8") as f:
            yield JsonlWriter(f)
            f.flush()
            os.fsync(f.fileno())
        with naming(path):
            os.replace(tmp, path)
            fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def already_complete(path: str | Path, overwrite: bool) -> bool:
    """True (after saying so) when `path` exists and --overwrite is off: outputs are written
    atomically, so one that exists is complete and the work can be skipped."""
    if Path(path).exists() and not overwrite:
        print(f"{path} exists (written atomically, so complete); skipping (pass --overwrite to redo)")
        return True
    return False


def atomic_json(path: str | Path, obj: object) -> None:
    """Write one JSON document (a manifest, duplicate pairs, groups) atomically."""
    write_atomic(path, json.dumps(obj, ensure_ascii=False, indent=1) + "\n")
