"""The data section of the run's configuration (`--dataset`, `--input-files`, ...): the flags live with
the readers that take them, as ParallelArgs lives in gpt2forge.parallel.topology. A reader gets the
section itself, inside a `DataRequest` (gpt2forge.data.contract) with what the run decided.
"""

from __future__ import annotations

import dataclasses

from gpt2forge.core import log
from gpt2forge.core.errors import collect
from gpt2forge.core.flags import flag, opt, positive

WINDOWS = ("document", "packed", "random")
"""How the pickle reader draws training windows (`--windows`; see `data.pickled`)."""

PATH_FIELDS = ("input_files", "train_data_path", "valid_data_path", "test_data_path")
"""The fields holding paths (or weighted prefixes): a bare string among them is one path."""


@dataclasses.dataclass
class DataArgs:
    """Data: source, files, tokenizer, splits, loading and the seed."""

    dataset: str | None = opt(None, choices=("generated", "pickle", "tfrecord", "mmap", "jsonl", "text", "hf"))
    """Data source: generated | pickle | tfrecord | mmap | jsonl | text | hf (old: --train-path
    generated|<file.pkl>|tfrecord|dynamic); hf: a Hugging Face `datasets` dataset or .txt/.json/.jsonl/.csv files read
    through the `datasets` library, each record tokenized, concatenated and cut into blocks of --max-len tokens
    (run_clm's group_texts)"""
    input_files: list[str] | None = opt(None, "--data-prefix", "--tfrecord-path", "--data-path", kind="list_str")
    """Data files: the .pkl for pickle, 'DIR/*.tfrecord' (with their .index files) for tfrecord, PREFIX of
    PREFIX.bin/.idx for mmap, or a weighted blend 'W1 PREFIX1 W2 PREFIX2 ...' (Megatron's --data-path); files or globs
    for jsonl and text; for hf a datasets folder (save_to_disk, or data files), a dataset name in the local datasets
    cache, or .txt/.json/.jsonl/.csv files or globs (run_clm's --train_file)"""
    train_data_path: list[str] | None = opt(None, kind="list_str")
    """mmap: training data alone ('[W1] PREFIX1 ...'), with --valid-data-path and --test-data-path instead of
    --split (Megatron's)"""
    valid_data_path: list[str] | None = opt(None, kind="list_str")
    """mmap: validation data ('[W1] PREFIX1 ...'); jsonl and text: validation files, the --input-files still split
    by --split (seed 001's Megatron --valid-data; mmap with --input-files too); hf: validation files of the
    --input-files kind (run_clm's --validation_file)"""
    test_data_path: list[str] | None = opt(None, kind="list_str")
    """mmap: test data ('[W1] PREFIX1 ...'); jsonl and text: test files, the --input-files still split by --split;
    evaluated at the end of training."""
    json_key: str = opt("text")
    """jsonl: the key holding each document's text (Megatron's --json-keys); hf: the text column (when the data
    has no such column and this is `text`: the first column, as run_clm)"""
    data_cache_dir: str | None = opt(None)
    """jsonl, text and hf: where the tokenized cache (.bin/.idx; hf: .npy blocks) and its manifest are written
    (default: a .gpt2forge_cache folder beside the first input file or the dataset folder; hf dataset names: in the
    datasets cache)"""
    dataset_config_name: str | None = opt(None)
    """hf: the dataset's configuration name (run_clm's --dataset_config_name)"""
    validation_split_percentage: int = opt(5)
    """hf with no validation split or --valid-data-path: the first N percent of the training records are the
    validation set, the rest train (run_clm's; 0: no validation)"""
    keep_linebreaks: bool = opt(True, kind="bool")
    """hf: .txt records keep each line's newline (run_clm_no_trainer's default; --keep-linebreaks False is its
    --no_keep_linebreaks)"""
    preprocessing_workers: int | None = opt(None)
    """hf: processes tokenizing (run_clm's --preprocessing_num_workers; default: this process); as in run_clm it
    changes the blocks, since each worker drops its batches' remainders."""
    overwrite_cache: bool = opt(False, kind="bool")
    """hf: rebuild the tokenized blocks even when cached (run_clm's --overwrite_cache)"""
    loss_on: str = opt("all", choices=("all", "completion"))
    """which tokens carry loss: all | completion (prompt/completion JSONL: prompt tokens are masked)"""
    tokenizer_name_or_path: str | None = opt(None)
    """local tokenizer folder the data was made with (data/train_tokenizer.py output: tokenizer.json, or
    vocab.json + merges.txt); a fresh model takes its vocab_size and checkpoints ship its files; default: GPT-2's
    BPE."""
    stride: int = opt(128)
    """Pickle: sliding-window stride in tokens."""
    val_num: int = opt(0)
    """Pickle: windows held out for validation (evaluated after each epoch)"""
    windows: str | None = opt(None, choices=WINDOWS)
    """pickle: how training windows are drawn: document (the reference's: per document, overlapping tail, short
    documents padded, documents under --max-len/2 tokens dropped) | packed (documents end to end, cut every --stride
    tokens, as Megatron) | random (uniform starts in that stream each epoch, as nanoGPT); default: document, or packed
    when document windows would drop more than half of the tokens (a corpus of short documents); validation windows
    are the same in all three."""
    split: str = opt("969,30,1")
    """mmap and tfrecord: train,valid,test weights over documents (mmap) or records (tfrecord), Megatron's
    --split; valid is evaluated as validation loss."""
    verify: bool = opt(False, kind="bool")
    """tfrecord: read every record on open and check its CRCs, payload and token ids (mmap data is always checked
    on open)"""
    seed: int = opt(1234)
    """Seeds weights, dropout and data order: CPU runs are bit-reproducible."""
    num_workers: int = opt(4)
    """DataLoader worker processes (at most the CPUs this process may use)"""
    async_dataloader: bool = opt(False, kind="bool")
    """Background prefetch of batches (pinned memory on CUDA)"""

    def __post_init__(self) -> None:
        # A bare string would otherwise be iterated character by character (a reference QUIRK).
        for name in PATH_FIELDS:
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])
        problems = positive(self, "stride")
        problems += [f"--{flag(name)} must be >= 0" for name in ("val_num", "num_workers")
                     if getattr(self, name) < 0]
        problems += positive(self, "preprocessing_workers", optional=True)
        if self.windows is not None and self.windows not in WINDOWS:
            problems.append(f"--windows {self.windows} is not one of {', '.join(WINDOWS)}")
        if not 0 <= self.validation_split_percentage < 100:
            problems.append("--validation-split-percentage must be in [0, 100) "
                            f"(got {self.validation_split_percentage})")
        held_out_ok = ("mmap", "jsonl", "text", "hf") if self.valid_data_path else ("mmap", "jsonl", "text")
        split_paths = self.train_data_path and self.dataset != "mmap" or (
            (self.valid_data_path or self.test_data_path) and self.dataset not in held_out_ok)
        if self.dataset in ("pickle", "tfrecord", "jsonl", "text", "hf") and not self.input_files:
            problems.append(f"--dataset {self.dataset} needs --input-files PATH")
        if self.dataset == "mmap" and not (self.input_files or self.train_data_path):
            problems.append("--dataset mmap needs --input-files PREFIX (or W1 PREFIX1 W2 PREFIX2 ...) or "
                            "--train-data-path")
        if split_paths:
            problems.append("--train-data-path needs --dataset mmap; --valid-data-path and --test-data-path go with "
                            "mmap, jsonl and text (--valid-data-path also with hf)")
        if self.loss_on == "completion" and self.dataset not in ("jsonl", None):
            problems.append("--loss-on completion needs --dataset jsonl with prompt/completion records")
        collect(problems)


def notice_ignored_flags(args: DataArgs) -> None:
    """The reference's data flags that are accepted and change nothing here say so once."""
    if args.async_dataloader:
        log.notice("--async-dataloader: batches are prefetched by DataLoader workers (--num-workers)")
