"""``--dataset tfrecord``: ``tf.train.Example`` records with an ``input_ids`` Int64List feature.

``--input-files`` takes paths or quoted globs (``'data/*.tfrecord'``); each ``X.tfrecord`` needs its
``X.index`` (the ``tfrecord2idx`` format: one ``"<byte offset> <record bytes>"`` line per record),
written by ``data/write_into_tfrecord.py`` or ``python -m tfrecord.tools.tfrecord2idx X.tfrecord X.index``.

Checked on open: every file has an index, the index is well formed and tiles the file exactly
(offsets from 0, contiguous, adding up to the file size), and the first record parses. While
reading: each record's length field agrees with its index entry, it parses, it has ``input_ids`` and
its ids lie in ``[0, vocab_size)``. ``--verify`` reads every record on open and also checks both
CRCs of each (the reference never checked them).

Items: ``max_len + 1`` tokens, the record's first ones; a shorter record is padded at the end with
``IGNORE_INDEX`` (so a record written with ``--seq-length max_len`` lets the model see all
``max_len`` positions; the reference cut one). Records are numbered across the sorted files and split
by ``--split`` (train, valid, test ranges, the test split evaluated after training; the reference used
the last file as validation set). The start-up lines count each split's tokens and those past
``max_len + 1`` of longer records, which no item holds; without ``--verify`` only the first record of
each file is read on open, so tokens are not counted (a longer one read says tokens are lost).

The training stream of an epoch: the files in an order shuffled by ``(seed, epoch)``, each file's
training records in file order, cut into blocks of B items (B = --batch-size). Rank ``r`` of ``R``
(``torch.distributed``) takes ``G`` consecutive blocks in turn (G = micro-batches per update, so the
ranks together read each update what one process would), and DataLoader worker ``w`` of ``W`` every
W-th block of its rank. Every record is read once per epoch by exactly one reader, and the order
does not depend on W (the reference fixed ``(worker, instance)`` shards of each file and, without
workers, started at a random record).
"""

from __future__ import annotations

import copy
import glob
import os
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data.contract import DataAccount, DataRequest, DatasetSplit, Drop, ShardedStream, count
from gpt2forge.data.mmap import split_boundaries

FEATURE = "input_ids"
HEADER_BYTES, FOOTER_BYTES = 12, 4  # uint64 length + uint32 masked CRC; uint32 masked CRC
RECREATE = "python data/write_into_tfrecord.py --input-file-path <.pkl or mmap prefix> --output-file-path <dir>"


def index_path(path: str) -> str:
    """``data_0.tfrecord`` -> ``data_0.index`` (the reference's rule); other names get ``.index`` added."""
    return path[: -len(".tfrecord")] + ".index" if path.endswith(".tfrecord") else path + ".index"


def _index_hint(path: str) -> str:
    return f"re-create it with `python -m tfrecord.tools.tfrecord2idx {path} {index_path(path)}`"


def expand_inputs(patterns: tuple[str, ...]) -> list[str]:
    """Paths and globs -> TFRecord files (index files a broad glob matches are left out).

    Raises:
        UsageError: no pattern given, or one that names no file.
    """
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if not m.endswith(".index") and os.path.isfile(m)]
        if not matches:
            raise UsageError(f"--input-files {pattern}: no TFRecord file matches; write them with `{RECREATE}`")
        files += [m for m in matches if m not in files]
    if not files:
        raise UsageError("--dataset tfrecord needs --input-files 'DIR/*.tfrecord'")
    return files


