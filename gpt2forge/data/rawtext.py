"""``--dataset jsonl`` and ``--dataset text``: train straight from raw text, tokenized once into a cache.

``--input-files`` takes files or globs (quoted: ``'docs/*.jsonl'``), read in the order given, each glob's
matches sorted. ``jsonl``: one document per line, its text in the ``--json-key`` field (blank lines are
skipped; line numbers stay the file's). ``text``: one document per file, the whole file (``--json-key``
is ignored). Every document is followed by the tokenizer's end-of-document token, as
``data/preprocess_data.py --append-eod`` writes it, and an empty text adds nothing, as there.

The first run tokenizes on every core into a Megatron ``.bin/.idx`` in the cache (``text_cache``: keyed
by the inputs' content and the tokenizer; a changed input or tokenizer rebuilds, an unchanged one is
reused at once, a concurrent run waits for the build), then trains exactly as ``--dataset mmap`` on that
prefix (``--split``, blends, document masks). ``--input-files W1 GLOB1 W2 GLOB2`` makes one cache per
glob and blends them as ``--dataset mmap`` blends prefixes. ``--valid-data-path`` / ``--test-data-path``
files (one cache each) replace the validation / test share, the training files still split by ``--split``
(seed 001's Megatron-LM ``--valid-data`` / ``--test-data``).

Workers read their own byte ranges of the files (about 1 MiB, cut at line ends), so the parent only
scans for line ends and writes tokens; results come back in input order, so the cache does not depend
on the number of workers.

``--loss-on completion`` (jsonl only): each line is a record ``{"prompt": ..., "completion": ...}``;
see ``completion``.
"""

from __future__ import annotations

import glob
import itertools
import multiprocessing as mp
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.core.json_lines import json_object, string_field
from gpt2forge.data import completion, mmap
from gpt2forge.data.contract import DataRequest, DatasetSplit
from gpt2forge.data.indexed import IndexedWriter, best_dtype
from gpt2forge.data.text_cache import ensure_build
from gpt2forge.text.tokenizer import load_tokenizer, worker_environment

KINDS = ("jsonl", "text")
PIECE_BYTES = 1 << 20
"""Bytes of JSONL one worker task reads (cut at a line end)."""
PARALLEL_BYTES = 4 << 20
"""Inputs smaller than this are tokenized in this process (starting workers would cost more)."""


class Piece(NamedTuple):
    """One worker task: bytes ``[start, end)`` of ``path`` (``end`` -1: the whole file), whose first
    line is line ``first_line`` of the file."""

    path: str
    start: int
    end: int
    first_line: int


def resolve_inputs(patterns: tuple[str, ...] | list[str], dataset: str, flag: str = "--input-files") -> list[Path]:
    """The files ``patterns`` name, in order (each glob's matches sorted, duplicates dropped).

    Raises:
        UsageError: a pattern matches no file, or names a folder.
    """
    files: dict[Path, None] = {}
    for pattern in patterns:
        magic = glob.has_magic(pattern)
        matches = [m for m in sorted(glob.glob(pattern, recursive=True)) if not Path(m).is_dir()] if magic \
            else [pattern]
        if not matches or not Path(matches[0]).exists():
            raise UsageError(f"{flag} {pattern}: {'matches no file' if magic else 'no such file'} "
                             f"(--dataset {dataset} reads files, or quoted globs such as 'docs/*.{dataset}')")
        if Path(matches[0]).is_dir():
            raise UsageError(f"{flag} {pattern} is a folder; give its files, e.g. '{pattern}/*.jsonl'")
        files.update(dict.fromkeys(Path(m) for m in matches))
    return list(files)


def _empty_file(path: Path, dataset: str) -> UsageError:
    example = 'one JSON object per line, e.g. {"text": "..."}' if dataset == "jsonl" else "text"
    return UsageError(f"{path}: the file is empty; --dataset {dataset} expects {example} (remove it from "
                      "--input-files or fill it)")


