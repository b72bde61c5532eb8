"""Decontamination: remove training text sharing a word n-gram (13 by default) with evaluation sets.

Words are whitespace-separated, lower-cased, with punctuation stripped (as the GPT-3 paper and
Megatron's filter_ngrams.py). Evaluation n-grams are kept as a sorted numpy array of 64-bit hashes
(8 bytes per n-gram: WikiText-103 test, ~245k words, is ~2 MB), looked up with a binary search.
Evaluation files: `.json`/`.jsonl` (one object per line, the text field, e.g. LAMBADA) or plain
text (e.g. WikiText's wiki.test.raw, read as one word stream).

`--mode drop` removes a document with any overlap. `--mode cut` removes each overlapping span plus
`margin` characters on both sides and splits the document there (pieces under `min_piece_chars`
are dropped; a document cut more than `max_splits` times is dropped whole), as filter_ngrams.py did.

Megatron-LM's tools/openwebtext/filter_ngrams.py options: `min_ngram` (an evaluation text shorter than
`ngram` words but of at least `min_ngram` counts whole, as one n-gram of its length) and `key_threshold`
(a first pass counts the training documents holding each evaluation n-gram; only those in fewer than
`key_threshold` documents are removed: a phrase that common is not contamination). The n-gram tables
(one per length) can be saved and loaded (`.npz` of hashes) to skip that pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import string
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess.clean import EXAMPLE_CHARS, EXAMPLES_PER_RULE, map_texts
from gpt2forge.preprocess.jsonl import atomic_jsonl, read_documents

PUNCTUATION = string.punctuation + "“”‘’«»—–…"
_PUNCTUATION = str.maketrans("", "", PUNCTUATION)
_PUNCTUATION_RUN = re.compile(f"[{re.escape(PUNCTUATION)}]+")
_WORD = re.compile(r"\S+")
_BASE = np.uint64(1_000_003)


@dataclasses.dataclass(frozen=True)
class DecontaminateConfig:
    ngram: int = 13
    """Words per n-gram."""
    mode: str = "drop"
    """"drop" the document, or "cut" the overlapping spans out of it."""
    margin: int = 200
    """Characters removed on each side of an overlapping span (cut mode)."""
    min_piece_chars: int = 200
    """Pieces shorter than this are dropped (cut mode)."""
    max_splits: int = 10
    """A document cut more than this many times is dropped whole (cut mode)."""
    min_ngram: int | None = None
    """Evaluation texts of `min_ngram` to `ngram` - 1 words count whole (Megatron's --min-ngram-size);
    None: texts shorter than `ngram` words add nothing."""
    key_threshold: int | None = None
    """Only n-grams found in fewer than this many training documents are removed (Megatron's
    --key-threshold); None: every evaluation n-gram is."""

    def __post_init__(self):
        if self.ngram < 1:
            raise UsageError(f"--ngram {self.ngram}: must be >= 1")
        if self.min_ngram is not None and not 1 <= self.min_ngram <= self.ngram:
            raise UsageError(f"--min-ngram-size {self.min_ngram}: must be between 1 and the n-gram size {self.ngram}")
        if self.key_threshold is not None and self.key_threshold < 1:
            raise UsageError(f"--key-threshold {self.key_threshold}: must be >= 1")
        if self.mode not in ("drop", "cut"):
            raise UsageError(f"--mode {self.mode}: choose drop or cut")


def words(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """(normalized words, their (start, end) character spans in `text`); punctuation-only words skipped."""
    out, spans = [], []
    for m in _WORD.finditer(text):
        w = m.group().lower().translate(_PUNCTUATION)
        if w:
            out.append(w)
            spans.append(m.span())
    return out, spans


_ASCII_FOLD = bytes(0x20 if 0x1C <= c <= 0x1F else c + 32 if 0x41 <= c <= 0x5A else c for c in range(256))
"""bytes.translate's table for ASCII text: upper case to lower, and the four separators str.split()
splits at and bytes.split() does not (0x1C-0x1F) to spaces."""
_ASCII_PUNCTUATION = "".join(c for c in PUNCTUATION if c.isascii()).encode()


def plain_words(text: str) -> list[str]:
    """`words(text)[0]` without the spans, in three passes over the whole text instead of a few calls
    per word: lower-casing and deleting punctuation never add or remove whitespace, so the whole text
    can be done before the split. ASCII text (most documents) takes one `bytes.translate` instead."""
    if text.isascii():
        return text.encode("ascii").translate(_ASCII_FOLD, _ASCII_PUNCTUATION).decode("ascii").split()
    return _PUNCTUATION_RUN.sub("", text.lower()).split()


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


_HASHES: dict[str, int] = {}
"""Word -> its hash, in each process: words repeat (Zipf), so most lookups skip blake2b."""
MAX_CACHED_WORDS = 1 << 21


def word_hashes(ws: list[str]) -> np.ndarray:
    """uint64 blake2b hash of each of `ws`, from the cache where it is there."""
    if len(_HASHES) > MAX_CACHED_WORDS:
        _HASHES.clear()
    for w in set(ws).difference(_HASHES):
        _HASHES[w] = _word_hash(w)
    return np.fromiter(map(_HASHES.__getitem__, ws), dtype=np.uint64, count=len(ws))


def ngram_hashes(ws: list[str], n: int) -> np.ndarray:
    """uint64 hash of each n-gram of `ws` (len(ws) - n + 1 of them; none when shorter), a polynomial
    rolling combination of per-word blake2b hashes (wrapping uint64 arithmetic)."""
    if len(ws) < n:
        return np.empty(0, dtype=np.uint64)
    wh = word_hashes(ws)
    m = len(ws) - n + 1
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = h * _BASE + wh[k:k + m]
    return h


def _eval_texts(path: Path, text_key: str):
    if path.suffix in (".json", ".jsonl"):
        yield from (doc.text for doc in read_documents(path, text_key=text_key))
        return
    try:
        yield path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror}); check the --eval path") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8") from None


def eval_ngrams(paths: list[str | Path], n: int, text_key: str = "text") -> np.ndarray:
    """Sorted unique uint64 hashes of every n-gram in the evaluation files."""
    return eval_tables(paths, n, text_key).get(n, np.empty(0, dtype=np.uint64))


Tables = dict[int, np.ndarray]
"""n-gram length -> sorted unique uint64 hashes of the evaluation n-grams of that length."""


class NgramSet:
    """A table of sorted unique n-gram hashes, looked up many times: a bitmap of the hashes' low
    `BITS` bits (2 MiB) first drops the n-grams whose bit is clear, nearly all of a clean
    document's, without touching the table; only the rest are binary-searched in it."""

    BITS = 24

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self._bits = np.zeros(1 << (self.BITS - 3), np.uint8)
        byte, bit = self._where(table)
        np.bitwise_or.at(self._bits, byte, np.left_shift(np.uint8(1), bit))

    @classmethod
    def _where(cls, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(byte, bit) of each hash's low BITS bits in the bitmap."""
        low = h & np.uint64((1 << cls.BITS) - 1)
        return (low >> np.uint64(3)).astype(np.intp), (low & np.uint64(7)).astype(np.uint8)

    def find(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in `h` of the hashes the table holds, their indices in the table)."""
        byte, bit = self._where(h)
        maybe = np.flatnonzero((self._bits[byte] >> bit) & 1)
        if not len(maybe) or not len(self.table):
            return maybe[:0], maybe[:0]
        idx = np.minimum(np.searchsorted(self.table, h[maybe]), len(self.table) - 1)
        hit = self.table[idx] == h[maybe]
        return maybe[hit], idx[hit]


def _ngram_set(table: np.ndarray | NgramSet) -> NgramSet:
    return table if isinstance(table, NgramSet) else NgramSet(table)


def eval_tables(paths: list[str | Path], n: int, text_key: str = "text", min_n: int | None = None) -> Tables:
    """The n-grams of the evaluation files, and with `min_n` each text of `min_n` to n - 1 words whole."""
    parts = defaultdict(list)
    for p in paths:
        for text in _eval_texts(Path(p), text_key):
            ws = plain_words(text)
            k = n if len(ws) >= n else len(ws) if min_n is not None and len(ws) >= min_n else 0
            if k:
                parts[k].append(ngram_hashes(ws, k))
    return {k: np.unique(np.concatenate(v)) for k, v in sorted(parts.items())}


def _table_hits(ws: list[str], table: NgramSet, n: int) -> np.ndarray:
    """Indices into `table` of the n-grams of `ws` it holds, each once."""
    return np.unique(table.find(ngram_hashes(ws, n))[1])


def _found(text: str) -> dict[int, np.ndarray]:
    ws = plain_words(text)
    return {n: _table_hits(ws, t, n) for n, t in _STATE[0].items()}


def rare_ngrams(tables: Tables, docs, threshold: int, workers: int) -> Tables:
    """`tables` minus the n-grams that `threshold` or more of `docs` hold (Megatron's --key-threshold)."""
    global _STATE
    _STATE = ({n: NgramSet(t) for n, t in tables.items()}, None)
    counts = {n: np.zeros(len(t), dtype=np.int64) for n, t in tables.items()}
    for _doc, found in map_texts(_found, docs, workers):
        for n, idx in found.items():
            counts[n][idx] += 1
    return {n: t[counts[n] < threshold] for n, t in tables.items()}


def save_tables(path: str | Path, tables: Tables) -> None:
    """`tables` as an `.npz` (one array per length), for --load-dictionary."""
    with open(path, "wb") as f:
        np.savez(f, **{str(n): t for n, t in tables.items()})


def load_tables(path: str | Path) -> Tables:
    """What `save_tables` wrote. Raises UsageError on anything else (Megatron's pickles included)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            tables = {int(k): z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise UsageError(f"--load-dictionary {path}: not an n-gram table written by --save-dictionary here "
                         f"({exc}); Megatron's pickled dictionaries are not read: rebuild it with --save-dictionary"
                         ) from None
    if not all(t.dtype == np.uint64 and t.ndim == 1 for t in tables.values()):
        raise UsageError(f"--load-dictionary {path}: not an n-gram table written by --save-dictionary here")
    return tables


def overlaps(ws: list[str], table: np.ndarray | NgramSet, n: int) -> np.ndarray:
    """Start indices (into `ws`) of the n-grams found in `table` (an `NgramSet` where it is looked
    up more than once)."""
    return _ngram_set(table).find(ngram_hashes(ws, n))[0]


def cut(text: str, table: np.ndarray | NgramSet | dict, cfg: DecontaminateConfig) -> tuple[list[str], int]:
    """(the pieces of `text` to keep, number of overlapping n-grams). No overlap: ([text], 0).
    `table`: the `cfg.ngram`-gram hashes, or tables of several lengths (as `NgramSet`s where many
    texts are cut)."""
    tables = table if isinstance(table, dict) else {cfg.ngram: table}
    tables = {n: _ngram_set(t) for n, t in tables.items()}
    if cfg.mode == "drop":
        ws = plain_words(text)
        matched = sum(len(overlaps(ws, t, n)) for n, t in tables.items())
        return ([], matched) if matched else ([text], 0)
    ws, spans = words(text)
    hits = sorted((int(i), n) for n, t in tables.items() for i in overlaps(ws, t, n))
    if not hits:
        return [text], 0
    removed = []  # merged character spans to remove
    for i, n in hits:
        start = max(0, spans[i][0] - cfg.margin)
        end = min(len(text), spans[i + n - 1][1] + cfg.margin)
        if removed and start <= removed[-1][1]:
            removed[-1][1] = max(removed[-1][1], end)
        else:
            removed.append([start, end])
    if len(removed) > cfg.max_splits:
        return [], len(hits)
    bounds = [0] + [b for span in removed for b in span] + [len(text)]
    pieces = [text[a:b].strip() for a, b in zip(bounds[::2], bounds[1::2])]
    return [p for p in pieces if len(p) >= cfg.min_piece_chars], len(hits)


@dataclasses.dataclass
class DecontaminateSummary:
    docs_in: int = 0
    docs_out: int = 0
    docs_contaminated: int = 0
    pieces_out: int = 0
    chars_in: int = 0
    chars_out: int = 0
    ngrams_matched: int = 0
    bad_lines: int = 0
    examples: list = dataclasses.field(default_factory=list)

    def line(self, name: str) -> str:
        return (f"{name}: {self.docs_contaminated} of {self.docs_in} documents overlapped the evaluation sets "
                f"({self.ngrams_matched} n-grams); wrote {self.pieces_out} documents ({self.chars_out} of "
                f"{self.chars_in} characters); bad lines skipped: {self.bad_lines}")


_STATE: tuple[dict[int, NgramSet], DecontaminateConfig | None] | None = None


def _cut(text: str) -> tuple[list[str] | None, int]:
    """`cut`'s result, with None for a document kept whole (the parent has its text)."""
    pieces, matched = cut(text, *_STATE)
    return (pieces if matched else None), matched


def decontaminate_file(input_path: str | Path, output_path: str | Path, eval_paths: list[str],
                       cfg: DecontaminateConfig, *, workers: int = 1, text_key: str = "text",
                       eval_text_key: str = "text", skip_bad_lines: bool = False,
                       load_path: str | None = None, save_path: str | None = None,
                       span: tuple[int, int] | None = None) -> DecontaminateSummary:
    """Write `input_path` minus its overlaps with `eval_paths` to `output_path` (atomically). In cut
    mode a piece is written as the document's record with its text replaced and `"piece": k` added.
    `load_path`: the n-gram tables saved by an earlier run's `save_path` instead of `eval_paths`;
    `span`: only the lines starting in these bytes of the input (read_documents; a shard task's part)."""
    global _STATE
    if load_path is not None:
        tables = load_tables(load_path)
    else:
        tables = eval_tables(eval_paths, cfg.ngram, eval_text_key, cfg.min_ngram)
        if cfg.key_threshold is not None:
            docs = read_documents(input_path, text_key=text_key, skip_bad_lines=skip_bad_lines, bad=Counter(),
                                  span=span)
            tables = rare_ngrams(tables, docs, cfg.key_threshold, workers)
        if save_path is not None:
            save_tables(save_path, tables)
    _STATE = ({n: NgramSet(t) for n, t in tables.items()}, cfg)
    summary, bad = DecontaminateSummary(), Counter()
    docs = read_documents(input_path, text_key=text_key, skip_bad_lines=skip_bad_lines, bad=bad, span=span)
    with atomic_jsonl(output_path) as out:
        for doc, (pieces, matched) in map_texts(_cut, docs, workers):
            pieces = [doc.text] if pieces is None else pieces
            summary.docs_in += 1
            summary.chars_in += len(doc.text)
            if matched:
                summary.docs_contaminated += 1
                summary.ngrams_matched += matched
                if len(summary.examples) < EXAMPLES_PER_RULE:
                    summary.examples.append(doc.text[:EXAMPLE_CHARS])
            summary.docs_out += bool(pieces)
            for k, piece in enumerate(pieces):
                out.write(doc.record | {text_key: piece} | ({"piece": k} if matched else {}))
                summary.pieces_out += 1
                summary.chars_out += len(piece)
    summary.bad_lines = bad["bad_lines"]
    return summary
