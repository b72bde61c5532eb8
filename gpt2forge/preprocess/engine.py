"""Parallel tokenization with bounded memory: chunks of documents in, token arrays out, in order.

The parent process reads the input (cheap: it only splits lines) and groups records into chunks of
at most `chunk_docs` documents or `chunk_bytes` bytes. Worker processes (each loads its tokenizer
once, in its initializer, and runs on one core) parse and tokenize a whole chunk with the
tokenizer's batch encoder and return one flat token array plus per-document sizes. At most
`2 * workers + 2` chunks are in flight, so memory stays bounded whatever the input size, and
results come back in input order, so the output does not depend on the number of workers.
`ordered_map` is that pool, shared with the cleaning and decontamination tools (clean.map_texts).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from gpt2forge.core.errors import UsageError
from gpt2forge.core.json_lines import json_object, string_field
from gpt2forge.text.tokenizer import load_bpe_files, load_tokenizer, worker_environment


@dataclass(frozen=True)
class TokenizerSpec:
    """How a process loads the tokenizer: `path` for load_tokenizer (None = GPT-2), or a
    `vocab_file` + `merge_file` pair (Megatron's flags). Picklable, so workers load their own."""

    path: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None

    def load(self):
        if self.vocab_file or self.merge_file:
            if not (self.vocab_file and self.merge_file):
                raise UsageError("--vocab-file and --merge-file go together; pass both")
            return load_bpe_files(self.vocab_file, self.merge_file)
        return load_tokenizer(self.path)


class Chunk(NamedTuple):
    """Work for one task: raw records, where they start in the input, and how to read them."""

    records: list          # bytes lines (json) or str texts
    first_line: int        # 1-based input line (or document) number of records[0]
    nbytes: int            # input bytes covered, for the progress bar


class Encoded(NamedTuple):
    """One chunk tokenized: `tokens` is the sequences' ids concatenated, `sizes` their lengths."""

    tokens: np.ndarray
    sizes: np.ndarray
    skipped: int           # empty documents (no sequence) and blank lines
    nbytes: int
    doc_sequences: np.ndarray | None = None
    """Sequences of each document, in order (0: an empty text, kept as an empty document entry);
    None: one sequence per document."""


@dataclass
class Stats:
    """Counters for the summary line every tool prints."""

    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    nbytes: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, enc: Encoded) -> None:
        self.documents += len(enc.sizes) if enc.doc_sequences is None else int(np.count_nonzero(enc.doc_sequences))
        self.tokens += int(enc.tokens.size)
        self.skipped += enc.skipped
        self.nbytes += enc.nbytes

    def line(self) -> str:
        secs = max(time.perf_counter() - self.start, 1e-9)
        extra = f", skipped empty: {self.skipped}" if self.skipped else ""
        return (f"documents: {self.documents}, tokens: {self.tokens}, seconds: {secs:.2f}, "
                f"tokens/s: {self.tokens / secs:.0f}{extra}")


# Per-process state, set once by _init (workers) or by encode_chunks (single-process mode).
_TOKENIZER = None
_JOB: dict = {}


def _init(spec: TokenizerSpec, job: dict) -> None:
    global _TOKENIZER, _JOB
    worker_environment()
    _TOKENIZER = spec.load()
    _JOB = job


def _texts(chunk: Chunk, json_key: str | None, source: str) -> list[str | list[str] | None]:
    """Each record's text: a string, a list of sentences (a list-valued field, as Megatron's
    `preprocess_data.py` reads it), or None for a blank line (no record)."""
    if json_key is None:
        return chunk.records
    texts: list[str | list[str] | None] = []
    for n, line in enumerate(chunk.records, start=chunk.first_line):
        if not line.strip():  # a blank line is no record (left out, counted as skipped)
            texts.append(None)
            continue
        problem, obj = json_object(line)
        if problem:
            raise UsageError(f"{source}:{n}: {problem}; the input must be loose JSON, one object per line")
        if json_key not in obj:
            raise UsageError(f"{source}:{n}: {string_field(obj, json_key)}; pick the text field with --json-key")
        value = obj[json_key]
        if isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise UsageError(f"{source}:{n}: {json_key!r} is a list holding a non-string; a list "
                                 "must hold the document's sentences as strings") from None
            texts.append(value)
        else:
            texts.append(str(value))
    return texts


