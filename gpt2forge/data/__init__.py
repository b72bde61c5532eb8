"""Training data: one reader per on-disk format behind one interface, and the registry that picks it.

Owns the data flags (`args`: the `DataArgs` section of the run's configuration), the reader
contract (`contract`: `DataRequest` in -- that section and what the run decided --, `DatasetSplit`
out, items of ``max_len + 1`` token ids, the `DataAccount` of what a reader kept and dropped, the
`ShardedStream` base and the `EpochOrdered` hook), the readers (`generated`, `pickled` with
`safe_pickle` and its `window_accounts`, `mmap` over the Megatron `indexed` format,
`tfrecord`, `rawtext` for ``jsonl`` and ``text`` with its tokenized `text_cache` and the
prompt/completion records of `completion`, `hf_datasets` for ``hf``: Hugging Face ``datasets`` data
(opened by `hf_sources`) grouped into blocks as transformers' run_clm) and the registry `DATASETS`
with `load_datasets`.

Adding a format: write ``gpt2forge/data/<format>.py`` with a ``load(req)`` function honouring
the contract (import it from ``gpt2forge.data.contract``; its result accounts for every split it
reads), and add one entry to ``DATASETS``.

May import: gpt2forge.core, gpt2forge.ops, gpt2forge.text (the raw-text readers tokenize); the optional
``datasets`` package only inside `hf_sources` and `hf_datasets`, when ``--dataset hf`` is read.
"""

from __future__ import annotations

from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data import generated, hf_datasets, mmap, pickled, rawtext, tfrecord
from gpt2forge.data.contract import (
    DataAccount,
    DataRequest,
    DatasetSplit,
    Drop,
    EpochOrdered,
    Reader,
    ShardedStream,
    collate,
    data_loader,
    split_batch,
)

DATASETS: dict[str, Reader] = {
    "generated": generated.load,
    "pickle": pickled.load,
    "mmap": mmap.load,
    "tfrecord": tfrecord.load,
    "jsonl": rawtext.load,
    "text": rawtext.load,
    "hf": hf_datasets.load,
}
"""Registry: ``--dataset`` name -> reader. One entry per format module."""


def load_datasets(req: DataRequest) -> DatasetSplit:
    """Build the train (and optional validation) dataset that ``req.data.dataset`` names, with the accounts of
    what its reader kept and dropped (the first one the training split's).

    Raises:
        UsageError: unknown dataset name (the message lists the valid ones), or any problem the
            reader finds with its flags or files.
    """
    reader = DATASETS.get(req.data.dataset)
    if reader is None:
        raise UsageError(f"--dataset {req.data.dataset} is unknown; choose one of {', '.join(DATASETS)}")
    split = reader(req)
    assert split.accounts and split.accounts[0].split == "train", f"--dataset {req.data.dataset}: no training account"
    return split


__all__ = [
    "DATASETS",
    "IGNORE_INDEX",
    "DataAccount",
    "DataRequest",
    "DatasetSplit",
    "Drop",
    "EpochOrdered",
    "Reader",
    "ShardedStream",
    "collate",
    "data_loader",
    "load_datasets",
    "split_batch",
]
