"""Weighted blends of corpora, exactly as Megatron-Core 0.19's ``BlendedDataset`` builds them.

``--data-path 0.7 A 0.3 B`` (Megatron's syntax, also ``--input-files`` and the per-split
``--train/valid/test-data-path``) reads as ``parse_blend``: pairs of weight and prefix, or bare
prefixes (no weights), as ``megatron.core.datasets.utils.get_blend_from_list``. Weights are
normalized (``normalize``); a blend of ``size`` samples asks corpus ``i`` for
``ceil(ceil(size * w_i) * 1.005)`` samples (``corpus_sizes``: the blend's target plus Megatron's
``mid_level_dataset_surplus``) and draws ``sum(ceil(size * w_i))`` samples from them.

The order (``blending_indices``): sample ``s`` comes from the corpus whose realized share lags its
weight most, ``argmax_i(w_i * max(s, 1) - count_i)`` (the first on ties), and is that corpus's next
sample; ``dataset_index[s]`` names the corpus, ``dataset_sample_index[s]`` its sample. Megatron's
C++ ``build_blending_indices`` does the same in float64, so the arrays are equal element for element.
Blends of bare prefixes over one epoch use Megatron's ``build_exhaustive_blending_indices``
(``exhaustive_indices``): every sample of every corpus exactly once.

The two arrays are cached next to the first corpus's data as ``PREFIX_{split}_blend_{size}ns_{n}ds_
{weights hash}_{dataset_index,dataset_sample_index}.npy`` (their content depends only on the
weights, the size and the kind of blend, all in the name), written atomically like the GPT index maps.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.data.contract import DataRequest
from gpt2forge.data.indexed import save_npy_atomic
from gpt2forge.ops.library import has_op

SURPLUS = 0.005
"""Megatron-Core's ``mid_level_dataset_surplus``: each corpus builds 0.5% more samples than it is asked."""
BLEND_MAPS = ("dataset_index", "dataset_sample_index")
MAX_CORPORA = 32767
"""A blend's corpus index is int16, as in Megatron."""