def _encode(chunk: Chunk) -> Encoded:
    """Tokenize one chunk in this process (worker side), as Megatron's `Encoder.encode`: each sentence
    of a document is one sequence (empty ones dropped), the end-of-document token ends the last, and
    a document without tokens keeps its (empty) entry."""
    job, tok = _JOB, _TOKENIZER
    records = [r for r in _texts(chunk, job["json_key"], job["source"]) if r is not None]
    blank = len(chunk.records) - len(records)
    sentences = [r if isinstance(r, list) else [r] for r in records]
    ids = iter(tok.encode_batch(list(itertools.chain.from_iterable(sentences)), num_threads=1))
    seqs: list[list[int]] = []
    per_doc = np.zeros(len(records), dtype=np.int64)
    for i, doc in enumerate(sentences):
        kept = [s for s in itertools.islice(ids, len(doc)) if s]
        if kept and job["append_eod"]:
            kept[-1].append(tok.eot_id)
        seqs.extend(kept)
        per_doc[i] = len(kept)
    sizes = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=job["dtype"], count=int(sizes.sum()))
    return Encoded(flat, sizes, blank + int((per_doc == 0).sum()), chunk.nbytes, per_doc)


def chunk_records(records: Iterable[tuple[object, int]], chunk_docs: int = 1024,
                  chunk_bytes: int = 1 << 20) -> Iterator[Chunk]:
    """Group `(record, nbytes)` pairs into Chunks of <= chunk_docs records or >= chunk_bytes."""
    buf, size, first, n = [], 0, 1, 0
    for n, (rec, nbytes) in enumerate(records, start=1):
        buf.append(rec)
        size += nbytes
        if len(buf) >= chunk_docs or size >= chunk_bytes:
            yield Chunk(buf, first, size)
            buf, size, first = [], 0, n + 1
    if buf:
        yield Chunk(buf, first, size)


def encode_chunks(chunks: Iterable[Chunk], spec: TokenizerSpec, *, workers: int, dtype,
                  append_eod: bool, json_key: str | None = None, source: str = "input"
                  ) -> Iterator[Encoded]:
    """Tokenize `chunks` on `workers` processes (0 = in this process); yields in input order.

    `json_key`: records are JSON lines and the text is this field; None: records are texts.
    Raises UsageError for bad input (naming `source` and the line) or a tokenizer without an
    end-of-document token when `append_eod` is set.
    """
    job = {"json_key": json_key, "source": source, "append_eod": append_eod,
           "dtype": np.dtype(dtype).str}
    if workers <= 0:
        _init(spec, job)
        if append_eod and _TOKENIZER.eot_id is None:
            raise UsageError(f"tokenizer {_TOKENIZER.name} has no end-of-document token; drop "
                             f"--append-eod or train one with <|endoftext|>")
        yield from ordered_map(_encode, chunks, 0)
        return
    yield from ordered_map(_encode, chunks, workers, _init, (spec, job))


def ordered_map(fn, tasks: Iterable, workers: int, initializer=None, initargs: tuple = (), *,
                steady: bool = False) -> Iterator:
    """`fn(task)` for each of `tasks`, yielded in task order, on `workers` forked processes.

    `workers` <= 0 runs in this process (after `initializer(*initargs)`, when given). `fn` is a
    module-level function; a worker runs `initializer(*initargs)` once when it starts. At most
    `2 * workers + 2` tasks are in flight, so `tasks` is read only as far ahead as the workers keep
    up (not `pool.imap`, whose feeder thread would read the whole input ahead): memory stays bounded
    whatever the input size, and the results do not depend on `workers`. `steady`: a result is
    yielded only once that many tasks are in flight, never as soon as it is ready, so which results
    have been yielded when a task is drawn depends on `workers` alone, not on timing (for `tasks`
    that read what the results change).
    """
    if workers <= 0:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, tasks)
        return
    with mp.get_context("fork").Pool(workers, initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            while len(pending) > 2 * workers + 2 or (not steady and pending and pending[0].ready()):
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def check_eod(spec: TokenizerSpec, append_eod: bool):
    """Load the tokenizer in the parent (for vocab size and dtype); refuse --append-eod without
    an end-of-document token. Returns the tokenizer."""
    tok = spec.load()
    if append_eod and tok.eot_id is None:
        raise UsageError(f"tokenizer {tok.name} has no end-of-document token; drop --append-eod "
                         f"or train one with <|endoftext|> (data/train_tokenizer.py adds it)")
    return tok