def read_index(path: str) -> np.ndarray:
    """The record boundaries of ``path`` from its index: ``(n + 1,)`` int64 byte offsets, ``[0] == 0``,
    ``[-1] ==`` the file size.

    Raises:
        UsageError: index missing, malformed, or not tiling the file (truncated or stale data or index).
    """
    ipath = index_path(path)
    if not os.path.isfile(ipath):
        raise UsageError(f"{path}: index file {ipath} is missing; {_index_hint(path)}")
    with open(ipath, "rb") as f:
        text = f.read()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns (does not raise) where parsing stopped early
        try:
            numbers = np.fromstring(text, dtype=np.int64, sep=" ") if text.strip() else np.zeros(0, np.int64)
        except (ValueError, DeprecationWarning):
            numbers = None
    lines = text.count(b"\n") + (not text.endswith(b"\n") and bool(text))
    if numbers is None or numbers.size != 2 * lines:
        raise UsageError(f"{ipath}: not an index (expected one '<offset> <length>' line per record); "
                         f"{_index_hint(path)}")
    entries = numbers.reshape(-1, 2)
    size = os.path.getsize(path)
    bounds = np.concatenate([entries[:, 0], [size]])
    if not entries.size:
        raise UsageError(f"{path}: index {ipath} lists no records; {_index_hint(path)}")
    bad = np.flatnonzero((np.diff(bounds) != entries[:, 1]) | (entries[:, 1] < HEADER_BYTES + FOOTER_BYTES))
    if bounds[0] != 0 or bad.size:
        at = int(bad[0]) if bad.size else 0
        raise UsageError(f"{path}: does not match its index {ipath} at record {at} (the file is "
                         f"{size} bytes; truncated, or the index is stale); {_index_hint(path)} if the "
                         f"data is complete, else `{RECREATE}`")
    return bounds


