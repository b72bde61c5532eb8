"""Megatron-LM's memory-mapped indexed dataset (`MMapIndexedDataset`), byte for byte.

A dataset is two files next to each other, `<prefix>.bin` and `<prefix>.idx`:

- `.bin`: every sequence's token ids, concatenated, in one dtype (no header).
- `.idx` (little endian):

  | bytes          | content                                                           |
  |----------------|-------------------------------------------------------------------|
  | 9              | magic `b"MMIDIDX\\x00\\x00"`                                       |
  | 8  `<Q`        | version, 1                                                        |
  | 1  `<B`        | dtype code (`DTYPE_CODES`)                                        |
  | 8  `<Q`        | N, number of sequences                                            |
  | 8  `<Q`        | D, length of the document index                                   |
  | 4*N int32      | sizes: tokens in each sequence                                    |
  | 8*N int64      | pointers: byte offset of each sequence in `.bin`                  |
  | 8*D int64      | doc_idx: index of the first sequence of each document, then N     |

Like Megatron's `preprocess_data.py`, our writer stores a document as one sequence, or one sequence
per sentence when its text is a list of sentences, and an empty document as a `doc_idx` entry with
no sequence; the reader accepts any valid `doc_idx`, so every Megatron file loads unchanged.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from gpt2forge.core.atomic import fsync_path
from gpt2forge.core.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D doc_idx entries

# Megatron-LM's code table (megatron/data/indexed_dataset.py `dtypes`; megatron.core `DType`).
# Codes 6 and 7 are floating point: legal in the format, never token ids, so the reader refuses them.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
TOKEN_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
               np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.uint16): 8}
_CHECK_CHUNK = 1 << 24  # tokens per chunk of the id-range check (16 Mi: bounded memory)


def best_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's choice: uint16 when `vocab_size < 65500`, else int32 (also when unknown)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def exists(prefix: str | Path) -> bool:
    """True if both `<prefix>.bin` and `<prefix>.idx` exist (not a completeness check: open it)."""
    return Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()


def recreate_hint(prefix: str | Path) -> str:
    """The command that re-creates `prefix`, for error messages."""
    prefix = str(prefix)
    out = prefix[: -len("_text_document")] if prefix.endswith("_text_document") else prefix
    return (f"re-create it with `python data/preprocess_data.py --input CORPUS.jsonl "
            f"--output-prefix {out} --append-eod --overwrite`")


def index_bytes(sizes: np.ndarray, doc_idx: np.ndarray, dtype: np.dtype) -> bytes:
    """The complete `.idx` file for `sizes` (tokens per sequence) stored as `dtype`."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    header = HEADER.pack(MAGIC, VERSION, TOKEN_CODES[dtype], len(sizes), len(doc_idx))
    return header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes()


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temp name in the same folder, fsync, rename: readers never see half a file
    (the index maps and blend orders cached next to a dataset)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class IndexedWriter:
    """Writes `<prefix>.bin/.idx`, publishing both only when `finalize()` succeeds.

    Data goes to hidden temporary files in the same folder; `finalize()` fsyncs them, removes any
    old `.idx`, then renames `.bin` and `.idx` into place (the `.idx` last, so a crash in between
    leaves no `.idx`, which `exists()` and every reader treat as absent). As a context manager it
    finalizes on success and aborts (deletes the temporaries) on an exception.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.uint16):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in TOKEN_CODES:
            raise UsageError(f"indexed dataset dtype must be an integer type of Megatron's table "
                             f"({', '.join(str(d) for d in TOKEN_CODES)}), got {self.dtype}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        fd, self._bin_tmp = tempfile.mkstemp(dir=self.prefix.parent,
                                             prefix=f".{self.prefix.name}.bin.", suffix=".tmp")
        self._bin = os.fdopen(fd, "wb", buffering=1 << 20)
        self._sizes: list[np.ndarray] = []  # int32 chunks; a list of arrays keeps appends cheap
        self._doc_starts: list[np.ndarray] = []  # int64 chunks of doc_idx entries after the 0
        self.num_sequences = 0
        self.num_tokens = 0
        self._done = False

    def _check_range(self, ids: np.ndarray) -> None:
        info = np.iinfo(self.dtype)
        if ids.size and (ids.min() < info.min or ids.max() > info.max):
            raise UsageError(f"token id {int(ids.max())} does not fit {self.dtype} in "
                             f"{self.prefix}.bin; use a wider dtype (int32)")

    def add_documents_flat(self, tokens: np.ndarray, sizes: Sequence[int] | np.ndarray,
                           doc_sequences: Sequence[int] | np.ndarray | None = None) -> None:
        """Append sequences of `sizes` tokens whose ids are `tokens` concatenated (fast bulk path).

        `doc_sequences`: how many of those sequences each document holds, in order (0: an empty
        document, kept as its own `doc_idx` entry, as Megatron's `add_document` does); None: one
        document per sequence."""
        tokens = np.asarray(tokens)
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != tokens.size or (sizes < 0).any():
            raise ValueError("sizes must be non-negative and sum to len(tokens)")
        per_doc = (np.ones(len(sizes), dtype=np.int64) if doc_sequences is None
                   else np.asarray(doc_sequences, dtype=np.int64))
        if int(per_doc.sum()) != len(sizes) or (per_doc < 0).any():
            raise ValueError("doc_sequences must be non-negative and sum to len(sizes)")
        self._check_range(tokens)
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(sizes.astype(np.int32))
        self._doc_starts.append(self.num_sequences + np.cumsum(per_doc))
        self.num_sequences += len(sizes)
        self.num_tokens += tokens.size

    def add_document(self, ids: np.ndarray | Sequence[int]) -> None:
        """Append one document (one sequence) of token ids."""
        ids = np.asarray(ids)
        self.add_documents_flat(ids.reshape(-1), [ids.size])

    def add_prefix(self, other_prefix: str | Path) -> None:
        """Append every sequence and document of the dataset at `other_prefix` (merging).

        Its dtype must equal this writer's; its `doc_idx` is kept (shifted), as Megatron's
        `merge_file_` does."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise UsageError(f"{other_prefix}: dtype {other.dtype} differs from the output's "
                             f"{self.dtype}; merge only datasets made with the same tokenizer")
        offset = self.num_sequences
        with open(f"{other_prefix}.bin", "rb") as src:
            while block := src.read(1 << 24):
                self._bin.write(block)
        self._sizes.append(other.sizes.astype(np.int32))
        self._doc_starts.append(offset + np.asarray(other.doc_idx[1:], dtype=np.int64))
        self.num_sequences += len(other)
        self.num_tokens += other.num_tokens
        other.close()

    def finalize(self) -> None:
        """Flush, fsync and publish `<prefix>.bin` and `<prefix>.idx`."""
        if self._done:
            return
        idx_path, idx_tmp = Path(f"{self.prefix}.idx"), None
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
            doc_idx = np.concatenate([np.zeros(1, np.int64), *self._doc_starts])
            fd, idx_tmp = tempfile.mkstemp(dir=self.prefix.parent,
                                           prefix=f".{self.prefix.name}.idx.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(index_bytes(sizes, doc_idx, self.dtype))
                f.flush()
                os.fsync(f.fileno())
            for tmp in (self._bin_tmp, idx_tmp):
                os.chmod(tmp, 0o644)  # mkstemp creates 0600
            idx_path.unlink(missing_ok=True)  # never pair a new .bin with an old .idx
            os.replace(self._bin_tmp, f"{self.prefix}.bin")
            os.replace(idx_tmp, idx_path)
            fsync_path(self.prefix.parent)
        except BaseException as exc:
            if idx_tmp is not None:
                Path(idx_tmp).unlink(missing_ok=True)
            self.abort()
            raise self._named(exc) from None
        self._done = True

    def _named(self, exc: BaseException) -> BaseException:
        """An OSError without a file name (a failed write) as one naming this dataset's `.bin`."""
        if isinstance(exc, OSError) and exc.filename is None:
            return OSError(exc.errno, exc.strerror or str(exc), f"{self.prefix}.bin")
        return exc

    def abort(self) -> None:
        """Delete the temporary files; nothing is published."""
        if not self._bin.closed:
            with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails again
                self._bin.close()
        Path(self._bin_tmp).unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
            return
        self.abort()
        if exc is not self._named(exc):
            raise self._named(exc) from None


class IndexedDataset:
    """Read-only, memory-mapped view of `<prefix>.bin/.idx`, verified on open.

    Attributes: `dtype`, `sizes` (int32), `pointers` (int64 byte offsets), `doc_idx` (int64),
    `num_tokens`. `len()` is the number of sequences; `get(i, offset, length)` and `self[i]`
    return numpy views into the mapped `.bin` (no copy). Raises UsageError naming the file, what is
    wrong and the command that re-creates it. With `vocab_size`, every token id must lie in
    `[0, vocab_size)` (checked in chunks of 16 Mi tokens). `verify=False` skips the checks (used
    when a verified dataset is reopened in a DataLoader worker after pickling).
    """

    def __init__(self, prefix: str | Path, vocab_size: int | None = None, *, verify: bool = True):
        self.prefix = str(prefix)
        self.vocab_size = vocab_size
        idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        missing = [str(p) for p in (idx_path, bin_path) if not p.is_file()]
        if missing:
            raise UsageError(f"dataset {prefix} not found ({', '.join(missing)} missing); "
                             f"{recreate_hint(prefix)}")
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_path.stat().st_size \
            else np.zeros(0, np.uint8)
        self._read_index(idx_path)
        bin_len = bin_path.stat().st_size
        if bin_len % self.dtype.itemsize:
            raise self._fail(bin_path, f"data file is {bin_len} bytes, not a whole number of {self.dtype} tokens "
                                       f"({self.dtype.itemsize} bytes each): truncated, or written for another dtype")
        self._bin = (np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_len
                     else np.zeros(0, self.dtype))
        if verify:
            self._verify(bin_path, bin_len)

    def _fail(self, path: Path | str, what: str) -> UsageError:
        return UsageError(f"{path}: {what}; {recreate_hint(self.prefix)}")

    def _read_index(self, path: Path) -> None:
        buf = self._idx
        if len(buf) < HEADER.size:
            raise self._fail(path, f"truncated index ({len(buf)} bytes, header needs {HEADER.size})")
        magic, version, code, n, d = HEADER.unpack(bytes(buf[: HEADER.size]))
        if magic != MAGIC:
            raise self._fail(path, f"not a Megatron mmap index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise self._fail(path, f"unsupported index version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise self._fail(path, f"unknown dtype code {code} (Megatron's codes are 1-8)")
        if DTYPE_CODES[code] not in TOKEN_CODES:
            raise self._fail(path, f"dtype code {code} ({DTYPE_CODES[code]}) is not an integer "
                                   f"token type")
        self.dtype = DTYPE_CODES[code]
        expected = HEADER.size + 4 * n + 8 * n + 8 * d
        if len(buf) != expected:
            raise self._fail(path, f"index is {len(buf)} bytes but its header ({n} sequences, {d} "
                                   f"document entries) needs {expected} (truncated or corrupt)")
        off = HEADER.size
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n, offset=off)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=off + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=d, offset=off + 12 * n)
        self.num_tokens = int(self.sizes.sum(dtype=np.int64))

    def _verify(self, bin_path: Path, bin_len: int) -> None:
        idx_path, n, item = f"{self.prefix}.idx", len(self.sizes), self.dtype.itemsize
        if n and (self.sizes < 0).any():
            raise self._fail(idx_path, "negative sequence size")
        expected = np.zeros(n, dtype=np.int64)
        np.cumsum(self.sizes[:-1].astype(np.int64) * item, out=expected[1:])
        if n and not np.array_equal(expected, self.pointers):
            bad = int(np.argmax(expected != self.pointers))
            raise self._fail(idx_path, f"pointer of sequence {bad} is {int(self.pointers[bad])}, "
                                       f"expected {int(expected[bad])} (sizes and pointers disagree)")
        d = self.doc_idx
        if len(d) == 0 or d[0] != 0 or d[-1] != n or (len(d) > 1 and (np.diff(d) < 0).any()):
            raise self._fail(idx_path, f"document index must rise from 0 to {n} sequences")
        if bin_len != self.num_tokens * item:
            raise self._fail(bin_path, f"data file is {bin_len} bytes but the index describes "
                                       f"{self.num_tokens} {self.dtype} tokens = "
                                       f"{self.num_tokens * item} bytes (truncated or mismatched)")
        if self.vocab_size is not None:
            self.check_vocab(self.vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise UsageError if any token id lies outside `[0, vocab_size)`; chunked, bounded memory."""
        for start, chunk in zip(range(0, len(self._bin), _CHECK_CHUNK), self.token_chunks()):
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= vocab_size:
                bad = hi if hi >= vocab_size else lo
                pos = start + int(np.argmax(chunk == bad))
                raise self._fail(f"{self.prefix}.bin",
                                 f"token id {bad} at position {pos} is outside the model's "
                                 f"vocabulary [0, {vocab_size}) (made with another tokenizer?)")

    def token_chunks(self, chunk: int = _CHECK_CHUNK) -> Iterator[np.ndarray]:
        """Every token of the `.bin`, in file order, as views of at most `chunk` tokens."""
        for start in range(0, len(self._bin), chunk):
            yield self._bin[start:start + chunk]

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset:offset+length` of sequence `i` (to its end if `length` is None), a view."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    @property
    def num_documents(self) -> int:
        """Documents in the file (`len(doc_idx) - 1`)."""
        return len(self.doc_idx) - 1

    def document(self, j: int) -> np.ndarray:
        """Tokens of document `j` (its sequences concatenated), a view."""
        a, b = int(self.doc_idx[j]), int(self.doc_idx[j + 1])
        if b == a:
            return self._bin[0:0]
        start = int(self.pointers[a]) // self.dtype.itemsize
        return self._bin[start:start + int(self.sizes[a:b].sum(dtype=np.int64))]

    def documents(self) -> Iterable[np.ndarray]:
        """Each document's tokens, in order (views)."""
        return (self.document(j) for j in range(self.num_documents))

    def close(self) -> None:
        """Drop the memory maps (the files stay)."""
        self._bin = self._idx = None
        self.sizes = self.pointers = self.doc_idx = None

    # Pickled into DataLoader workers by prefix, not by content (a memmap would be copied whole).
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "vocab_size": self.vocab_size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], state["vocab_size"], verify=False)


def open_corpora(prefixes: Sequence[str], vocab_size: int | None, flag: str) -> dict[str, IndexedDataset]:
    """Open (and verify) every prefix of a blend; all must come from one tokenizer.

    Megatron's `preprocess_data.py` picks the dtype from the vocabulary size (`best_dtype`), so two
    dtypes mean two tokenizers; ids outside `[0, vocab_size)` are refused per file on open.

    Raises:
        UsageError: a missing or corrupt file, ids outside the vocabulary, or mixed dtypes.
    """
    opened = {p: IndexedDataset(p, vocab_size=vocab_size) for p in dict.fromkeys(prefixes)}
    first, *rest = opened.items()
    for prefix, data in rest:
        if data.dtype != first[1].dtype:
            raise UsageError(f"{flag}: {prefix} holds {data.dtype} token ids but {first[0]} holds "
                             f"{first[1].dtype}: they were made with different tokenizers (vocabularies "
                             "of different sizes); re-create them with the one tokenizer the model uses")
    return opened
