"""``--loss-on completion``: prompt/completion records as samples whose loss skips the prompt.

The cache (``rawtext``) holds two sequences per record: the prompt's tokens, then the completion's
followed by the end-of-document token. Each record is one item of the contract's second kind, a
``(2, max_len + 1)`` int64 tensor:

- row 0: prompt + completion + EOD, padded at the end with ``IGNORE_INDEX``;
- row 1: 1 on the completion's tokens and the EOD, 0 on the prompt and the padding.

``split_batch`` then turns every target that is not a completion token into ``IGNORE_INDEX``: the loss
scores the completion (and the EOD that ends it) given the prompt. Too long a record is cut from the
left of its prompt (the completion and the prompt's end, nearest the completion, are kept); a
completion longer than ``max_len + 1`` by itself loses its end (and the EOD) and its prompt. The
number of cut records is logged.

Records are split into train/valid/test in file order by ``--split`` (Megatron's boundaries over
records, as mmap splits documents); the trainer shuffles the training records each epoch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data.contract import DataAccount, DataRequest, DatasetSplit, Drop, count
from gpt2forge.data.indexed import IndexedDataset
from gpt2forge.data.mmap import split_boundaries


def completion_item(prompt: np.ndarray, answer: np.ndarray, length: int) -> torch.Tensor:
    """The ``(2, length)`` item of one record (module doc); ``answer`` ends with the EOD."""
    answer = answer[:length]
    keep = length - len(answer)
    prompt = prompt[len(prompt) - keep:] if len(prompt) > keep else prompt
    item = torch.full((2, length), IGNORE_INDEX, dtype=torch.int64)  # (2, L)
    item[1] = 0
    n_p, n_a = len(prompt), len(answer)
    item[0, :n_p] = torch.from_numpy(prompt.astype(np.int64))
    item[0, n_p:n_p + n_a] = torch.from_numpy(answer.astype(np.int64))
    item[1, n_p:n_p + n_a] = 1
    return item


class CompletionDataset(torch.utils.data.Dataset):
    """Records ``[first, end)`` of a prompt/completion cache; item ``i`` is record ``first + i``."""

    def __init__(self, data: IndexedDataset, first: int, end: int, max_len: int) -> None:
        self.data, self.first, self.end, self.length = data, first, end, max_len + 1

    def __len__(self) -> int:
        return self.end - self.first

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        r = self.first + index
        return completion_item(self.data.get(2 * r), self.data.get(2 * r + 1), self.length)


def load(req: DataRequest, prefix: Path) -> DatasetSplit:
    """The train/valid/test record datasets of the prompt/completion cache at ``prefix``.

    Raises:
        UsageError: the training share of ``--split`` holds no record.
    """
    data = IndexedDataset(prefix, vocab_size=req.vocab_size)
    records = len(data) // 2
    bounds = split_boundaries(req.data.split, records)
    lengths = data.sizes[0::2].astype(np.int64) + data.sizes[1::2]
    cut = int((lengths > req.max_len + 1).sum())
    log.info(f"jsonl --loss-on completion: {records} prompt/completion records, --split {req.data.split}: "
             f"train {bounds[1] - bounds[0]}, valid {bounds[2] - bounds[1]}, test {bounds[3] - bounds[2]}; "
             f"{cut} longer than --max-len {req.max_len} + 1 (cut from the left of the prompt)")
    if bounds[1] <= bounds[0]:
        raise UsageError(f"--input-files {' '.join(req.data.input_files)}: the training share of --split "
                         f"{req.data.split} holds none of the {records} records; add records or give train a larger "
                         "share")
    parts = [CompletionDataset(data, bounds[k], bounds[k + 1], req.max_len) if bounds[k + 1] > bounds[k] else None
             for k in range(3)]
    if parts[1] is None:
        log.notice(f"--loss-on completion: the valid share of --split {req.data.split} holds no record; no "
                   "validation loss will be logged")
    source = f"jsonl {' '.join(req.data.input_files)} --loss-on completion"
    accounts = tuple(record_account(split, source, lengths[bounds[k]:bounds[k + 1]], req.max_len)
                     for k, split in enumerate(("train", "valid", "test")) if parts[k] is not None)
    return DatasetSplit(train=parts[0], val=parts[1], test=parts[2], accounts=accounts)


def record_account(split: str, source: str, lengths: np.ndarray, max_len: int) -> DataAccount:
    """One item per record, each keeping at most ``max_len + 1`` of its tokens (``completion_item``)."""
    tokens, kept = int(lengths.sum()), int(np.minimum(lengths, max_len + 1).sum())
    cut = Drop(f"of {count(int((lengths > max_len + 1).sum()), 'records')} longer than --max-len {max_len} + 1 "
               "(the prompt's start cut first)", tokens - kept)
    return DataAccount(split, source, len(lengths), tokens, len(lengths), "records", kept, drops=(cut,),
                       unit="records")