@dataclass(frozen=True)
class RecordSource:
    """The TFRecord files and their record boundaries, shared by the train and valid streams."""

    files: tuple[str, ...]
    bounds: tuple[np.ndarray, ...]  # per file: (n + 1,) byte offsets of its records
    vocab_size: int

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(b) - 1 for b in self.bounds], dtype=np.int64)

    def fail(self, f: int, record: int, what: str) -> UsageError:
        return UsageError(f"{self.files[f]}: record {record} {what}; re-create the file with `{RECREATE}`")

    def read(self, handle, f: int, first: int, end: int, verify: bool):
        """Token ids (int64 arrays) of records ``[first, end)`` of file ``f``, checked (see module doc)."""
        from tfrecord import example_pb2
        from tfrecord.writer import TFRecordWriter

        b = self.bounds[f]
        handle.seek(int(b[first]))
        buf = handle.read(int(b[end] - b[first]))
        if len(buf) != b[end] - b[first]:
            raise self.fail(f, first, "is cut short (the file changed since it was opened)")
        view = memoryview(buf)
        for r in range(first, end):
            rec = view[int(b[r] - b[first]): int(b[r + 1] - b[first])]
            (length,) = struct.unpack_from("<Q", rec)
            if length != len(rec) - HEADER_BYTES - FOOTER_BYTES:
                raise UsageError(f"{self.files[f]}: record {r} says {length} bytes but its index entry "
                                 f"{len(rec)} (corrupt data or stale index); {_index_hint(self.files[f])}")
            payload = rec[HEADER_BYTES: HEADER_BYTES + length]
            if verify and (TFRecordWriter.masked_crc(rec[:8]) != rec[8:12]
                           or TFRecordWriter.masked_crc(payload) != rec[-FOOTER_BYTES:]):
                raise self.fail(f, r, "fails its CRC check (corrupt)")
            example = example_pb2.Example()
            try:
                example.ParseFromString(payload)
            except Exception:  # protobuf's DecodeError type depends on the backend in use
                raise self.fail(f, r, "is not a tf.train.Example") from None
            feature = example.features.feature.get(FEATURE)
            if feature is None or feature.WhichOneof("kind") != "int64_list":
                raise self.fail(f, r, f"has no Int64List feature {FEATURE!r}")
            ids = np.array(feature.int64_list.value, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
                raise self.fail(f, r, f"has token id {bad} outside the model's vocabulary "
                                      f"[0, {self.vocab_size}) (made with another tokenizer?)")
            yield ids


class TFRecordDataset(ShardedStream):
    """One split's records as ``max_len + 1`` int64 token tensors (stream order: module doc).

    ``len()`` is the split's records, all ranks together (as for map-style datasets, whose global
    order the trainer slices by rank); ``local_len()`` is this rank's part, what iterating yields.
    ``epoch_stream`` gives the view the trainer iterates (the protocol in ``gpt2forge.data.contract``);
    iterating the dataset itself reads epoch 0. Both splits are sharded by rank: the trainer sums
    validation totals over ranks.
    """

    def __init__(self, source: RecordSource, first: int, end: int, sample_len: int, seed: int,
                 shuffle: bool) -> None:
        super().__init__()
        self.source = source
        self.first, self.end = first, end  # global record numbers of this split
        self.sample_len = sample_len
        self.seed = seed
        self.shuffle = shuffle
        self.epoch, self.block, self.start_block, self.group = 0, 1, 0, 1

    def _blocks(self) -> tuple[int, int, int]:
        """``(rank, world, blocks of this rank)``: global block ``b`` (items ``[b B, b B + B)``)
        belongs to rank ``(b mod (world G)) // G``, ``G = self.group``."""
        rank, world = self.rank_world()
        n = self.end - self.first
        full, rest = divmod(n, self.block)
        span = world * self.group
        owned = full // span * self.group + min(max(full % span - rank * self.group, 0), self.group)
        owns_last = rest > 0 and (full % span) // self.group == rank
        return rank, world, owned + owns_last

    def _global_block(self, local: int, rank: int, world: int) -> int:
        rounds, within = divmod(local, self.group)
        return rounds * world * self.group + rank * self.group + within

    def __len__(self) -> int:
        return self.end - self.first

    def local_len(self) -> int:
        """Items this rank reads per epoch (``len()`` split over ranks by blocks)."""
        rank, world, blocks = self._blocks()
        if not blocks:
            return 0
        last = (self._global_block(blocks - 1, rank, world) + 1) * self.block
        return blocks * self.block - max(last - (self.end - self.first), 0)

    def epoch_stream(self, epoch: int, block: int, start_block: int = 0, group: int = 1) -> TFRecordDataset:
        """A view of epoch ``epoch`` for this rank: its blocks of ``block`` items from its block
        ``start_block`` on. Ranks take ``group`` consecutive blocks in turn (the trainer passes the
        micro-batches per update), so R ranks together read what one process would in one update."""
        view = copy.copy(self)
        view.epoch, view.block, view.start_block, view.group = epoch, block, start_block, group
        return view

    def segments(self) -> list[tuple[int, int, int]]:
        """This epoch's split records in stream order, as ``(file, first, end)`` record ranges."""
        counts = self.source.counts
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        order = np.arange(len(counts))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(counts))
        out = []
        for f in order:
            lo = max(self.first, starts[f]) - starts[f]
            hi = min(self.end, starts[f] + counts[f]) - starts[f]
            if hi > lo:
                out.append((int(f), int(lo), int(hi)))
        return out

    def _pieces(self, a: int, b: int, segments: list[tuple[int, int, int]]):
        """``(file, first, end)`` ranges covering stream items ``[a, b)``."""
        pos = 0
        for f, lo, hi in segments:
            n = hi - lo
            if pos + n > a and pos < b:
                yield f, lo + max(a - pos, 0), lo + min(b - pos, n)
            pos += n
            if pos >= b:
                return

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rank, world, blocks = self._blocks()
        n = self.end - self.first
        segments = self.segments()
        handles: dict[int, object] = {}
        try:
            for local in range(self.start_block + worker, blocks, workers):
                a = self._global_block(local, rank, world) * self.block
                for f, first, end in self._pieces(a, min(a + self.block, n), segments):
                    if f not in handles:
                        handles[f] = open(self.source.files[f], "rb")
                    for ids in self.source.read(handles[f], f, first, end, verify=False):
                        yield self._item(ids)
        finally:
            for h in handles.values():
                h.close()

    def _item(self, ids: np.ndarray) -> torch.Tensor:
        item = torch.full((self.sample_len,), IGNORE_INDEX, dtype=torch.int64)  # (L,)
        n = min(ids.size, self.sample_len)
        item[:n] = torch.from_numpy(ids[:n])
        return item


