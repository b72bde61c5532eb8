"""The reader contract: what a reader is given, what it returns, and what the trainer may ask of a dataset.

Every reader is a function ``load(req: DataRequest) -> DatasetSplit``, whose ``accounts`` say what
it kept of its input and what it dropped, and why (``DataAccount``: no data is lost silently). Every
dataset item is a 1-D ``torch.int64`` tensor of exactly ``max_len + 1`` token ids, padded at the end
with ``IGNORE_INDEX``; so ``collate`` is a plain stack and ``split_batch`` turns a batch into ``(input_ids, labels)`` of
``(B, max_len)`` each. The training loop never branches on the format. An item may instead be a
``(2, max_len + 1)`` tensor: row 0 the token ids, row 1 a loss mask (1: the token is a scored
target, 0: it is not, e.g. a prompt token under ``--loss-on completion``); ``split_batch`` turns the
unscored targets into ``IGNORE_INDEX``. A batch holds one kind of item.

How the trainer reads an epoch (``train.batches.epoch_updates``) -- a reader may refine it with a hook:

- map-style dataset: a permutation of ``range(len(ds))`` seeded by ``(seed, epoch)``; or, when the
  dataset is ``EpochOrdered`` (has ``epoch_indices(epoch, count) -> Tensor``), those indices
  (``mmap``: its index is already shuffled over all epochs and is read in order, as in Megatron).
- ``ShardedStream`` (``tfrecord``): ``epoch_stream(epoch, block, start_block, group)`` returns a
  stream over that epoch's blocks of ``block`` items for this rank (ranks take ``group`` consecutive
  blocks in turn), from the rank's block ``start_block`` on, where DataLoader worker ``w`` of ``W``
  yields blocks ``w, w + W, ...``; a DataLoader with ``batch_size=block`` then delivers the blocks in
  stream order whatever the worker count, so a resumed run skips consumed batches without reading
  them. It shards itself: by ``torch.distributed`` rank, or by what ``shard(rank, world_size)`` set
  (training and validation: the trainer sums validation totals over ranks), and its ``len()``
  counts the items of all ranks, as a map-style dataset's does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Dataset

from gpt2forge.core.device import loader_workers
from gpt2forge.core.errors import collect
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data.args import DataArgs


@dataclass(frozen=True)
class DataRequest:
    """What a reader is asked for: the run's data section, and what the run decided around it.

    Every data setting is a ``DataArgs`` field, read as ``req.data.<field>``; the fields here are the
    run's shape, which no data flag sets alone (the model's sequence length and vocabulary, the run's
    samples per step and length).
    """

    data: DataArgs
    """The data section (``--dataset``, ``--input-files``, ``--split``, ...)."""
    max_len: int
    """Model sequence length (``--max-len``); every item is ``max_len + 1`` tokens."""
    vocab_size: int
    """The model's real vocabulary size; every token id must lie in ``[0, vocab_size)``."""
    samples_per_step: int = 1
    """Global samples consumed per host step; ``generated`` makes exactly 4 host steps per epoch."""
    epochs: int = 1
    """``--epochs``: mmap builds its training index for every epoch the run reads."""
    training_steps: int | None = None
    """``--training-steps``: when set, the run reads ``training_steps x samples_per_step`` training samples,
    known before the data is read; mmap asks for exactly these, as Megatron-LM asks for ``train_iters x
    global_batch`` (None: whole ``epochs``)."""
    def __post_init__(self) -> None:
        errors = []
        if self.max_len < 1:
            errors.append(f"--max-len {self.max_len} must be >= 1")
        if self.vocab_size < 2:
            errors.append(f"vocab_size {self.vocab_size} (model config) must be >= 2")
        if self.samples_per_step < 1:
            errors.append(
                f"samples per step {self.samples_per_step} must be >= 1 "
                "(check --batch-size, --gradient-accumulation, --replication-factor)"
            )
        collect(errors)