@dataclass(frozen=True)
class Blend:
    """Prefixes and their weights as given (None: bare prefixes, weighted by their sizes)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None


def _as_weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _strip_suffix(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        prefix = prefix[: -len(suffix)] if prefix.endswith(suffix) else prefix
    return prefix


def parse_blend(values: Sequence[str], flag: str) -> Blend:
    """Megatron's ``get_blend_from_list`` with its mistakes as one-line errors.

    ``["0.7", "A", "0.3", "B"]`` -> weights (0.7, 0.3); ``["A"]`` or ``["A", "B"]`` -> no weights.

    Raises:
        UsageError: nothing given, a weight not followed by a prefix, weights mixed with bare
            prefixes, a weight that is not a finite positive number, weights summing to zero, or
            more than MAX_CORPORA corpora.
    """
    values = [str(v).strip() for v in values]
    example = f"give {flag} W1 PREFIX1 W2 PREFIX2 ... (or PREFIX alone)"
    if not values:
        raise UsageError(f"{flag}: no data given; {example}")
    numbers = [_as_weight(v) for v in values]
    if len(values) % 2 == 1:
        # Megatron reads an odd count as bare prefixes; a number there is a weight missing its prefix.
        stray = [v for v, w in zip(values, numbers) if w is not None and not Path(f"{v}.idx").exists()]
        if stray:
            raise UsageError(f"{flag}: weight {stray[-1]} is not followed by a prefix "
                             f"({len(values)} values); {example}")
        return _blend(values, None, flag)
    weights, prefixes = numbers[0::2], values[1::2]
    if all(w is None for w in weights):
        return _blend(values, None, flag)
    if any(w is None for w in weights) or any(w is not None for w in numbers[1::2]):
        raise UsageError(f"{flag}: weights and prefixes must alternate ({' '.join(values)}); {example}")
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        raise UsageError(f"{flag}: weight {bad[0]:g} is negative or not finite; weights are relative "
                         "shares >= 0, e.g. 0.7 A 0.3 B")
    if sum(weights) <= 0:
        raise UsageError(f"{flag}: the weights sum to zero; give at least one positive weight")
    if 0 in weights:
        zero = prefixes[weights.index(0)]
        raise UsageError(f"{flag}: weight 0 for {zero}; leave that corpus out instead (Megatron "
                         "refuses zero weights)")
    return _blend(prefixes, tuple(weights), flag)


def _blend(prefixes: Sequence[str], weights: tuple[float, ...] | None, flag: str) -> Blend:
    if len(prefixes) > MAX_CORPORA:
        raise UsageError(f"{flag}: {len(prefixes)} corpora; a blend holds at most {MAX_CORPORA} (Megatron's "
                         "corpus index is int16); give fewer, larger corpora")
    return Blend(tuple(_strip_suffix(p) for p in prefixes), weights)


def split_blends(req: DataRequest) -> tuple[list[Blend | None], tuple[bool, bool, bool]]:
    """The blend of each split, and for each whether it reads its corpora whole rather than its ``--split``
    share: all three with ``--train-data-path`` ...; only the given ones with ``--valid-data-path`` /
    ``--test-data-path`` beside ``--input-files``, whose training data is still split by ``--split``
    (seed 001's Megatron-LM ``--valid-data`` / ``--test-data``)."""
    per_split = (req.data.train_data_path, req.data.valid_data_path, req.data.test_data_path)
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    if req.data.train_data_path:
        if req.data.input_files:
            raise UsageError("--input-files/--data-path and --train-data-path exclude each other (Megatron's too); "
                             "give one blend with --split, or one per split")
        return [parse_blend(p, f) if p else None for p, f in zip(per_split, flags)], (True, True, True)
    if any(per_split) and not req.data.input_files:
        raise UsageError("--valid-data-path/--test-data-path need --train-data-path or --input-files too")
    shared = parse_blend(req.data.input_files or (), "--input-files/--data-path")
    return ([parse_blend(p, f) if p else shared for p, f in zip(per_split, flags)],
            (False, bool(req.data.valid_data_path), bool(req.data.test_data_path)))


def train_target(req: DataRequest) -> tuple[int | None, int]:
    """``(samples, epochs)`` asked of the training split: the samples the run consumes when known
    (Megatron-LM asks for ``train_iters x global_batch``), else whole ``--epochs``."""
    if req.training_steps is not None:
        return req.training_steps * req.samples_per_step, 1
    return None, max(req.epochs, 1)


def normalize(weights: Sequence[float]) -> list[float]:
    """Megatron's ``normalize``: float64 weights divided by their numpy sum."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def corpus_sizes(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Samples asked of each corpus for a blend of ``size`` (``_get_size_per_split_per_dataset``):
    ``ceil(ceil(size * w) * (1 + surplus))`` for normalized weights ``w``."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_blending_indices``: for each sample the corpus that lags its weight most.

    Returns ``(dataset_index int16, dataset_sample_index int64)``, each of ``size``. The C++ op
    ``gpt2forge::build_blending_indices`` (custom_ops/blend_index.cpp) when the library is built,
    else ``blending_indices_reference``: the same arrays.
    """
    if has_op("build_blending_indices"):
        index, sample = torch.ops.gpt2forge.build_blending_indices(torch.tensor(weights, dtype=torch.float64), size)
        return index.numpy(), sample.numpy()
    return blending_indices_reference(weights, size)


def exhaustive_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_exhaustive_blending_indices``: exactly ``sizes[i]`` samples of corpus ``i``,
    interleaved in proportion to the sizes (a corpus leaves the race once it is spent). The C++ op
    when the library is built, else ``exhaustive_indices_reference``."""
    if has_op("build_exhaustive_blending_indices"):
        index, sample = torch.ops.gpt2forge.build_exhaustive_blending_indices(torch.tensor(sizes, dtype=torch.int64))
        return index.numpy(), sample.numpy()
    return exhaustive_indices_reference(sizes)


def blending_indices_reference(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """``blending_indices`` in Python (a loop per sample, far slower than the op: measured in
    docs/data.md), the fallback without the custom ops library and the op's test oracle."""
    w = [float(x) for x in weights]
    n = len(w)
    counts = [0] * n
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    for s in range(size):  # a plain loop: the greedy choice depends on every earlier one
        x = float(max(s, 1))
        best, best_error = 0, w[0] * x - counts[0]
        for i in range(1, n):
            error = w[i] * x - counts[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[s] = best
        sample_index[s] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


def exhaustive_indices_reference(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``exhaustive_indices`` in Python: the fallback without the library and the op's test oracle."""
    total = int(sum(sizes))
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = [i for i, s in enumerate(sizes) if s > 0]
    dataset_index = np.zeros(total, dtype=np.int16)
    sample_index = np.zeros(total, dtype=np.int64)
    for s in range(total):
        x = float(max(s, 1))
        best, best_error = -1, -math.inf
        for i in unspent:  # ascending, as std::set iterates
            error = w[i] * x - counts[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[s] = best
        sample_index[s] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, sample_index


def blend_cache_paths(prefix: str, split: str, weights: Sequence[float] | None, sizes: Sequence[int],
                      size: int) -> dict[str, Path]:
    """Cache files of one blend order; ``weights`` None: the exhaustive order of ``sizes``."""
    key = (np.array(weights, dtype=np.float64).tobytes() if weights is not None
           else b"exhaustive" + np.array(sizes, dtype=np.int64).tobytes())
    digest = hashlib.blake2b(key, digest_size=6).hexdigest()
    stem = f"{prefix}_{split}_blend_{size}ns_{len(sizes)}ds_{digest}"
    return {m: Path(f"{stem}_{m}.npy") for m in BLEND_MAPS}


def load_blend_order(paths: dict[str, Path], weights: Sequence[float] | None, sizes: Sequence[int],
                     size: int) -> tuple[np.ndarray, np.ndarray]:
    """The cached order (memory-mapped) when complete, else built and written atomically."""
    try:
        arrays = tuple(np.load(paths[m], mmap_mode="r", allow_pickle=False) for m in BLEND_MAPS)
        if all(a.shape == (size,) for a in arrays):
            return arrays
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    arrays = blending_indices(weights, size) if weights is not None else exhaustive_indices(sizes)
    try:
        for name, array in zip(BLEND_MAPS, arrays):
            save_npy_atomic(paths[name], array)
    except OSError as exc:
        raise UsageError(f"cannot write the blend index next to the data ({exc.strerror}: {exc.filename}); "
                         "make that folder writable") from None
    log.info(f"blend: built the order of {size} samples in {time.perf_counter() - t0:.2f} s "
             f"({paths['dataset_index'].name[:-18]}*)")
    return arrays


class BlendedDataset(torch.utils.data.Dataset):
    """Samples of several corpora in Megatron's blend order; item ``s`` is
    ``datasets[dataset_index[s]][dataset_sample_index[s]]``.

    ``len()`` is a nominal epoch (``epoch_samples``: one pass over every corpus's split); indices
    up to ``size`` are valid and are read in order across epochs (``epoch_indices``), as Megatron
    reads its blend.
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], names: Sequence[str],
                 weights: Sequence[float], paths: dict[str, Path], arrays: tuple[np.ndarray, np.ndarray],
                 epoch_samples: int) -> None:
        self.datasets = list(datasets)
        self.names = list(names)
        self.weights = list(weights)
        self.paths = paths
        self.dataset_index, self.dataset_sample_index = arrays
        self.size = len(self.dataset_index)
        self.epoch_samples = epoch_samples
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (ds, count) in enumerate(zip(self.datasets, counts)):
            if count > len_built(ds):
                raise UsageError(f"the blend draws {count} samples from {self.names[i]}, which holds "
                                 f"{len_built(ds)}; this is a bug in the sample sizes, please report it")

    def __len__(self) -> int:
        return self.epoch_samples

    def epoch_indices(self, epoch: int, count: int) -> torch.Tensor:
        """Blend positions ``[epoch * count, (epoch + 1) * count)``; positions past the blend (only
        ever prefetched: the run stops at its sample count) wrap to its start."""
        start = epoch * count
        if start >= self.size:
            raise UsageError(f"epoch {epoch} starts at blend sample {start} but the blend holds {self.size}; "
                             "the run outgrew the blend it was started with (keep --epochs/--training-steps/"
                             "--train-samples when resuming)")
        return torch.arange(start, start + count) % self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        d = int(self.dataset_index[index])
        return self.datasets[d][int(self.dataset_sample_index[index])]

    def realized_shares(self, n: int) -> dict[str, float]:
        """Share of each corpus among the first ``n`` samples of the order (name -> fraction)."""
        n = max(1, min(int(n), self.size))
        counts = np.bincount(self.dataset_index[:n], minlength=len(self.datasets))
        return {name: float(c) / n for name, c in zip(self.names, counts)}

    def log_summary(self, split: str) -> None:
        """One line per corpus: weight, samples drawn, realized share of the whole blend."""
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for name, w, c in zip(self.names, self.weights, counts):
            log.info(f"blend {split}: {name}: weight {w:.4f}, samples {int(c)}, share {c / self.size:.4f}")

    # Workers re-open the order by name: a memmap would otherwise be pickled as a full copy.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for m in BLEND_MAPS:
            state.pop(m)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.dataset_index, self.dataset_sample_index = (
            np.load(self.paths[m], mmap_mode="r", allow_pickle=False) for m in BLEND_MAPS)


def len_built(dataset: torch.utils.data.Dataset) -> int:
    """Samples a corpus's dataset can serve (a GPT dataset: every epoch built, not just ``len``)."""
    return int(getattr(dataset, "built", len(dataset)))