def _check_records(source: RecordSource, verify: bool, sample_len: int) -> np.ndarray:
    """Read the first record of each file, or every record with ``verify``; notice a length mismatch.

    Returns the token count of every record (global order), -1 for each record not read.
    """
    lengths = np.full(int(source.counts.sum()), -1, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(source.counts)[:-1]])
    with tqdm(total=len(lengths) if verify else len(source.files), desc="verifying TFRecords", unit="rec",
              disable=not verify or log.rank() != 0) as bar:
        for f, path in enumerate(source.files):
            end = len(source.bounds[f]) - 1 if verify else 1
            with open(path, "rb") as h:
                for r, ids in enumerate(source.read(h, f, 0, end, verify)):
                    lengths[starts[f] + r] = ids.size
                    bar.update(1)
    longest = int(lengths.max())
    if longest < sample_len - 1:
        log.notice(f"TFRecords hold {longest} tokens or fewer; items are padded to --max-len "
                   f"{sample_len - 1} + 1 (write them with --seq-length {sample_len - 1} to use it all)")
    return lengths


def record_account(split: str, source: str, lengths: np.ndarray, sample_len: int) -> DataAccount:
    """An item per record, its first ``sample_len`` tokens. ``lengths``: the split's record lengths, -1
    where a record was not read (then tokens are not counted; a record read longer says some are lost)."""
    n, known = len(lengths), bool((lengths >= 0).all())
    longer = lengths > sample_len
    if known:
        tokens, kept = int(lengths.sum()), int(np.minimum(lengths, sample_len).sum())
        cut = Drop(f"past the first {sample_len:,} of {count(int(longer.sum()), 'records')} longer than --max-len "
                   f"{sample_len - 1} + 1", tokens - kept)
        return DataAccount(split, source, n, tokens, n, "records", kept, drops=(cut,), unit="records")
    drops = (Drop(f"past the first {sample_len:,} of each longer record (records read on open hold up to "
                  f"{int(lengths.max()):,})", None),) if longer.any() else ()
    return DataAccount(split, source, n, None, n, "records", None, drops=drops, unit="records",
                       note="tokens not counted: --verify reads every record on open")


def load(req: DataRequest) -> DatasetSplit:
    """Reader for ``tfrecord``: train, valid and test splits of the records (see module doc).

    Raises:
        UsageError: no files, a missing/malformed/inconsistent index, a corrupt record (CRCs only with
            ``--verify``), token ids outside the vocabulary, a bad ``--split``, or no training record.
    """
    files = expand_inputs(tuple(req.data.input_files or ()))
    source = RecordSource(tuple(files), tuple(read_index(f) for f in files), req.vocab_size)
    L = req.max_len + 1
    lengths = _check_records(source, req.data.verify, L)
    total = int(source.counts.sum())
    bounds = split_boundaries(req.data.split, total)
    log.info(f"tfrecord: {len(files)} files, {total} records; --split {req.data.split}: train "
             f"{bounds[1] - bounds[0]}, valid {bounds[2] - bounds[1]}, test {bounds[3] - bounds[2]}")
    if bounds[1] <= bounds[0]:
        raise UsageError(f"--split {req.data.split} leaves no training record of {total}; give train a larger share")
    splits = [TFRecordDataset(source, bounds[k], bounds[k + 1], L, req.data.seed, shuffle=k == 0)
              if bounds[k + 1] > bounds[k] else None for k in range(3)]
    label = f"tfrecord {' '.join(req.data.input_files)}"
    accounts = tuple(record_account(name, label, lengths[bounds[k]:bounds[k + 1]], L)
                     for k, name in enumerate(("train", "valid", "test")) if splits[k] is not None)
    return DatasetSplit(train=splits[0], val=splits[1], test=splits[2], accounts=accounts)