@dataclass(frozen=True)
class Drop:
    """Tokens of a split's input that no item holds, for one reason."""

    reason: str
    """Why, in words that follow ``dropped N tokens``: ``shorter than 128 tokens (--windows packed keeps them)``."""
    tokens: int | None
    """Tokens dropped; None: not counted (the account's ``note`` says how to count them)."""
    documents: int = 0
    """Whole documents (records) among them: documents none of whose tokens an item holds."""
    whole: bool = False
    """The tokens are exactly those documents' (``5 documents (60 tokens)``), not more (``90 tokens (5
    documents whole)``)."""

    def text(self, unit: str) -> str:
        counted = "uncounted tokens" if self.tokens is None else count(self.tokens, "tokens")
        if not self.documents:
            return f"{counted} {self.reason}"
        if self.whole:
            return f"{count(self.documents, unit)} ({counted}) {self.reason}"
        return f"{counted} ({count(self.documents, unit)} whole) {self.reason}"


def count(n: int, plural: str) -> str:
    """``count(5153, "documents")`` -> ``5,153 documents``; ``count(1, "windows")`` -> ``1 window``."""
    return f"{n:,} {plural[:-1] if n == 1 and plural.endswith('s') else plural}"


@dataclass(frozen=True)
class DataAccount:
    """What a reader made of one split's input: its items, and every token it did not keep, with the reason.

    The trainer prints ``line()`` once at start-up, one line per split (and per corpus of a blend), e.g.
    ``train data: pickle x.pkl: 5,153 documents, 412,000 tokens; kept 42 windows from 40 documents (9,300
    tokens); dropped 5,113 documents (402,700 tokens) shorter than 128 tokens (--windows packed keeps them)``.
    When every count is known, ``tokens == kept_tokens + sum(drop.tokens)``.
    """

    split: str
    """``train``, ``valid`` or ``test``."""
    source: str
    """The reader and its input: ``pickle x.pkl``, ``mmap PREFIX``, ``tfrecord 'dir/*.tfrecord'``."""
    documents: int
    """Documents (``unit``) of the split's input."""
    tokens: int | None
    """Tokens of the split's input (None: not counted without reading every record)."""
    items: int
    """Items the split holds (a pass: ``len(dataset)``; 0 when the split yields no dataset)."""
    item: str
    """What an item is, plural: ``windows``, ``samples``, ``blocks``, ``records``."""
    kept_tokens: int | None
    """Tokens some item holds (each counted once)."""
    kept_documents: int | None = None
    """Documents some item holds a token of; None where an item is a record (nothing to add) or items
    cross documents in an order the shuffle decides (mmap, hf)."""
    drops: tuple[Drop, ...] = ()
    unit: str = "documents"
    """What the input is made of: ``documents``, ``records``, ``samples``."""
    note: str = ""
    """Anything else the line must say (a default the reader chose, how to count what is not counted)."""

    def __post_init__(self) -> None:
        counts = [self.tokens, self.kept_tokens, *(d.tokens for d in self.drops)]
        assert None in counts or self.tokens == self.kept_tokens + sum(d.tokens for d in self.drops), (
            f"{self.split} {self.source}: {self.tokens} tokens != kept {self.kept_tokens} + dropped {self.drops}")

    @property
    def dropped_tokens(self) -> int:
        """Tokens dropped for every counted reason."""
        return sum(d.tokens or 0 for d in self.drops)

    @property
    def dropped_documents(self) -> int:
        """Whole documents dropped, all reasons."""
        return sum(d.documents for d in self.drops)

    def line(self) -> str:
        """The start-up line (class doc)."""
        counted = "" if self.tokens is None else f", {count(self.tokens, 'tokens')}"
        kept = f"kept {count(self.items, self.item)}"
        if self.kept_documents is not None:
            kept += f" from {count(self.kept_documents, self.unit)}"
        if self.kept_tokens is not None:
            kept += f" ({count(self.kept_tokens, 'tokens')})"
        parts = [f"{self.split} data: {self.source}: {count(self.documents, self.unit)}{counted}", kept]
        drops = [d.text(self.unit) for d in self.drops if d.tokens != 0 or d.documents]
        if drops:
            parts.append("dropped " + ", ".join(drops))
        elif self.tokens is not None:
            parts.append("nothing dropped")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


