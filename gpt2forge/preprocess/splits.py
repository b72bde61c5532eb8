"""Loose JSON -> fixed train / dev / test files (Megatron-LM's `scripts/split_json.py`, seed 001).

All input lines, in input order, are shuffled with a seeded permutation (Megatron's `random.shuffle` was
unseeded: here the same `seed` gives the same files) and cut in that order: dev takes ceil(dev x N) lines,
test ceil(test x N), train the rest, as Megatron counted them. Each output gets a `.map` beside it with
Megatron's header `file<TAB>line #` and, per line, the input's index and the line's number there. Lines
are copied stripped of surrounding whitespace (as Megatron's `l.strip()`), never parsed. Memory: 24 bytes
per line (offsets, input index, the permutation); every output is written atomically.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gpt2forge.core.atomic import atomic_file
from gpt2forge.core.errors import UsageError

SPLIT_FILES = ("train.json", "dev.json", "test.json")
"""Megatron's output names, in split order."""


def split_counts(total: int, dev: float, test: float) -> tuple[int, int, int]:
    """(train, dev, test) lines of `total`: dev and test rounded up, train the rest (Megatron's rule).

    Raises:
        UsageError: a fraction outside [0, 1), or dev and test leaving no training line.
    """
    for value in (dev, test):
        if not 0 <= value < 1:
            raise UsageError(f"--test_percent {value}: a fraction of the lines in [0, 1), e.g. 0.05")
    d, t = math.ceil(dev * total), math.ceil(test * total)
    if d + t >= total:
        raise UsageError(f"--test_percent {dev} {test}: dev ({d}) and test ({t}) take all {total} lines; "
                         "lower them or add data")
    return total - d - t, d, t


def line_starts(path: Path) -> np.ndarray:
    """Byte offsets of the lines of `path` (a last line without a newline included)."""
    starts, pos = [np.zeros(1, dtype=np.int64)], 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n"))
            starts.append(nl.astype(np.int64) + pos + 1)
            pos += len(chunk)
    out = np.concatenate(starts)
    return out[out < pos]  # no line starts at the end of the file


def split_json(inputs: list[str], output_dir: str | Path, dev: float, test: float, seed: int) -> tuple[int, ...]:
    """Write `SPLIT_FILES` and their `.map` files into `output_dir` (created); returns the line counts.

    Raises:
        UsageError: a missing input, no lines at all, or bad fractions.
    """
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise UsageError(f"--input_files {p}: no such file")
    starts = [line_starts(p) for p in paths]
    total = sum(len(s) for s in starts)
    if total == 0:
        raise UsageError(f"--input_files {' '.join(inputs)}: no lines to split")
    counts = split_counts(total, dev, test)
    source = np.concatenate([np.full(len(s), i, dtype=np.int64) for i, s in enumerate(starts)])
    line = np.concatenate([np.arange(len(s), dtype=np.int64) for s in starts])
    order = np.random.default_rng(seed).permutation(total)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    handles = [open(p, "rb") for p in paths]
    try:
        bounds = np.cumsum([0, *counts])
        for name, lo, hi in zip(SPLIT_FILES, bounds[:-1], bounds[1:]):
            chosen = order[lo:hi]
            _write(out / name, (_read(handles[source[k]], starts[source[k]][line[k]]) for k in chosen))
            _write(out / f"{name}.map", [b"file\tline #", *(f"{source[k]}\t{line[k]}".encode() for k in chosen)])
    finally:
        for h in handles:
            h.close()
    return counts


def _read(f, offset: int) -> bytes:
    f.seek(offset)
    return f.readline().strip()


def _write(path: Path, lines) -> None:
    with atomic_file(path) as f:
        for text in lines:
            f.write(text + b"\n")