def jsonl_pieces(path: Path, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """``path`` cut into pieces of about ``piece_bytes`` at line ends, with their first line numbers.

    Raises:
        UsageError: the file holds nothing but white space.
    """
    pieces, start, line, blank = [], 0, 1, True
    with open(path, "rb") as f:
        carry = b""
        while block := f.read(piece_bytes):
            block = carry + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # no line end yet: keep reading
                carry = block
                continue
            blank = blank and not block[:cut].strip()
            pieces.append(Piece(str(path), start, start + cut, line))
            line += block.count(b"\n", 0, cut)
            start, carry = start + cut, block[cut:]
        if carry:
            blank = blank and not carry.strip()
            pieces.append(Piece(str(path), start, start + len(carry), line))
    if blank:
        raise _empty_file(path, "jsonl")
    return pieces


# Per-process state: set once in each worker by _init (or in this process for a small input).
_TOKENIZER = None
_JOB: dict = {}


def _init(tokenizer: str | None, job: dict) -> None:
    global _TOKENIZER, _JOB
    worker_environment()
    _TOKENIZER = load_tokenizer(tokenizer)
    _JOB = job


def _field(obj: dict, key: str, where: str, fix: str) -> str:
    if problem := string_field(obj, key):
        raise UsageError(f"{where}: {problem}; {fix}")
    return obj[key]


def parse_line(raw: bytes, where: str, json_key: str, completion: bool) -> str | tuple[str, str] | None:
    """The text (or ``(prompt, completion)``) of one JSONL line; None for a blank line.

    Raises:
        UsageError: invalid UTF-8, not JSON, not an object, or the field(s) missing (``where`` is
            ``file:line``).
    """
    if not raw.strip():
        return None
    problem, obj = json_object(raw)
    if problem.startswith("invalid UTF-8"):
        raise UsageError(f"{where}: {problem}; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    if problem:
        raise UsageError(f"{where}: {problem}; --dataset jsonl reads one JSON object per line")
    if completion:
        fix = ('--loss-on completion reads records {"prompt": ..., "completion": ...}: rename the fields, '
               "or drop --loss-on completion to train on every token")
        return _field(obj, "prompt", where, fix), _field(obj, "completion", where, fix)
    fix = "choose the text field with --json-key"
    if {"prompt", "completion"} <= obj.keys() and json_key not in obj:
        fix += " (prompt/completion records: add --loss-on completion)"
    return _field(obj, json_key, where, fix)


def _read(piece: Piece) -> bytes:
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        return f.read() if piece.end < 0 else f.read(piece.end - piece.start)


def _records(piece: Piece) -> list:
    """The piece's documents: texts, or ``(prompt, completion)`` pairs."""
    data = _read(piece)
    if _JOB["dataset"] == "text":
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise UsageError(f"{piece.path}:{line}: invalid UTF-8 (byte {exc.start} of the file); re-encode "
                             "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
        if not text.strip():
            raise _empty_file(Path(piece.path), "text")
        return [text]
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    parsed = (parse_line(raw, f"{piece.path}:{n}", _JOB["json_key"], _JOB["completion"])
              for n, raw in enumerate(lines, start=piece.first_line))
    return [r for r in parsed if r is not None]


def _encode(piece: Piece) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize one piece (worker side): ``(tokens, sizes)``, the sequences' ids concatenated.

    Documents: one sequence each, followed by EOD; empty ones left out. Records: two sequences each,
    the prompt and the completion followed by EOD.
    """
    tok, records = _TOKENIZER, _records(piece)
    if _JOB["completion"]:
        prompts = tok.encode_batch([p for p, _ in records], num_threads=1)
        answers = tok.encode_batch([c for _, c in records], num_threads=1)
        seqs = list(itertools.chain.from_iterable((p, [*c, tok.eot_id]) for p, c in zip(prompts, answers)))
    else:
        seqs = [[*ids, tok.eot_id] for ids in tok.encode_batch(records, num_threads=1) if ids]
    sizes = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=_JOB["dtype"], count=int(sizes.sum()))
    return tokens, sizes


def tokenize_pieces(pieces: list[Piece], tokenizer: str | None, job: dict, workers: int):
    """``(tokens, sizes)`` of each piece, in order, on ``workers`` processes (0: this process; 1: one
    worker, so reading and writing here overlap its tokenizing, as preprocess_data.py's pool does)."""
    if workers <= 0:
        _init(tokenizer, job)
        yield from map(_encode, pieces)
        return
    with mp.get_context("fork").Pool(workers, initializer=_init, initargs=(tokenizer, job)) as pool:
        # Tasks are byte ranges (tiny), so imap may queue them all; workers read the text themselves.
        yield from pool.imap(_encode, pieces)


def default_workers() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_build(prefix: Path, files: list[Path], dataset: str, req: DataRequest, workers: int | None = None
                ) -> dict:
    """Tokenize ``files`` into ``prefix.bin/.idx`` (published only when complete); returns its figures."""
    completion = req.data.loss_on == "completion"
    pieces = ([p for f in files for p in jsonl_pieces(f)] if dataset == "jsonl"
              else [Piece(str(f), 0, -1, 1) for f in files])
    for f in files:
        if f.stat().st_size == 0:
            raise _empty_file(f, dataset)
    tok = load_tokenizer(req.data.tokenizer_name_or_path)
    if tok.eot_id is None:
        raise UsageError(f"tokenizer {tok.name} has no end-of-document token; --dataset {dataset} needs one "
                         "(data/train_tokenizer.py adds <|endoftext|>)")
    dtype = best_dtype(tok.vocab_size)
    nbytes = sum(f.stat().st_size for f in files)
    if workers is None:
        workers = 0 if nbytes < PARALLEL_BYTES else min(default_workers(), len(pieces))
    job = {"dataset": dataset, "json_key": req.data.json_key, "completion": completion, "dtype": dtype.str}
    log.info(f"{dataset}: tokenizing {len(files)} file(s), {nbytes / 1e6:.1f} MB, on {workers} process(es) "
             f"into {prefix} (tokenizer {tok.name})")
    t0, max_id = time.perf_counter(), -1
    with IndexedWriter(prefix, dtype) as writer:
        for tokens, sizes in tokenize_pieces(pieces, req.data.tokenizer_name_or_path, job, workers):
            writer.add_documents_flat(tokens, sizes)
            max_id = max(max_id, int(tokens.max()) if tokens.size else -1)
    secs = time.perf_counter() - t0
    log.info(f"{dataset}: {writer.num_sequences} sequences, {writer.num_tokens} tokens in {secs:.2f} s "
             f"({nbytes / 1e6 / max(secs, 1e-9):.1f} MB/s)")
    return {"sequences": writer.num_sequences, "tokens": writer.num_tokens, "max_id": max_id,
            "dtype": str(dtype), "tokenizer_name": tok.name, "vocab_size": tok.vocab_size,
            "workers": workers, "seconds": round(secs, 3)}


def cached_prefix(files: list[Path], dataset: str, req: DataRequest) -> Path:
    """The cache of ``files`` (built, or reused when inputs and tokenizer are unchanged).

    Raises:
        UsageError: bad input (module doc), or token ids beyond the model's vocabulary.
    """
    settings = {"reader": dataset, "records": "prompt/completion" if req.data.loss_on == "completion" else "documents",
                "json_key": req.data.json_key if dataset == "jsonl" and req.data.loss_on != "completion" else None,
                "append_eod": True}
    try:
        prefix, manifest = ensure_build(files, settings, req.data.tokenizer_name_or_path, req.data.data_cache_dir,
                                        lambda p: write_build(p, files, dataset, req), dataset)
    except OSError as exc:  # unreadable input, unwritable cache, full disk: one line, not a traceback
        raise UsageError(f"{exc.filename or files[0]}: {exc.strerror or exc} while reading the inputs or writing "
                         "their tokenized cache; check the file's permissions and free space, or pass a writable "
                         "--data-cache-dir") from None
    if int(manifest.get("max_id", -1)) >= req.vocab_size:
        raise UsageError(f"{files[0]}: tokenizer {manifest.get('tokenizer_name')} gives token ids up to "
                         f"{manifest['max_id']} but the model's vocabulary has {req.vocab_size}; pass the "
                         "model's tokenizer with --tokenizer-name-or-path (or a model of a larger vocab_size)")
    return prefix


def weighted_groups(entries: tuple[str, ...]) -> list[tuple[str | None, str]]:
    """``W1 GLOB1 W2 GLOB2 ...`` -> ``[(W1, GLOB1), ...]``; anything else -> ``[(None, entry), ...]``."""
    def number(s: str) -> bool:
        try:
            float(s)
        except ValueError:
            return False
        return not Path(s).exists()
    if len(entries) >= 2 and len(entries) % 2 == 0 and all(number(w) for w in entries[::2]):
        return list(zip(entries[::2], entries[1::2]))
    return [(None, e) for e in entries]


def load(req: DataRequest) -> DatasetSplit:
    """Reader for ``jsonl`` and ``text`` (module doc): tokenize or reuse the cache, then read it as mmap."""
    dataset = req.data.dataset
    if dataset not in KINDS:
        raise UsageError(f"--dataset {dataset}: the raw-text reader reads {' or '.join(KINDS)}")
    if not req.data.input_files:
        raise UsageError(f"--dataset {dataset} needs --input-files: files or quoted globs, e.g. 'docs/*.{dataset}'")
    groups = weighted_groups(req.data.input_files)
    labels: dict[str, str] = {}  # cache prefix -> the files it holds, for the start-up lines

    def prefix_of(patterns: tuple[str, ...], flag: str = "--input-files") -> str:
        prefix = str(cached_prefix(resolve_inputs(patterns, dataset, flag), dataset, req))
        labels[prefix] = f"{dataset} {' '.join(patterns)}"
        return prefix

    held_out = {name: [prefix_of(tuple(getattr(req.data, name)), flag)]
                for name, flag in (("valid_data_path", "--valid-data-path"), ("test_data_path", "--test-data-path"))
                if getattr(req.data, name)}  # read whole; the training files are still split by --split
    if req.data.loss_on == "completion":
        if held_out:
            raise UsageError("--loss-on completion holds out its own validation records; drop "
                             "--valid-data-path/--test-data-path")
        if dataset != "jsonl" or groups[0][0] is not None:
            raise UsageError("--loss-on completion reads prompt/completion records from --dataset jsonl files "
                             "(one set, without blend weights)")
        return completion.load(req, cached_prefix(resolve_inputs(req.data.input_files, dataset), dataset, req))
    if groups[0][0] is None:
        prefixes = (prefix_of(tuple(req.data.input_files)),)
    else:
        prefixes = tuple(itertools.chain.from_iterable((w, prefix_of((g,))) for w, g in groups))
    as_mmap = replace(req.data, dataset="mmap", input_files=list(prefixes), **held_out)
    return mmap.load(replace(req, data=as_mmap), labels)
