"""``--dataset mmap``: Megatron-Core's GPT samples over Megatron indexed datasets (``.bin``/``.idx``).

``--input-files PREFIX`` names ``PREFIX.bin`` and ``PREFIX.idx`` (``indexed.IndexedDataset``, checked
on open: magic, version, dtype, sizes against the ``.bin`` length, token ids below the vocabulary);
``--data-path W1 PREFIX1 W2 PREFIX2 ...`` blends several (``blend``), each split by ``--split``, or
``--train-data-path``/``--valid-data-path``/``--test-data-path`` give each split its own (weighted)
prefixes, as Megatron-LM. Samples are built exactly as Megatron-Core 0.19's ``GPTDataset`` builds them:

- documents (= sequences of the file) are split into train/valid/test ranges by ``--split``
  (``949,50,1``: weights; Megatron-Core rounds the running total, ``split_boundaries``);
- a split is asked for the samples the run will read: the training split for ``training_steps x samples_per_step``
  (Megatron-LM's ``train_iters x global_batch``; whole ``--epochs`` when the run is given in epochs),
  validation and test for one pass;
- ``doc_idx``: a split's documents repeated once per epoch those samples need and shuffled
  (``RandomState(seed)``; the last epoch is shuffled on its own when less than 80% of it is used);
- ``sample_idx`` ``(built + 1, 2)``: where sample ``i`` starts, as (index into ``doc_idx``, token
  offset). Samples are ``seq_length + 1`` tokens, cross document boundaries freely, and
  consecutive ones share one token. Built by the C++ op ``gpt2forge::build_sample_idx``
  (custom_ops/sample_index.cpp), or by ``build_sample_idx_reference`` when the library is absent;
- ``shuffle_idx``: a permutation of the samples from the same RNG.

The three maps are cached next to the data as ``PREFIX_{split}_indexmap_{num_samples}ns_
{seq_length}sl_{seed}s_{first}-{end}doc_{sizes hash}_{doc,sample,shuffle}_idx.npy``: the name holds
everything their content depends on, so a second run loads them (memory-mapped) and any change of
sample count, sequence length, seed, split or data builds new ones. Each file is written to a temp
name and renamed, and its content is a pure function of its name, so a killed or concurrent build
never leaves a wrong cache.

Epochs: ``len(dataset)`` is the samples of one pass over the split's tokens (of every corpus, for a
blend); the training samples are read in order across epochs (``epoch_indices``), exactly as Megatron
consumes its shuffled index. The start-up lines count, per split and corpus, the tokens a pass keeps
and the fewer than ``seq_length`` it drops after its last full sample (``pass_account``).
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import numpy as np
import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.data.blend import (
    SURPLUS,
    Blend,
    BlendedDataset,
    blend_cache_paths,
    corpus_sizes,
    load_blend_order,
    normalize,
    split_blends,
    train_target,
)
from gpt2forge.data.contract import DataAccount, DataRequest, DatasetSplit, Drop
from gpt2forge.data.indexed import IndexedDataset, open_corpora, save_npy_atomic
from gpt2forge.ops.library import load_custom_ops

SPLIT_NAMES = ("train", "valid", "test")
MAPS = ("doc_idx", "sample_idx", "shuffle_idx")
_INT32_LIMIT = np.iinfo(np.int32).max


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` (or ``949/50/1``, or fewer numbers) -> three weights summing to 1.

    Raises:
        UsageError: not numbers, negative, or all zero.
    """
    sep = "," if "," in split else "/"
    try:
        weights = [float(s) for s in split.split(sep)]
    except ValueError:
        weights = []
    if not weights or len(weights) > 3 or any(not math.isfinite(w) or w < 0 for w in weights) \
            or sum(weights) <= 0:
        raise UsageError(f"--split {split!r}: give up to three non-negative weights for "
                         "train,valid,test, e.g. 949,50,1")
    weights += [0.0] * (3 - len(weights))
    return normalize(weights)


