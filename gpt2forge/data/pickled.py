"""``--dataset pickle``: documents of token ids from ``data/wikipedia_preprocess.py``, cut into windows.

File format: ``pickle.dump(documents)`` where ``documents`` is a list and each document is a list of
int token ids (or a 1-D numpy integer array). It is read with the restricted unpickler in
``safe_pickle``: a pickle cannot run code here.

Windows (``L = max_len + 1`` tokens each), per document of ``n`` tokens:

- ``doc[s : s + L]`` for ``s = 0, stride, 2 * stride, ...`` while ``s + L <= n``;
- if ``n >= L`` and the last of those did not end at ``n``: a tail window ``doc[n - L :]``;
- if ``max(max_len // 2, 2) <= n < L``: one window holding the whole document, padded to ``L``
  with ``IGNORE_INDEX`` (the reference kept only the document's last ``max_len - n`` tokens);
- shorter documents are dropped, and the start-up line says so (``DataAccount``).

``--windows`` chooses how training windows are drawn:

- ``document`` (the reference's): the document windows above, shuffled each epoch;
- ``packed``: the documents end to end (each ends with its ``<|endoftext|>``) minus the held-out
  windows' tokens, cut at fixed ``--stride`` steps into windows that cross documents, as Megatron
  cuts its samples; shuffled each epoch;
- ``random``: each epoch draws as many windows as ``packed`` makes, each at a start drawn uniformly
  from that stream, seeded by ``(--seed, epoch)`` (nanoGPT's ``get_batch``);
- not given: ``document``, unless the corpus is one of short documents (``choose_windows``: document
  windows would drop more than half of its tokens), which is ``packed``; the start-up line says which.

Held-out windows (``--val-num``) depend on the corpus, never on ``--windows``, so every choice is
scored on the same tokens: the first ``--val-num`` of the shuffled document windows; for a corpus of
short documents (which has few document windows, if any), ``--val-num`` windows of ``L`` tokens cut
from the documents end to end at multiples of ``L``, drawn by ``--seed``. Training windows never hold
a held-out token in that case (document windows overlapping one are held out with it).

Fixes to the reference: every item is ``max_len + 1`` long so the model sees ``max_len`` positions
(the reference cut ``max_len``), the window shuffle is seeded by ``--seed`` (reference: unseeded),
short documents keep all their tokens, and no document is dropped without a word.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data.contract import DataRequest, DatasetSplit
from gpt2forge.data.safe_pickle import safe_load
from gpt2forge.data.window_accounts import document_account, held_out_account, stream_account

RECREATE = (
    "python data/wikipedia_preprocess.py --input-file-path <wikiextractor output dir> "
    "--output-file-path <output dir>"
)
"""The command that writes a pickle this reader accepts (named in every file error)."""
SHORT_SHARE = 0.5
"""A corpus is one of short documents when ``--windows document`` would drop more than this share of
its tokens (documents shorter than ``max_len // 2``). Below it, document windows still train on most
of the corpus and match the held-out document windows best (docs/benchmarks.md, ``--windows``);
above it, most of the corpus would be lost, while ``packed`` keeps every token."""


class WindowDataset(torch.utils.data.Dataset):
    """Windows into one flat token tensor; items are materialized on access.

    Attributes:
        tokens: 1-D int32/int64 tensor, all documents of the file concatenated.
        windows: ``(N, 2)`` int64 tensor of ``(start, length)`` into ``tokens``, ``1 <= length <= L``.
        sample_len: ``L = max_len + 1``, the length of every item.
    """

    def __init__(self, tokens: torch.Tensor, windows: torch.Tensor, sample_len: int) -> None:
        assert windows.dim() == 2 and windows.shape[1] == 2, "windows must be (N, 2)"
        self.tokens = tokens
        self.windows = windows
        self.sample_len = sample_len

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        start, length = self.windows[index].tolist()
        item = torch.full((self.sample_len,), IGNORE_INDEX, dtype=torch.int64)  # (L,)
        item[:length] = self.tokens[start : start + length]
        return item


class StreamWindows(torch.utils.data.Dataset):
    """``--windows packed``: item ``i`` is ``stream[i * stride : i * stride + L]`` (no padding).

    Attributes: ``stream``, the 1-D token tensor the windows cut; ``sample_len`` and ``stride``.
    """

    def __init__(self, stream: torch.Tensor, sample_len: int, stride: int) -> None:
        if stream.numel() < sample_len:
            raise ValueError(f"a stream of {stream.numel()} tokens is shorter than one window ({sample_len})")
        self.stream = stream
        self.sample_len = sample_len
        self.stride = stride

    def __len__(self) -> int:
        return (int(self.stream.numel()) - self.sample_len) // self.stride + 1

    def window_at(self, start: int) -> torch.Tensor:
        return self.stream[start : start + self.sample_len].to(torch.int64)  # (L,)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.window_at(index * self.stride)


class RandomStreamWindows(StreamWindows):
    """``--windows random``: ``len()`` windows per epoch at uniformly drawn starts of the stream.

    The trainer asks ``epoch_indices`` for the epoch's order (the ``EpochOrdered`` hook) and gets
    start offsets, seeded by ``(seed, epoch)`` so a resumed run draws the same windows; ``[start]``
    is the window beginning at that token.
    """

    def __init__(self, *args, seed: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seed = seed

    def epoch_indices(self, epoch: int, count: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        last_start = int(self.stream.numel()) - self.sample_len
        return torch.randint(0, last_start + 1, (count,), generator=generator)

    def __getitem__(self, start: int) -> torch.Tensor:
        return self.window_at(start)


def document_windows(lengths: np.ndarray, max_len: int, stride: int) -> tuple[np.ndarray, int]:
    """Cut documents, laid end to end, into training windows (rules in the module docstring).

    Args:
        lengths: token count of each document, in file order.
        max_len: model sequence length; windows hold at most ``max_len + 1`` tokens.
        stride: tokens between consecutive window starts within a document (>= 1).

    Returns:
        ``(windows, num_dropped)``: ``windows`` is an ``(N, 2)`` int64 array of ``(start, length)``
        into the concatenated documents, in document order then position order; ``num_dropped`` counts
        documents too short for any window (``min_window_tokens``).
    """
    L = max_len + 1
    min_len = min_window_tokens(max_len)
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths  # where each document starts in the concatenation

    long_doc = lengths >= L
    n_full = np.where(long_doc, (lengths - L) // stride + 1, 0)  # full windows per document
    doc_of = np.repeat(np.arange(lengths.size), n_full)
    k = np.arange(int(n_full.sum())) - np.repeat(np.cumsum(n_full) - n_full, n_full)
    full_starts = offsets[doc_of] + k * stride

    has_tail = long_doc & ((n_full - 1) * stride + L < lengths)
    tail_starts = offsets[has_tail] + lengths[has_tail] - L

    short_doc = ~long_doc & (lengths >= min_len)
    starts = np.concatenate([full_starts, tail_starts, offsets[short_doc]])
    sizes = np.concatenate(
        [np.full(full_starts.size + tail_starts.size, L, dtype=np.int64), lengths[short_doc]]
    )
    # Starts are unique and increase through the concatenation, so sorting restores file order.
    order = np.argsort(starts, kind="stable")
    windows = np.stack([starts[order], sizes[order]], axis=1).astype(np.int64)  # (N, 2)
    num_dropped = int((~long_doc & (lengths < min_len)).sum())
    return windows.reshape(-1, 2), num_dropped


def _as_document(doc: object, index: int, path: str) -> np.ndarray:
    """One document as a 1-D integer array, or a UsageError naming the file and the document."""
    if isinstance(doc, np.ndarray):
        arr, what = doc, f"a numpy array of shape {doc.shape} and dtype {doc.dtype}"
    elif isinstance(doc, list):
        if not doc:
            return np.zeros(0, dtype=np.int64)
        try:
            arr = np.asarray(doc)  # one C pass; floats, strings, nesting show up in dtype/ndim
        except (ValueError, TypeError, OverflowError):
            arr = np.asarray([], dtype=object)
        what = "a list that is not a flat list of int token ids"
    else:
        arr, what = None, f"a {type(doc).__name__}"
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise UsageError(
            f"{path}: document {index} is {what}, expected a list of int token ids (or a 1-D "
            f"integer array); re-create the file with `{RECREATE}`"
        )
    return arr


def read_documents(path: str, vocab_size: int) -> list[np.ndarray]:
    """Load and check a token-id pickle: a non-empty list of documents with ids in ``[0, vocab_size)``.

    Raises:
        UsageError: naming ``path`` and the fix, for any unreadable, malformed or out-of-range file.
    """
    obj = safe_load(path, recreate=RECREATE)
    if not isinstance(obj, list):
        raise UsageError(
            f"{path}: holds a {type(obj).__name__}, expected a list of documents; "
            f"re-create it with `{RECREATE}`"
        )
    if not obj:
        raise UsageError(f"{path}: holds no documents; re-create it with `{RECREATE}`")
    docs = [_as_document(doc, i, path) for i, doc in enumerate(obj)]
    for i, arr in enumerate(docs):
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            bad = arr[(arr < 0) | (arr >= vocab_size)][0]
            raise UsageError(
                f"{path}: document {i} has token id {int(bad)} outside the model's vocabulary "
                f"[0, {vocab_size}); re-tokenize with the model's tokenizer ({RECREATE}) "
                "or choose a model with a larger vocabulary"
            )
    return docs


def _check_files(files: tuple[str, ...]) -> str:
    if len(files) != 1 or not files[0].endswith(".pkl"):
        got = " ".join(files) if files else "nothing"
        raise UsageError(f"--input-files must name exactly one .pkl file for --dataset pickle, got {got}")
    return files[0]


def min_window_tokens(max_len: int) -> int:
    """The fewest tokens a document needs for a document window: half a window, and at least 2 (one
    (input, label) pair)."""
    return max(max_len // 2, 2)


def choose_windows(req: DataRequest, lengths: np.ndarray) -> tuple[str, bool]:
    """``(windows, short)``: the training windows to draw, and whether the corpus is one of short
    documents (``--windows document`` would drop more than ``SHORT_SHARE`` of its tokens).

    ``--windows`` given: that. Not given: ``packed`` for short documents, else ``document``.
    """
    short_tokens = int(lengths[lengths < min_window_tokens(req.max_len)].sum())
    short = short_tokens > SHORT_SHARE * int(lengths.sum())
    return req.data.windows or ("packed" if short else "document"), short


def load(req: DataRequest) -> DatasetSplit:
    """Reader for ``pickle``: windows of the one ``.pkl`` in ``--input-files``, shuffled by ``--seed``.

    ``val`` holds the ``--val-num`` held-out windows (None when ``val_num == 0``; module doc), ``train``
    the training windows ``--windows`` draws (``choose_windows`` when not given); both share one token
    tensor. The accounts count what each keeps and drops (``window_accounts``).

    Raises:
        UsageError: bad ``--input-files``/``--stride``/``--val-num``, a bad file (see ``read_documents``),
            or too little text for a window.
    """
    path = _check_files(tuple(req.data.input_files or ()))
    if req.data.stride < 1:
        raise UsageError(f"--stride {req.data.stride} must be >= 1 (tokens between window starts)")
    docs = read_documents(path, req.vocab_size)
    lengths = np.array([d.size for d in docs], dtype=np.int64)
    if not lengths.sum():
        raise UsageError(f"{path}: its {len(docs)} documents hold no tokens; re-create it with `{RECREATE}`")
    # Ids were range-checked, so the direct (unsafe) cast cannot wrap; int32 halves the memory.
    store = np.int32 if req.vocab_size <= np.iinfo(np.int32).max + 1 else np.int64
    tokens = torch.from_numpy(np.concatenate(docs, dtype=store, casting="unsafe"))
    del docs

    windows, _ = document_windows(lengths, req.max_len, req.data.stride)
    mode, short = choose_windows(req, lengths)
    min_len = min_window_tokens(req.max_len)
    if mode == "document" and not len(windows):
        raise UsageError(f"{path}: no document has the {min_len} tokens a --windows document window needs at "
                         f"--max-len {req.max_len}; use --windows packed (windows across documents) or lower "
                         "--max-len")
    perm = torch.randperm(len(windows), generator=torch.Generator().manual_seed(req.data.seed))
    shuffled = torch.from_numpy(windows)[perm]  # (N, 2)
    if short and req.data.val_num:
        val_rows = packed_held_out(req, path, int(lengths.sum()))
        train_rows = shuffled[~overlaps(shuffled, val_rows)]
    else:
        if req.data.val_num and req.data.val_num >= len(windows):
            raise UsageError(
                f"--val-num {req.data.val_num} leaves no training windows ({path} makes {len(windows)} at --max-len "
                f"{req.max_len} --stride {req.data.stride}); choose --val-num below {len(windows)}")
        val_rows, train_rows = shuffled[: req.data.val_num], shuffled[req.data.val_num :]
    L, source = req.max_len + 1, f"pickle {path}"
    val = WindowDataset(tokens, val_rows, L) if req.data.val_num else None
    if mode == "document":
        train = WindowDataset(tokens, train_rows, L)
        account = document_account(source, req, lengths, min_len, windows, train_rows.numpy())
    else:
        train = _stream_windows(req, mode, tokens, val_rows)
        account = stream_account(source, req, mode, lengths, val_rows.numpy())
    if short and req.data.windows is None:
        lost = int(lengths[lengths < min_len].sum())
        account = replace(account, note=f"--windows packed, the default here: --windows document would drop "
                                        f"{lost:,} of the {int(lengths.sum()):,} tokens")
    accounts = (account,) if val is None else (account, held_out_account(source, lengths, val_rows.numpy(), short))
    return DatasetSplit(train=train, val=val, accounts=accounts)


def packed_held_out(req: DataRequest, path: str, total: int) -> torch.Tensor:
    """The held-out windows of a corpus of short documents: ``(val_num, 2)`` rows ``(start, L)``, starts
    drawn by ``--seed`` among the multiples of ``L`` of the documents end to end (so they never overlap)."""
    L = req.max_len + 1
    slots = total // L
    if req.data.val_num >= slots:
        raise UsageError(f"--val-num {req.data.val_num} leaves no training windows ({path}: {total:,} tokens make "
                         f"{slots} held-out windows of --max-len {req.max_len} + 1); choose --val-num below {slots}")
    chosen = torch.randperm(slots, generator=torch.Generator().manual_seed(req.data.seed))[: req.data.val_num]
    return torch.stack([chosen * L, torch.full_like(chosen, L)], dim=1)  # (val_num, 2)


def overlaps(rows: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Which ``(start, length)`` rows share a token with the disjoint ``held`` rows (bool, one per row)."""
    held = held[torch.argsort(held[:, 0])]
    ends = rows[:, 0] + rows[:, 1]
    last = torch.searchsorted(held[:, 0].contiguous(), ends, right=False) - 1  # the last held row starting before
    reach = (held[:, 0] + held[:, 1])[last.clamp(min=0)]
    return (last >= 0) & (reach > rows[:, 0])


def _stream_windows(req: DataRequest, mode: str, tokens: torch.Tensor, held_out: torch.Tensor) -> StreamWindows:
    """``packed`` / ``random`` training windows over every token outside the held-out windows."""
    keep = torch.ones(tokens.numel(), dtype=torch.bool)
    for start, length in held_out.tolist():
        keep[start : start + length] = False
    stream = tokens[keep]
    L = req.max_len + 1
    if stream.numel() < L:
        held = f" left outside the --val-num {req.data.val_num} held-out windows" if req.data.val_num else ""
        raise UsageError(f"{req.data.input_files[0]}: {stream.numel()} tokens{held}, fewer than one window of "
                         f"--max-len {req.max_len} + 1; lower {'--val-num or ' if held else ''}--max-len")
    if mode == "random":
        return RandomStreamWindows(stream, L, req.data.stride, seed=req.data.seed)
    return StreamWindows(stream, L, req.data.stride)
