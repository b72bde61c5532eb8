"""Pickle or Megatron mmap -> TFRecord shards + `.index` files (`write_into_tfrecord.py`).

Each record is a `tf.train.Example` with one feature, `input_ids` (Int64List), written by the
`tfrecord` package (no TensorFlow). Every document is cut on its own (the reference treated the
whole pickle as one sequence, a QUIRK): windows of `--seq-length` tokens every `--stride` tokens,
then the remaining tail if it holds at least `seq_length // 2` tokens; `--seq-length 0` writes
each document whole (lossless). Documents are visited in a seeded random order and records are
dealt round-robin to `data_{i}.tfrecord`, i < `--num-output`. The `tfrecord2idx` index
(`"<offset> <length>"` per record) is written in the same run as `data_{i}.index`.
All files are written under temporary names and renamed at the end, indexes last, so an
interrupted run leaves no shard that has an index.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2forge.core.atomic import fsync_path
from gpt2forge.core.errors import UsageError, collect
from gpt2forge.data.indexed import IndexedDataset, exists
from gpt2forge.data.safe_pickle import safe_load

FEATURE = "input_ids"


def windows(doc: np.ndarray, seq_length: int, stride: int) -> Iterator[np.ndarray]:
    """Full windows `doc[s:s+seq_length]`, s = 0, stride, ...; then the tail from the next start
    if it has >= seq_length // 2 tokens. `seq_length == 0`: the whole document."""
    if seq_length == 0:
        if len(doc):
            yield doc
        return
    start = 0
    while start + seq_length <= len(doc):
        yield doc[start:start + seq_length]
        start += stride
    if len(doc) - start >= max(seq_length // 2, 1):
        yield doc[start:]


class _Documents:
    """An IndexedDataset's documents as a lazy sequence (no per-document objects kept)."""

    def __init__(self, ds: IndexedDataset):
        self.ds = ds

    def __len__(self) -> int:
        return self.ds.num_documents

    def __getitem__(self, j: int) -> np.ndarray:
        return self.ds.document(int(j))


def load_documents(path: str) -> Sequence[np.ndarray]:
    """Documents of a `.pkl` (list of token-id lists) or a Megatron prefix, as a sequence."""
    if exists(path):
        ds = IndexedDataset(path)
        return _Documents(ds)
    recreate = "python data/wikipedia_preprocess.py --input-file-path ... --output-file-path ..."
    docs = safe_load(path, recreate=recreate)
    if not isinstance(docs, list) or (docs and not isinstance(docs[0], (list, np.ndarray))):
        raise UsageError(f"{path}: expected a list of documents (lists of token ids), got "
                         f"{type(docs).__name__}{' of ' + type(docs[0]).__name__ if docs else ''}; "
                         f"re-create it with `{recreate}`")
    return docs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/write_into_tfrecord.py",
        description="Write a .pkl or Megatron mmap dataset as TFRecord shards (feature input_ids) "
                    "plus their tfrecord2idx .index files.")
    parser.add_argument("--input-file-path", default="./wikicorpus_en_one_article_per_line.pkl",
                        help=".pkl file or mmap prefix (default: ./wikicorpus_en_one_article_per_line.pkl)")
    parser.add_argument("--output-file-path", type=Path, default=Path("./tfrecords"),
                        help="folder for data_{i}.tfrecord/.index (default: ./tfrecords)")
    parser.add_argument("--seq-length", type=int, default=128,
                        help="tokens per record; 0 = one record per whole document (default: 128)")
    parser.add_argument("--stride", type=int, default=128, help="tokens between window starts")
    parser.add_argument("--num-output", type=int, default=4, help="number of shards (default: 4)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the document order")
    parser.add_argument("--overwrite", action="store_true", help="rewrite existing shards")
    return parser


def shard_paths(out: Path, num_output: int) -> list[tuple[Path, Path]]:
    return [(out / f"data_{i}.tfrecord", out / f"data_{i}.index") for i in range(num_output)]


def is_complete(out: Path, num_output: int) -> bool:
    """True if every shard and its index exist and the index's last record ends the file."""
    for data, index in shard_paths(out, num_output):
        if not (data.is_file() and index.is_file()):
            return False
        lines = index.read_text().split()
        end = int(lines[-2]) + int(lines[-1]) if lines else 0
        if end != data.stat().st_size:
            return False
    return True


def _publish(tmps: list[tuple[str, str]], finals: list[tuple[Path, Path]]) -> None:
    from tfrecord.tools.tfrecord2idx import create_index

    for data_tmp, index_tmp in tmps:
        create_index(data_tmp, index_tmp)
    for (data_tmp, _), (data, index) in zip(tmps, finals):
        index.unlink(missing_ok=True)  # never pair a new shard with an old index
        os.chmod(data_tmp, 0o644)
        os.replace(data_tmp, data)
    for (_, index_tmp), (_, index) in zip(tmps, finals):
        os.chmod(index_tmp, 0o644)
        os.replace(index_tmp, index)


def write_into_tfrecord(args: argparse.Namespace) -> int | None:
    """Run the tool for parsed `args`; returns records written (None if the output was complete)."""
    from tfrecord.writer import TFRecordWriter

    collect([m for m in (
        None if args.num_output >= 1 else f"--num-output must be at least 1, got {args.num_output}",
        None if args.seq_length >= 0 else f"--seq-length must be >= 0, got {args.seq_length}",
        None if args.stride >= 1 else f"--stride must be at least 1, got {args.stride}",
    ) if m])
    out, finals = args.output_file_path, shard_paths(args.output_file_path, args.num_output)
    if is_complete(out, args.num_output) and not args.overwrite:
        print(f"{out}: all {args.num_output} shards and indexes exist and are complete; nothing "
              f"to do (pass --overwrite to rewrite)")
        return None
    docs = load_documents(args.input_file_path)
    out.mkdir(parents=True, exist_ok=True)
    tmps = [tuple(tempfile.mkstemp(dir=out, prefix=f".{p.name}.", suffix=".tmp")[1] for p in pair)
            for pair in finals]
    writers = [TFRecordWriter(data_tmp) for data_tmp, _ in tmps]
    start, records, tokens = time.perf_counter(), 0, 0
    try:
        order = np.random.default_rng(args.seed).permutation(len(docs))
        for i in tqdm(order, desc="writing records", unit="doc"):
            for window in windows(np.asarray(docs[i]), args.seq_length, args.stride):
                writers[records % len(writers)].write({FEATURE: (window.tolist(), "int")})
                records += 1
                tokens += len(window)
        for w in writers:
            w.file.flush()
            os.fsync(w.file.fileno())
            w.close()
        _publish(tmps, finals)
        fsync_path(out)
    except BaseException as exc:
        for w in writers:
            with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails again
                w.file.close()
        for pair in tmps:
            for p in pair:
                Path(p).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(out)) from None
        raise
    secs = time.perf_counter() - start
    print(f"wrote {args.num_output} shards + .index files to {out}: {records} records")
    print(f"documents: {len(docs)}, tokens: {tokens}, seconds: {secs:.2f}, "
          f"tokens/s: {tokens / max(secs, 1e-9):.0f}")
    return records