def split_boundaries(split: str, size: int) -> list[int]:
    """Megatron-Core's split of ``size`` documents: ``[0, a, b, size]``, split ``k`` is ``[idx[k], idx[k+1])``.

    Megatron-Core (``convert_split_vector_to_split_matrix`` and the builder) rounds the running total
    of the normalized weights, ``round(0.949 n)``, ``round(0.999 n)``; Megatron-LM's older
    ``get_train_valid_test_split_`` rounded each share and then moved every boundary by the total's
    error, which disagrees for about a quarter of the sizes.
    """
    ends = [0.0]
    for w in parse_split(split):
        ends.append(ends[-1] + w)
    return [int(round(e * float(size))) for e in ends]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Megatron's ``_num_epochs``: passes over the tokens needed for ``num_samples`` samples."""
    epochs = 1
    while (epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        epochs += 1
    return epochs


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last_epoch: bool) -> np.ndarray:
    """Megatron's ``_build_doc_idx``: ``documents`` once per epoch, shuffled (int32 below 2^31 docs)."""
    if not separate_last_epoch or num_epochs == 1:
        dtype = np.int32 if len(documents) == 0 or documents.max() < _INT32_LIMIT else np.int64
        doc_idx = np.tile(documents.astype(dtype), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's ``_build_shuffle_idx``: ``[0, num_samples)`` and ``[num_samples, total_size)`` shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_sample_idx_reference(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                               num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """The oracle of ``gpt2forge::build_sample_idx``, vectorized numpy (no Python loop over samples).

    Sample ``i`` starts at token ``i * seq_length`` of the documents laid end to end in ``doc_idx``
    order; its row is (position in ``doc_idx`` of the document holding that token, offset in it).
    Row 0 is ``(0, 0)`` as in Megatron's loop. Returns ``(num_samples + 1, 2)``, int32 unless
    ``doc_idx`` has 2^31 - 1 or more entries (then int64).

    Raises:
        ValueError: a ``doc_idx`` entry is not a document, or there are too few tokens.
    """
    if seq_length < 1 or num_epochs < 1 or tokens_per_epoch < 1:
        raise ValueError("seq_length, num_epochs and tokens_per_epoch must be >= 1")
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    doc_idx = np.asarray(doc_idx)
    if doc_idx.size and (doc_idx.min() < 0 or doc_idx.max() >= len(sizes)):
        raise ValueError(f"doc_idx holds ids outside [0, {len(sizes)}) (sizes has {len(sizes)})")
    doc_sizes = np.asarray(sizes, dtype=np.int64)[doc_idx]
    doc_end = np.cumsum(doc_sizes)  # token position just past each document
    if not doc_end.size or doc_end[-1] < num_samples * seq_length + 1:
        raise ValueError("doc_idx holds fewer than num_epochs * tokens_per_epoch tokens")
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(doc_end, positions, side="right")  # first document ending after it
    dtype = np.int64 if len(doc_idx) >= _INT32_LIMIT else np.int32
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0] = where
    out[:, 1] = positions - (doc_end[where] - doc_sizes[where])
    out[0] = 0
    return out


def _as_tensor(array: np.ndarray, dtype=None) -> torch.Tensor:
    """A CPU tensor sharing ``array``'s memory when it is writable and contiguous (else a copy)."""
    array = np.asarray(array, dtype=dtype)
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(array, copy=True)
    return torch.from_numpy(array)


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """``gpt2forge::build_sample_idx`` when the custom ops library is built, else the numpy reference
    (``load_custom_ops`` prints the one-line notice). Same arguments, result and errors."""
    if load_custom_ops():
        try:
            out = torch.ops.gpt2forge.build_sample_idx(_as_tensor(sizes, np.int32), _as_tensor(doc_idx),
                                                       seq_length, num_epochs, tokens_per_epoch)
        except (ValueError, RuntimeError) as exc:  # keep the first line: the C++ check's message
            raise ValueError(str(exc).splitlines()[0]) from None
        return out.numpy()
    return build_sample_idx_reference(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def cache_paths(prefix: str, name: str, first: int, end: int, sizes: np.ndarray, num_samples: int,
                seq_length: int, seed: int) -> dict[str, Path]:
    """The three cache files of one index build; the name encodes every input of their content."""
    digest = hashlib.blake2b(np.ascontiguousarray(sizes[first:end]).tobytes(), digest_size=6).hexdigest()
    stem = (f"{prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{first}-{end}doc_"
            f"{digest}")
    return {m: Path(f"{stem}_{m}.npy") for m in MAPS}


def build_index_maps(paths: dict[str, Path], sizes: np.ndarray, first: int, end: int,
                     num_samples: int, seq_length: int, seed: int) -> None:
    """Megatron's ``_build_index_mappings`` for documents ``[first, end)``; writes the three files."""
    documents = np.arange(first, end, dtype=np.int64)
    tokens_per_epoch = int(sizes[first:end].sum(dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate_last = False
    if num_epochs > 1:
        from_earlier = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        # Less than 80% of the last epoch used: shuffle it apart so its samples are not mixed
        # (under-sampled) into the earlier epochs (Megatron's rule).
        separate_last = num_samples - from_earlier < int(0.80 * per_epoch)
    doc_idx = build_doc_idx(documents, num_epochs, rng, separate_last)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    first_part = from_earlier if separate_last else sample_idx.shape[0] - 1
    shuffle_idx = build_shuffle_idx(first_part, sample_idx.shape[0] - 1, rng)
    for name, array in zip(MAPS, (doc_idx, sample_idx, shuffle_idx)):
        save_npy_atomic(paths[name], array)


def _load_maps(paths: dict[str, Path], num_samples: int) -> tuple[np.ndarray, ...] | None:
    """The cached maps (memory-mapped) if all three are present and fit together, else None."""
    if not all(p.is_file() for p in paths.values()):
        return None
    try:
        doc_idx, sample_idx, shuffle_idx = (np.load(paths[m], mmap_mode="r", allow_pickle=False)
                                            for m in MAPS)
    except (OSError, ValueError):
        return None
    fits = (sample_idx.ndim == 2 and sample_idx.shape[1] == 2 and sample_idx.shape[0] > num_samples
            and shuffle_idx.shape == (sample_idx.shape[0] - 1,) and doc_idx.ndim == 1)
    return (doc_idx, sample_idx, shuffle_idx) if fits else None


class GPTDataset(torch.utils.data.Dataset):
    """Megatron GPT samples of one split; item ``i`` is ``seq_length + 1`` int64 tokens.

    ``len()`` is the samples of one pass over the split (``epoch_samples``); ``num_samples`` is what
    was asked for, and every sample of the epochs that takes (``built``) is valid, as in Megatron.
    ``epoch_indices(e, n)`` says which ones epoch ``e`` reads: the next ``n`` in order, as Megatron
    consumes its already shuffled index.
    """

    def __init__(self, data: IndexedDataset, paths: dict[str, Path], num_samples: int,
                 epoch_samples: int, seq_length: int, maps: tuple[np.ndarray, ...]) -> None:
        self.data = data
        self.paths = paths
        self.num_samples = num_samples
        self.epoch_samples = epoch_samples
        self.seq_length = seq_length
        self.doc_idx, self.sample_idx, self.shuffle_idx = maps
        self.built = len(self.shuffle_idx)

    def __len__(self) -> int:
        return self.epoch_samples

    def epoch_indices(self, epoch: int, count: int) -> torch.Tensor:
        """Indices of the ``count`` samples epoch ``epoch`` reads (1-D int64): ``[epoch * count,
        (epoch + 1) * count)``. A run of ``num_samples`` stops inside its last epoch, so indices past
        the built samples are never trained on (only prefetched): they wrap to the start."""
        start = epoch * count
        if start >= self.built:
            raise UsageError(f"epoch {epoch} starts at sample {start} but the index maps of {self.data.prefix} "
                             f"hold {self.built}; the run outgrew the maps it was started with (keep "
                             "--epochs/--training-steps/--train-samples when resuming)")
        return torch.arange(start, start + count) % self.built

    def __getitem__(self, index: int) -> torch.Tensor:
        i = int(self.shuffle_idx[index])
        (doc_f, off_f), (doc_l, off_l) = self.sample_idx[i].tolist(), self.sample_idx[i + 1].tolist()
        if doc_f == doc_l:
            tokens = self.data.get(int(self.doc_idx[doc_f]), off_f, off_l - off_f + 1)
        else:
            parts = [self.data.get(int(self.doc_idx[doc_f]), off_f)]
            parts += [self.data.get(int(self.doc_idx[j])) for j in range(doc_f + 1, doc_l)]
            parts.append(self.data.get(int(self.doc_idx[doc_l]), 0, off_l + 1))
            tokens = np.concatenate(parts)
        assert len(tokens) == self.seq_length + 1, "sample_idx rows must span seq_length + 1 tokens"
        return torch.from_numpy(tokens.astype(np.int64))

    # Workers re-open the files by name: a memmap would otherwise be pickled as a full copy.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for m in MAPS:
            state.pop(m)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            np.load(self.paths[m], mmap_mode="r", allow_pickle=False) for m in MAPS)


def epoch_samples_of(data: IndexedDataset, first: int, end: int, seq_length: int) -> int:
    """Samples of one pass over documents ``[first, end)`` (Megatron drops the last partial one)."""
    return max(int(data.sizes[first:end].sum(dtype=np.int64)) - 1, 0) // seq_length


def pass_account(split: str, source: str, data: IndexedDataset, first: int, end: int, seq_length: int) -> DataAccount:
    """What one pass over documents ``[first, end)`` keeps: ``epoch_samples_of`` samples of ``seq_length + 1``
    tokens, consecutive ones sharing one, so ``n * seq_length + 1`` tokens; the rest, fewer than a sample,
    is dropped at the end of the pass (which documents end it, the shuffle decides)."""
    sizes = data.sizes[first:end]
    tokens, n = int(sizes.sum(dtype=np.int64)), epoch_samples_of(data, first, end, seq_length)
    if n:
        drop = Drop("after the last full sample of a pass (samples cross documents, Megatron's cut)",
                    tokens - (n * seq_length + 1))
    else:
        drop = Drop(f"in fewer tokens than one sample of --max-len {seq_length} + 1", tokens, int((sizes > 0).sum()),
                    whole=True)
    return DataAccount(split, source, end - first, tokens, n, "samples", tokens - drop.tokens, drops=(drop,))


def gpt_dataset(data: IndexedDataset, name: str, first: int, end: int, num_samples: int | None,
                seq_length: int, seed: int) -> GPTDataset | None:
    """Megatron's GPTDataset of documents ``[first, end)`` asked for ``num_samples`` (None: one
    epoch), maps built or reused. Returns None when the range holds no sample."""
    epoch_samples = epoch_samples_of(data, first, end, seq_length)
    if epoch_samples == 0:
        return None
    num_samples = epoch_samples if num_samples is None else num_samples
    paths = cache_paths(data.prefix, name, first, end, data.sizes, num_samples, seq_length, seed)
    maps = _load_maps(paths, num_samples)
    if maps is None:
        t0 = time.perf_counter()
        try:
            build_index_maps(paths, data.sizes, first, end, num_samples, seq_length, seed)
        except OSError as exc:
            raise UsageError(f"cannot write the index maps next to {data.prefix} ({exc.strerror}: "
                             f"{exc.filename}); make that folder writable") from None
        maps = _load_maps(paths, num_samples)
        assert maps is not None, "freshly written index maps must load"
        log.info(f"mmap {name}: built index maps for {num_samples} samples in "
                 f"{time.perf_counter() - t0:.2f} s ({paths['doc_idx'].name[:-12]}*)")
    else:
        log.info(f"mmap {name}: reusing index maps {paths['doc_idx'].name[:-12]}*")
    return GPTDataset(data, paths, num_samples, epoch_samples, seq_length, maps)


def blended_split(name: str, blend: Blend, ranges: dict[str, tuple[int, int]],
                  corpora: dict[str, IndexedDataset], size: int | None, epochs: int, seq_length: int,
                  seed: int) -> BlendedDataset | None:
    """Megatron-Core's BlendedDataset of one split over several corpora (module doc of ``blend``).

    ``size`` None: ``epochs`` passes over every corpus (bare prefixes, one pass: each sample once).
    Corpora of a validation or test split without a sample are left out with a notice.
    """
    prefixes, weights = list(blend.prefixes), blend.weights
    per_epoch = [epoch_samples_of(corpora[p], *ranges[p], seq_length) for p in prefixes]
    empty = [p for p, n in zip(prefixes, per_epoch) if n == 0]
    if empty and name == "train":
        raise UsageError(f"{empty[0]}: its training split (documents [{ranges[empty[0]][0]}, "
                         f"{ranges[empty[0]][1]})) holds less than one sample of --max-len {seq_length} + 1; "
                         "add data, give train a larger --split share, lower --max-len or drop that corpus")
    for p in empty if len(empty) < len(prefixes) else ():
        log.notice(f"mmap {name}: {p} holds less than one {name} sample; left out of the {name} blend")
    keep = [i for i, n in enumerate(per_epoch) if n > 0]
    if not keep:
        return None
    prefixes, per_epoch = [prefixes[i] for i in keep], [per_epoch[i] for i in keep]
    weights = None if weights is None else [weights[i] for i in keep]
    total = sum(per_epoch)
    if weights is None and (size is None and epochs == 1 or size is not None and size <= total):
        # Bare prefixes: one epoch each, blended in proportion to their sizes (Megatron's case 3c/3d).
        asked = [None] * len(prefixes)
        order_weights = None if size is None else normalize(per_epoch)
        size = total if size is None else size
    else:
        weights = normalize(per_epoch if weights is None else weights)
        size = epochs * total if size is None else size
        asked = corpus_sizes(weights, size, SURPLUS)
        size = sum(corpus_sizes(weights, size))
        order_weights = normalize(weights)  # BlendedDataset normalizes the builder's weights again
    datasets = [gpt_dataset(corpora[p], name, *ranges[p], n, seq_length, seed) for p, n in zip(prefixes, asked)]
    paths = blend_cache_paths(prefixes[0], name, order_weights, per_epoch, size)
    arrays = load_blend_order(paths, order_weights, per_epoch, size)
    shares = normalize(per_epoch) if weights is None else weights
    result = BlendedDataset(datasets, prefixes, shares, paths, arrays, total)
    result.log_summary(name)
    return result


def load(req: DataRequest, labels: dict[str, str] | None = None) -> DatasetSplit:
    """Reader for ``mmap``: train, valid and test splits of one blend split by ``--split``, or of one
    blend per split (``--train-data-path`` ...), or of one blend split by ``--split`` whose valid or test
    share is replaced by ``--valid-data-path`` / ``--test-data-path`` (``split_blends``). A bare single
    prefix is Megatron's plain GPTDataset. The accounts (``pass_account``) name each prefix by ``labels``
    (``rawtext``: the files it was tokenized from), else ``mmap PREFIX``.

    Raises:
        UsageError: bad blend flags or ``--split``, a missing or corrupt file, token ids outside the
            vocabulary, prefixes made with different tokenizers, a training split too small for one
            sample, or an unwritable data folder.
    """
    blends, whole = split_blends(req)
    prefixes = [p for b in blends if b is not None for p in b.prefixes]
    corpora = open_corpora(prefixes, req.vocab_size, "--train-data-path" if whole[0] else "--input-files/--data-path")
    shared = set() if whole[0] else set(blends[0].prefixes)  # the corpora split by --split
    seq, bounds = req.max_len, {}
    for p, data in corpora.items():
        bounds[p] = split_boundaries(req.data.split, len(data)) if p in shared else [0, len(data), len(data), len(data)]
        where = "" if p not in shared else f"; --split {req.data.split}: " + ", ".join(
            f"{n} [{bounds[p][k]}, {bounds[p][k + 1]})" for k, n in enumerate(SPLIT_NAMES) if not whole[k])
        log.info(f"mmap {p}: {len(data)} documents, {data.num_tokens} tokens ({data.dtype}){where}")
    samples, epochs = train_target(req)
    out: list[torch.utils.data.Dataset | None] = []
    accounts = []
    for k, name in enumerate(SPLIT_NAMES):
        blend = blends[k]
        if blend is None:
            out.append(None)
            continue
        ranges = {p: (0, len(corpora[p])) if whole[k] else (bounds[p][k], bounds[p][k + 1]) for p in blend.prefixes}
        accounts += [pass_account(name, (labels or {}).get(p, f"mmap {p}"), corpora[p], *ranges[p], seq)
                     for p in blend.prefixes if ranges[p][1] > ranges[p][0] or name == "train"]
        size, passes = (samples, epochs) if name == "train" else (None, 1)
        if len(blend.prefixes) == 1 and (whole[k] or blend.weights is None):
            p = blend.prefixes[0]
            asked = size if size is not None else passes * epoch_samples_of(corpora[p], *ranges[p], seq)
            out.append(gpt_dataset(corpora[p], name, *ranges[p], asked or None, seq, req.data.seed))
        else:
            out.append(blended_split(name, blend, ranges, corpora, size, passes, seq, req.data.seed))
    if out[0] is None:
        p = blends[0].prefixes[0]
        first, end = bounds[p][0], bounds[p][1]
        tokens = int(corpora[p].sizes[first:end].sum(dtype=np.int64))
        raise UsageError(f"{p}: the training split (documents [{first}, {end}) of --split {req.data.split}) "
                         f"holds {tokens} tokens, fewer than one sample of --max-len {seq} + 1 needs; "
                         "add data, give train a larger --split share or lower --max-len")
    if out[1] is None:
        log.notice(f"mmap: the valid split of --split {req.data.split} holds less than one sample; "
                   "no validation loss will be logged")
    return DatasetSplit(train=out[0], val=out[1], test=out[2], accounts=tuple(accounts))
