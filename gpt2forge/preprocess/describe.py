"""A summary of any data file the trainer reads (`data/inspect_data.py`).

Prints the format, documents (records), tokens, dtype and vocabulary range of a `.pkl`, a Megatron
prefix (or its `.bin`/`.idx`) or a `.tfrecord` shard, and decodes the start of one document.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2forge.core.errors import UsageError
from gpt2forge.data.indexed import IndexedDataset, exists
from gpt2forge.data.safe_pickle import safe_load
from gpt2forge.preprocess.engine import TokenizerSpec
from gpt2forge.preprocess.recipe import recorded_tokenizer
from gpt2forge.text.tokenizer import load_tokenizer


@dataclass
class Summary:
    """What `describe` found; `sample` is the start of the first non-empty document."""

    path: str
    format: str
    documents: int
    tokens: int
    dtype: str
    min_id: int
    max_id: int
    sample: np.ndarray
    tokenizer: TokenizerSpec | None = None
    """The tokenizer that made the ids, where recorded (`preprocess_data.py`'s `<prefix>.source.json`)."""

    def lines(self) -> list[str]:
        return [f"file: {self.path}", f"format: {self.format}",
                f"documents: {self.documents}, tokens: {self.tokens}, dtype: {self.dtype}",
                f"vocabulary range: [{self.min_id}, {self.max_id}]"]


def _ranges(docs) -> tuple[int, int, int, int, np.ndarray]:
    lo, hi, n, tokens, sample = None, None, 0, 0, np.zeros(0, np.int64)
    for doc in docs:
        arr = np.asarray(doc)
        n += 1
        tokens += arr.size
        if arr.size:
            lo = int(arr.min()) if lo is None else min(lo, int(arr.min()))
            hi = int(arr.max()) if hi is None else max(hi, int(arr.max()))
            if not sample.size:
                sample = arr[:1024].astype(np.int64)
    return n, tokens, (lo if lo is not None else 0), (hi if hi is not None else -1), sample


def _mmap(prefix: str) -> Summary:
    ds = IndexedDataset(prefix)
    _, tokens, lo, hi, _ = _ranges(ds.token_chunks())
    first = next((d for d in ds.documents() if d.size), np.zeros(0, ds.dtype))
    return Summary(prefix, f"Megatron mmap ({len(ds)} sequences)", ds.num_documents, tokens,
                   str(ds.dtype), lo, hi, first[:1024].astype(np.int64), recorded_tokenizer(prefix))


def _tfrecord(path: Path) -> Summary:
    from tfrecord.reader import tfrecord_loader

    index = path.with_suffix(".index")
    docs = (rec["input_ids"] for rec in tfrecord_loader(str(path), None, ["input_ids"]))
    try:
        n, tokens, lo, hi, sample = _ranges(docs)
    except Exception as exc:  # the tfrecord package raises bare errors on damaged files
        raise UsageError(f"{path}: unreadable TFRecord file ({type(exc).__name__}: {exc}); "
                         f"re-create it with `python data/write_into_tfrecord.py`") from None
    fmt = "TFRecord (feature input_ids, " + ("index present)" if index.is_file() else "NO .index file)")
    return Summary(str(path), fmt, n, tokens, "int64", lo, hi, sample)


def describe(path: str) -> Summary:
    """Summary of the data file at `path`; UsageError if it is none of the known formats."""
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        return _mmap(str(p.with_suffix("")))
    if exists(path):
        return _mmap(path)
    if p.suffix == ".tfrecord":
        if not p.is_file():
            raise UsageError(f"{path}: no such file")
        return _tfrecord(p)
    if p.is_file():
        docs = safe_load(path)
        if not isinstance(docs, list):
            raise UsageError(f"{path}: a pickle of {type(docs).__name__}, not a list of documents")
        n, tokens, lo, hi, sample = _ranges(docs)
        return Summary(path, "pickle (list of token-id lists)", n, tokens, "python int", lo, hi, sample)
    raise UsageError(f"{path}: not found (expected a .pkl, a .tfrecord, or a Megatron prefix whose "
                     f".bin and .idx exist)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/inspect_data.py",
        description="Summarise a .pkl, .tfrecord or Megatron mmap prefix: documents, tokens, dtype, "
                    "vocabulary range, and the decoded start of one document.")
    parser.add_argument("path", help="data file or Megatron prefix (without .bin/.idx)")
    parser.add_argument("--tokenizer-name-or-path", default=None,
                        help="tokenizer folder for decoding (default: the one recorded beside the data, "
                             "else GPT-2 when the ids fit it)")
    parser.add_argument("--sample-tokens", type=int, default=64,
                        help="tokens of the sample to decode (0: none; default 64)")
    return parser


def inspect_main(args: argparse.Namespace) -> Summary:
    """Print the summary and the decoded sample; returns the Summary."""
    summary = describe(args.path)
    for line in summary.lines():
        print(line)
    ids = summary.sample[: args.sample_tokens].tolist()
    if not ids:
        return summary
    if args.tokenizer_name_or_path is None and summary.tokenizer is not None:
        try:  # the tokenizer that made the ids, never GPT-2's vocabulary in its place
            tok = summary.tokenizer.load()
        except UsageError as exc:
            print(f"sample: not decoded (the data was made with a tokenizer that does not load here: {exc}; "
                  f"pass --tokenizer-name-or-path)")
            return summary
    else:
        tok = load_tokenizer(args.tokenizer_name_or_path)
    if summary.max_id >= tok.vocab_size:
        print(f"sample: not decoded (ids reach {summary.max_id}, beyond {tok.name}'s "
              f"{tok.vocab_size}; pass --tokenizer-name-or-path)")
    else:
        print(f"sample ({len(ids)} tokens, {tok.name}): {tok.decode(ids)!r}")
    return summary