@dataclass
class DatasetSplit:
    """A reader's result. ``val`` is None when the format or request holds nothing out."""

    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset | None
    test: torch.utils.data.Dataset | None = None
    """Evaluated once after training and logged (mmap's test split or ``--test-data-path``)."""
    accounts: tuple[DataAccount, ...] = ()
    """What the reader kept and dropped: one per split it read (a blend: per split and corpus), in
    split order; every reader gives them, and the trainer prints them at start-up."""


Reader = Callable[[DataRequest], DatasetSplit]


@runtime_checkable
class EpochOrdered(Protocol):
    """The optional hook of a map-style dataset that decides its own epoch order."""

    def epoch_indices(self, epoch: int, count: int) -> torch.Tensor:
        """The first ``count`` item indices of epoch ``epoch`` (global order, all ranks), 1-D int64."""
        ...


class ShardedStream(torch.utils.data.IterableDataset):
    """An iterable dataset that reads only its rank's share and orders each epoch itself.

    The rank is ``torch.distributed``'s unless ``shard`` set one (a replica's pipeline stages read
    the same records, so the trainer shards by replica, not by process).
    """

    def __init__(self) -> None:
        self.rank: int | None = None  # None: torch.distributed's, when initialized
        self.world_size: int | None = None

    def shard(self, rank: int, world_size: int) -> None:
        """Read as reader ``rank`` of ``world_size`` from now on (views made later inherit it)."""
        self.rank, self.world_size = rank, world_size

    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)`` this stream reads as."""
        if self.rank is not None:
            return self.rank, self.world_size or 1
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def local_len(self) -> int:
        """Items this rank reads per epoch (``len()`` counts all ranks)."""
        raise NotImplementedError

    def epoch_stream(self, epoch: int, block: int, start_block: int = 0, group: int = 1) -> ShardedStream:
        """This rank's view of epoch ``epoch`` in blocks of ``block`` items, from its block
        ``start_block`` on; ranks take ``group`` consecutive blocks in turn (module doc)."""
        raise NotImplementedError


def collate(samples: list[torch.Tensor]) -> torch.Tensor:
    """Stack dataset items (all ``(max_len + 1,)`` or all ``(2, max_len + 1)``, module doc) into a
    ``(B, max_len + 1)`` or ``(B, 2, max_len + 1)`` batch."""
    shapes = sorted({tuple(s.shape) for s in samples})
    if len(shapes) != 1 or not (len(shapes[0]) == 1 or (len(shapes[0]) == 2 and shapes[0][0] == 2)):
        raise ValueError(f"collate needs items of one shape, (max_len + 1,) or (2, max_len + 1), got {shapes}")
    return torch.stack(samples).to(torch.int64)  # (B, L) or (B, 2, L)


def data_loader(source: Dataset, args: DataArgs, *, pin_memory: bool, **batching) -> DataLoader:
    """A DataLoader over a split or a stream: --num-workers worker processes (at most the CPUs this
    process may use), items stacked by `collate`, and a generator of its own, so that it never draws
    from the global RNG. `batching`: DataLoader's `batch_size` or `batch_sampler`."""
    return DataLoader(source, collate_fn=collate, num_workers=loader_workers(args.num_workers),
                      pin_memory=pin_memory, generator=torch.Generator(), **batching)


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift a ``(B, max_len + 1)`` batch into model inputs and next-token labels (a ``(B, 2,
    max_len + 1)`` batch of tokens and loss masks: unscored targets become ``IGNORE_INDEX``).

    Returns:
        input_ids: ``batch[:, :-1]`` with ``IGNORE_INDEX`` padding replaced by 0 (a valid embedding row),
            shape ``(B, max_len)``.
        labels: ``batch[:, 1:]``, padding left as ``IGNORE_INDEX`` so the loss skips it,
            shape ``(B, max_len)``.
    """
    mask = None
    if batch.dim() == 3:  # (B, 2, L): tokens and loss mask
        batch, mask = batch[:, 0], batch[:, 1]
    inputs = batch[:, :-1]  # (B, T)
    input_ids = torch.where(inputs == IGNORE_INDEX, torch.zeros_like(inputs), inputs)
    labels = batch[:, 1:].contiguous()  # (B, T)
    if mask is not None:
        labels = torch.where(mask[:, 1:] != 0, labels, torch.full_like(labels, IGNORE_INDEX))
    return input_ids, labels
