"""``--dataset hf``: Hugging Face ``datasets`` data, tokenized and grouped into blocks as transformers' run_clm
(the sources and their splits: `hf_sources`).

``--input-files`` names, read locally only (``datasets`` runs offline): a folder written by
``save_to_disk`` (a plain Dataset is the train split); another folder ``load_dataset`` reads (data
files, a hub repository clone; ``--dataset-config-name``); ``.txt``, ``.json``/``.jsonl`` or ``.csv``
files or quoted globs, read by datasets' ``text`` (one record per line; ``--keep-linebreaks``),
``json`` or ``csv`` builder, with ``--valid-data-path`` files of the same kind; or a dataset name in
the local datasets cache. Validation is the ``validation`` split (or those files), else the first
``--validation-split-percentage`` % of the training records (``train[:N%]``, datasets' rounding), the
rest training. The text column is ``--json-key``, else (for the default ``text``) the first column.

Blocks are run_clm_no_trainer's: ``datasets.map(batched=True)`` over batches of 1000 records, on
``--preprocessing-workers`` processes (contiguous shards), tokenizes each record (no special tokens
added; the text ``<|endoftext|>`` is that token, as transformers' GPT-2 tokenizer reads it),
concatenates the batch and cuts blocks of ``--max-len``, dropping the batch's remainder (counted in the
start-up line, ``block_account``). So the worker count changes the blocks, as in run_clm. Item ``i``
is block ``i`` then one ``IGNORE_INDEX``: the inputs are the block, the loss covers its ``max_len - 1``
targets, as ``GPT2LMHeadModel(input_ids=block, labels=block)``.

The blocks of each split are cached as ``NAME-KEY.{train,validation}.npy`` (uint16 when the vocabulary
fits, else int32; memory-mapped), with ``NAME.manifest.json`` and ``NAME.lock`` as in ``text_cache``:
in ``--data-cache-dir``, else a ``.gpt2forge_cache`` folder beside the first file or the dataset folder,
or in the datasets cache for a name. ``KEY`` hashes the content (the files' sha256, or the datasets
fingerprints of the splits), the tokenizer and every setting above. A concurrent process waits for the
build and reuses it; ``--overwrite-cache`` rebuilds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt2forge.core import log
from gpt2forge.core.atomic import fsync_path, write_atomic
from gpt2forge.core.errors import UsageError, os_error_line
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data.contract import DataAccount, DataRequest, DatasetSplit, Drop
from gpt2forge.data.hf_sources import Source, import_datasets, open_raw, resolve_source, text_column
from gpt2forge.data.text_cache import (
    CACHE_FORMAT,
    CacheSlot,
    cache_slot,
    content_key,
    file_records,
    locked,
    read_manifest,
    tokenizer_identity,
)
from gpt2forge.text.tokenizer import GPT2Tokenizer, load_tokenizer
from gpt2forge.text.vocab import EOT_TOKEN

MAP_BATCH = 1000
"""Records per ``datasets.map`` batch (run_clm's): each batch's remainder is dropped."""
LAYOUT = 1
"""Bumped when the blocks made from the same data change, so old caches are not reused."""
PARALLEL_CHARS = 1 << 20
"""A batch of more characters than this is tokenized on threads (in this process)."""
class GroupTexts:
    """The ``datasets.map`` function (batched, with indices): tokenize a batch's records, concatenate
    them and cut blocks of ``block_size`` (run_clm's tokenize + group_texts in one pass, 1:1 per record).

    Returns rows ``input_ids`` (one per block) and one last row with no tokens whose ``dropped`` counts
    the batch's remainder, so token counts are known. Picklable for ``num_proc`` workers: the
    tokenizer is loaded in each process from ``source``.
    """

    def __init__(self, source: str | None, column: str, block_size: int, threads: int):
        self.source, self.column, self.block_size, self.threads = source, column, block_size, threads
        self._tok = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None}

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text as transformers' tokenizer gives them: for GPT-2 on tiktoken, the text
        ``<|endoftext|>`` is that token (Hugging Face tokenizers already read their added tokens so)."""
        if self._tok is None:
            self._tok = load_tokenizer(self.source)
        tok = self._tok
        if not isinstance(tok, GPT2Tokenizer):
            return tok.encode_batch(texts)
        if self.threads > 1 and sum(map(len, texts)) > PARALLEL_CHARS:
            ids = tok.encode_batch(texts, num_threads=self.threads)
        else:  # tiktoken's thread pool costs more than it saves on a small batch
            ids = [tok.encode(text) for text in texts]
        for i, text in enumerate(texts):
            if EOT_TOKEN in text:
                parts = [tok.encode(part) for part in text.split(EOT_TOKEN)]
                ids[i] = [t for k, part in enumerate(parts) for t in ([tok.eot_id] * (k > 0) + part)]
        return ids

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        texts = batch[self.column]
        for text, index in zip(texts, indices):
            if not isinstance(text, str):
                raise UsageError(f"record {index}: column {self.column!r} is {text!r}, not text; fix the record or "
                                 "choose another column with --json-key")
        ids = self.encode(texts)
        total = sum(map(len, ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
        n = total // self.block_size
        rows = list(flat[: n * self.block_size].reshape(n, self.block_size))  # (n, block_size)
        dropped = [0] * n
        if total > n * self.block_size:
            rows.append(flat[:0])
            dropped.append(total - n * self.block_size)
        return {"input_ids": rows, "dropped": dropped}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def write_blocks(mapped, path: Path, block_size: int, dtype: np.dtype) -> dict:
    """The map's blocks as a ``(blocks, block_size)`` array in ``path`` (temp name, fsync, rename);
    returns ``blocks``, ``tokens`` (dropped ones included) and ``max_id``."""
    import pyarrow.compute as pc  # why: a dependency of datasets, needed only when building

    values = pc.list_flatten(mapped.data.column("input_ids"))  # the remainder rows hold no tokens
    blocks = len(values) // block_size
    assert len(values) == blocks * block_size, "every row with tokens is a whole block"
    dropped = int(pc.sum(mapped.data.column("dropped")).as_py() or 0)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(blocks, block_size))
        flat, start, max_id = out.reshape(-1), 0, -1
        for chunk in values.chunks:
            part = chunk.to_numpy(zero_copy_only=False)
            flat[start: start + len(part)] = part
            start += len(part)
            max_id = max(max_id, int(part.max()) if len(part) else -1)
        out.flush()
        del out, flat
        fsync_path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return {"blocks": blocks, "tokens": blocks * block_size + dropped, "max_id": max_id}


def build(raw: dict, column: str, req: DataRequest, slot: CacheSlot, key: str) -> dict:
    """Tokenize and group each split of ``raw`` into ``slot.prefix(key).{split}.npy``; their figures."""
    datasets = import_datasets()
    tok = load_tokenizer(req.data.tokenizer_name_or_path)
    dtype = token_dtype(tok.vocab_size)
    workers = req.data.preprocessing_workers
    fn = GroupTexts(tok.source, column, req.max_len, threads=8 if workers is None else 1)
    features = datasets.Features({"input_ids": datasets.List(datasets.Value(dtype.name)),
                                  "dropped": datasets.Value("int64")})
    scratch = Path(tempfile.mkdtemp(dir=slot.folder, prefix=f".{slot.name}-map-"))
    figures = {}
    try:
        for split, data in raw.items():
            if data is None:
                continue
            if len(data) == 0:
                mapped = datasets.Dataset.from_dict({"input_ids": [], "dropped": []}, features=features)
            else:
                mapped = data.map(fn, with_indices=True, batched=True, batch_size=MAP_BATCH, num_proc=workers,
                                  remove_columns=data.column_names, features=features, load_from_cache_file=False,
                                  cache_file_name=str(scratch / f"{split}.arrow"),
                                  new_fingerprint=f"gpt2forge-{key[:16]}-{split}",
                                  desc=f"hf: tokenizing {split} into blocks of {req.max_len}")
            path = Path(f"{slot.prefix(key)}.{split}.npy")
            figures[split] = {"records": len(data), **write_blocks(mapped, path, req.max_len, dtype)}
            del mapped
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return figures


class BlockDataset(torch.utils.data.Dataset):
    """One split's cached blocks; item ``i`` is block ``i`` and one ``IGNORE_INDEX``, int64, ``max_len + 1``."""

    def __init__(self, path: Path, block_size: int):
        self.path, self.block_size = path, block_size
        self.blocks = self._open()

    def _open(self) -> np.ndarray:
        try:
            blocks = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{self.path}: unreadable cache ({exc}); rebuild it with --overwrite-cache") from None
        if blocks.ndim != 2 or blocks.shape[1] != self.block_size or blocks.dtype not in (np.uint16, np.int32):
            raise UsageError(f"{self.path}: cached blocks of shape {blocks.shape} {blocks.dtype}, expected (N, "
                             f"{self.block_size}) uint16 or int32; rebuild it with --overwrite-cache")
        return blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> torch.Tensor:
        item = torch.full((self.block_size + 1,), IGNORE_INDEX, dtype=torch.int64)
        item[:-1] = torch.from_numpy(self.blocks[index].astype(np.int64))
        return item

    # Workers re-open the file by name: a memmap would otherwise be pickled as a full copy.
    def __getstate__(self) -> dict:
        return {"path": self.path, "block_size": self.block_size}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.blocks = self._open()


def complete(manifest: dict, key: str, slot: CacheSlot) -> bool:
    """True when ``manifest`` records a build of ``key`` whose block files are all there."""
    splits, prefix = manifest.get("splits"), manifest.get("prefix")
    return (manifest.get("reader") == "hf" and manifest.get("key") == key and isinstance(splits, dict)
            and isinstance(prefix, str) and all(Path(f"{slot.folder / prefix}.{s}.npy").is_file() for s in splits))


def _figures(split: dict | None) -> str:
    if split is None:
        return "none"
    return f"{split['records']} records, {split['tokens']} tokens, {split['blocks']} blocks"


def identify(source: Source, req: DataRequest, settings: dict) -> tuple[CacheSlot, list[dict], dict | None]:
    """The cache slot, the content records the key hashes, and the raw splits when they had to be opened.

    Files are keyed by their bytes (a reused cache does not open datasets at all), datasets by the
    fingerprints of their splits.
    """
    if source.kind == "files":
        files = [*source.train_files, *source.valid_files]
        slot = cache_slot(files, settings, req.data.data_cache_dir)
        return slot, file_records(files, read_manifest(slot)), None
    datasets = import_datasets()
    raw = open_raw(source, req, datasets)
    if source.kind == "name":
        folder = req.data.data_cache_dir or str(Path(datasets.config.HF_DATASETS_CACHE) / "gpt2forge")
        slot = cache_slot([Path(folder) / source.where.replace("/", "--")], settings, folder)
    else:
        slot = cache_slot([Path(source.where)], settings, req.data.data_cache_dir)
    return slot, [{"split": s, "sha256": d._fingerprint} for s, d in raw.items() if d is not None], raw


def load(req: DataRequest) -> DatasetSplit:
    """Reader for ``hf`` (module doc): build or reuse the cached blocks, then read them memory-mapped.

    Raises:
        UsageError: bad inputs, data datasets cannot load, no training block, ids beyond the vocabulary.
    """
    start = time.time()
    source = resolve_source(req)
    settings = {"reader": "hf", "layout": LAYOUT, "source": source.kind, "config": req.data.dataset_config_name,
                "json_key": req.data.json_key, "block_size": req.max_len, "map_batch": MAP_BATCH,
                "validation_split_percentage": req.data.validation_split_percentage,
                "keep_linebreaks": req.data.keep_linebreaks, "workers": req.data.preprocessing_workers,
                "validation_files": len(source.valid_files), "tokenizer_path": req.data.tokenizer_name_or_path}
    slot, records, raw = identify(source, req, settings)
    key = content_key(settings, tokenizer_identity(req.data.tokenizer_name_or_path), records)

    def usable(m: dict) -> bool:  # --overwrite-cache: only a build made since this call started
        return complete(m, key, slot) and (not req.data.overwrite_cache or m.get("built_at", 0) >= start)

    manifest = read_manifest(slot)
    reused = usable(manifest)
    if not reused:
        with locked(slot, "hf"):
            manifest = read_manifest(slot)  # another process may have built it while we waited
            reused = usable(manifest)
            if not reused:
                datasets = import_datasets()
                raw = raw or open_raw(source, req, datasets)
                column = text_column(raw["train"], req.data.json_key, source.where, datasets)
                t0 = time.perf_counter()
                try:
                    splits = build(raw, column, req, slot, key)
                except OSError as exc:
                    raise UsageError(f"{os_error_line(exc)} (writing the tokenized cache; pass a writable "
                                     "--data-cache-dir)") from None
                manifest = {"format": CACHE_FORMAT, "reader": "hf", "key": key, "prefix": slot.prefix(key).name,
                            "settings": settings, "files": records, "column": column, "splits": splits,
                            "seconds": round(time.perf_counter() - t0, 3), "built_at": time.time()}
                write_atomic(slot.manifest_path, json.dumps(manifest, indent=1) + "\n")
    elif manifest["files"] != records:  # same bytes, new mtimes: skip hashing them next time
        with contextlib.suppress(OSError):  # a read-only cache is still reusable: it just hashes again
            write_atomic(slot.manifest_path, json.dumps({**manifest, "files": records}, indent=1) + "\n")
    return open_blocks(manifest, slot, req, source.where, reused)


def open_blocks(manifest: dict, slot: CacheSlot, req: DataRequest, where: str, reused: bool) -> DatasetSplit:
    """The datasets of a complete build, after its checks; logs the figures line."""
    splits, prefix = manifest["splits"], slot.folder / manifest["prefix"]
    train, val = splits["train"], splits.get("validation")
    log.info(f"hf: {where}: train {_figures(train)}; validation {_figures(val)} (blocks of {req.max_len} tokens; "
             f"{'reused' if reused else 'built'} the cache {prefix}.*.npy)")
    if train["blocks"] == 0:
        raise UsageError(f"--input-files {where}: the training records make no block of --max-len {req.max_len} "
                         f"tokens ({train['records']} records, {train['tokens']} tokens; as in run_clm each batch of "
                         f"{MAP_BATCH} records of a preprocessing worker drops its remainder): use a smaller --max-len "
                         "or more text")
    max_id = max(s["max_id"] for s in splits.values())
    if max_id >= req.vocab_size:
        raise UsageError(f"--input-files {where}: the tokenizer gives token ids up to {max_id} but the model's "
                         f"vocabulary has {req.vocab_size}; pass the model's tokenizer with --tokenizer-name-or-path "
                         "(or a model of a larger vocab_size)")
    val_set = BlockDataset(Path(f"{prefix}.validation.npy"), req.max_len) if val and val["blocks"] else None
    accounts = tuple(block_account(name, f"hf {where}", figures, req.max_len)
                     for name, figures in (("train", train), ("valid", val)) if figures is not None)
    return DatasetSplit(BlockDataset(Path(f"{prefix}.train.npy"), req.max_len), val_set, accounts=accounts)


def block_account(split: str, source: str, figures: dict, block_size: int) -> DataAccount:
    """A split's blocks from its build figures (``write_blocks``): each batch's remainder is dropped."""
    kept = figures["blocks"] * block_size
    remainder = Drop(f"left after the last block of each batch of {MAP_BATCH:,} records (run_clm's group_texts)",
                     figures["tokens"] - kept)
    return DataAccount(split, source, figures["records"], figures["tokens"], figures["blocks"], "blocks", kept,
                       drops=(remainder,), unit="records")
