"""Training data: one reader per on-disk format behind one interface.

Every reader is a function ``load(req: DataRequest) -> DatasetSplit`` registered in ``DATASETS``.
Every dataset item is a 1-D ``torch.int64`` tensor of exactly ``max_len + 1`` token ids, padded at the
end with ``IGNORE_INDEX``; so ``collate`` is a plain stack and ``split_batch`` turns a batch into
``(input_ids, labels)`` of ``(B, max_len)`` each. The training loop never branches on the format.

Adding a format: write ``gpt2forge/data/<format>.py`` with a ``load(req)`` function honouring
the contract above, and add one entry to ``DATASETS``.

How the trainer reads an epoch (``trainer.epoch_updates``) -- a reader may refine it with a hook:

- map-style dataset: a permutation of ``range(len(ds))`` seeded by ``(seed, epoch)``; or, when the
  dataset has ``epoch_indices(epoch, count) -> Tensor``, those indices (``mmap``: its index is
  already shuffled over all epochs and is read in order, as in Megatron).
- ``IterableDataset`` (``tfrecord``): it must have ``epoch_stream(epoch, block, start_block, group)``
  returning an ``IterableDataset`` over that epoch's blocks of ``block`` items for this rank (ranks
  take ``group`` consecutive blocks in turn), from the rank's block ``start_block`` on, where
  DataLoader worker ``w`` of ``W`` yields blocks ``w, w + W, ...``; a DataLoader with
  ``batch_size=block`` then delivers the blocks in stream order whatever the worker count, so a
  resumed run skips consumed batches without reading them.
  It shards itself by ``torch.distributed`` rank (training and validation: the trainer sums
  validation totals over ranks), and its ``len()`` counts the items of all ranks, as a map-style
  dataset's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gpt2forge.core.errors import UsageError, collect

from gpt2forge.model.gpt2 import IGNORE_INDEX  # noqa: E402  padding value in items and labels; the loss skips it


@dataclass(frozen=True)
class DataRequest:
    """Everything a reader needs, resolved from the command line and the model config."""

    dataset: str
    """Registry key (``--dataset``): one of ``DATASETS``."""
    input_files: tuple[str, ...]
    """Paths from ``--input-files``; empty for ``generated``. A single string is taken as one path."""
    max_len: int
    """Model sequence length (``--max-len``); every item is ``max_len + 1`` tokens."""
    vocab_size: int
    """The model's real vocabulary size; every token id must lie in ``[0, vocab_size)``."""
    seed: int
    """``--seed``: makes generated tokens and the pickle window shuffle reproducible."""
    stride: int = 128
    """``--stride``: tokens between the starts of consecutive pickle windows."""
    val_num: int = 0
    """``--val-num``: pickle windows held out for validation."""
    samples_per_step: int = 1
    """Global samples consumed per host step; ``generated`` makes exactly 4 host steps per epoch."""
    split: str = "969,30,1"
    """``--split``: train,valid,test weights over documents (mmap) or records (tfrecord), as Megatron."""
    epochs: int = 1
    """``--epochs``: mmap builds its training index for every epoch the run reads."""
    training_steps: int | None = None
    """``--training-steps``: when set, decides the epochs the run reads instead of ``epochs``."""
    verify: bool = False
    """``--verify``: full integrity check on open (tfrecord: every record's CRCs, payload and ids)."""

    def __post_init__(self) -> None:
        # A bare string would otherwise be iterated character by character (a reference QUIRK).
        files = (self.input_files,) if isinstance(self.input_files, str) else tuple(self.input_files)
        object.__setattr__(self, "input_files", files)
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
        if self.val_num < 0:
            errors.append(f"--val-num {self.val_num} must be >= 0")
        collect(errors)


@dataclass
class DatasetSplit:
    """A reader's result. ``val`` is None when the format or request holds nothing out."""

    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset | None


Reader = Callable[[DataRequest], DatasetSplit]

# Imported here, after the names above, because the readers import them from this package.
from gpt2forge.data import generated, mmap, pickled, tfrecord  # noqa: E402

DATASETS: dict[str, Reader] = {
    "generated": generated.load,
    "pickle": pickled.load,
    "mmap": mmap.load,
    "tfrecord": tfrecord.load,
}
"""Registry: ``--dataset`` name -> reader. One entry per format module."""


def load_datasets(req: DataRequest) -> DatasetSplit:
    """Build the train (and optional validation) dataset that ``req.dataset`` names.

    Raises:
        UsageError: unknown dataset name (the message lists the valid ones), or any problem the
            reader finds with its flags or files.
    """
    reader = DATASETS.get(req.dataset)
    if reader is None:
        raise UsageError(f"--dataset {req.dataset} is unknown; choose one of {', '.join(DATASETS)}")
    return reader(req)


def collate(samples: list[torch.Tensor]) -> torch.Tensor:
    """Stack dataset items (1-D int64, all ``max_len + 1`` long) into a ``(B, max_len + 1)`` batch."""
    lengths = {int(s.shape[0]) for s in samples if s.dim() == 1}
    if len(lengths) != 1 or any(s.dim() != 1 for s in samples):
        shapes = sorted({tuple(s.shape) for s in samples})
        raise ValueError(f"collate needs 1-D items of one length (max_len + 1), got shapes {shapes}")
    return torch.stack(samples).to(torch.int64)  # (B, L)


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift a ``(B, max_len + 1)`` batch into model inputs and next-token labels.

    Returns:
        input_ids: ``batch[:, :-1]`` with ``IGNORE_INDEX`` padding replaced by 0 (a valid embedding row),
            shape ``(B, max_len)``.
        labels: ``batch[:, 1:]``, padding left as ``IGNORE_INDEX`` so the loss skips it,
            shape ``(B, max_len)``.
    """
    inputs = batch[:, :-1]  # (B, T)
    input_ids = torch.where(inputs == IGNORE_INDEX, torch.zeros_like(inputs), inputs)
    labels = batch[:, 1:].contiguous()  # (B, T)
    return input_ids, labels


__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "DataRequest",
    "DatasetSplit",
    "Reader",
    "collate",
    "load_datasets",
    "split_batch",
]
