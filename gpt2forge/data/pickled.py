"""``--dataset pickle``: documents of token ids from ``data/wikipedia_preprocess.py``, cut into windows.

File format: ``pickle.dump(documents)`` where ``documents`` is a list and each document is a list of
int token ids (or a 1-D numpy integer array). It is read with the restricted unpickler in
``safe_pickle``: a pickle cannot run code here.

Windows (``L = max_len + 1`` tokens each), per document of ``n`` tokens:

- ``doc[s : s + L]`` for ``s = 0, stride, 2 * stride, ...`` while ``s + L <= n``;
- if ``n >= L`` and the last of those did not end at ``n``: a tail window ``doc[n - L :]``;
- if ``max(max_len // 2, 2) <= n < L``: one window holding the whole document, padded to ``L``
  with ``IGNORE_INDEX`` (the reference kept only the document's last ``max_len - n`` tokens);
- shorter documents are dropped and counted (``num_dropped_documents``).

``--windows`` chooses how training windows are drawn (validation is always the first ``--val-num``
of the shuffled document windows above, so every choice is scored on the same held-out tokens):

- ``document`` (the reference's): the document windows above, shuffled each epoch;
- ``packed``: the documents end to end (each ends with its ``<|endoftext|>``) minus the held-out
  windows' tokens, cut at fixed ``--stride`` steps into windows that cross documents, as Megatron
  cuts its samples; shuffled each epoch;
- ``random``: each epoch draws as many windows as ``packed`` makes, each at a start drawn uniformly
  from that stream, seeded by ``(--seed, epoch)`` (nanoGPT's ``get_batch``).

Fixes to the reference: every item is ``max_len + 1`` long so the model sees ``max_len`` positions
(the reference cut ``max_len``), the window shuffle is seeded by ``--seed`` (reference: unseeded),
and short documents keep all their tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data.contract import DataRequest, DatasetSplit
from gpt2forge.data.safe_pickle import safe_load

RECREATE = (
    "python data/wikipedia_preprocess.py --input-file-path <wikiextractor output dir> "
    "--output-file-path <output dir>"
)
"""The command that writes a pickle this reader accepts (named in every file error)."""


class WindowDataset(torch.utils.data.Dataset):
    """Windows into one flat token tensor; items are materialized on access.

    Attributes:
        tokens: 1-D int32/int64 tensor, all documents of the file concatenated.
        windows: ``(N, 2)`` int64 tensor of ``(start, length)`` into ``tokens``, ``1 <= length <= L``.
        sample_len: ``L = max_len + 1``, the length of every item.
        num_documents: documents in the file.
        num_dropped_documents: documents too short to make a window.
        num_tokens: tokens in the file (all documents, dropped ones included).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        windows: torch.Tensor,
        sample_len: int,
        num_documents: int,
        num_dropped_documents: int,
    ) -> None:
        assert windows.dim() == 2 and windows.shape[1] == 2, "windows must be (N, 2)"
        self.tokens = tokens
        self.windows = windows
        self.sample_len = sample_len
        self.num_documents = num_documents
        self.num_dropped_documents = num_dropped_documents
        self.num_tokens = int(tokens.numel())

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        start, length = self.windows[index].tolist()
        item = torch.full((self.sample_len,), IGNORE_INDEX, dtype=torch.int64)  # (L,)
        item[:length] = self.tokens[start : start + length]
        return item


class StreamWindows(torch.utils.data.Dataset):
    """``--windows packed``: item ``i`` is ``stream[i * stride : i * stride + L]`` (no padding).

    Attributes as ``WindowDataset``'s; ``stream`` is the 1-D token tensor the windows cut.
    """

    def __init__(self, stream: torch.Tensor, sample_len: int, stride: int, num_documents: int,
                 num_dropped_documents: int, num_tokens: int) -> None:
        if stream.numel() < sample_len:
            raise ValueError(f"a stream of {stream.numel()} tokens is shorter than one window ({sample_len})")
        self.stream = stream
        self.sample_len = sample_len
        self.stride = stride
        self.num_documents = num_documents
        self.num_dropped_documents = num_dropped_documents
        self.num_tokens = num_tokens

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
        documents too short for any window.
    """
    L = max_len + 1
    min_len = max(max_len // 2, 2)  # a window needs 2 tokens for one (input, label) pair
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


def load(req: DataRequest) -> DatasetSplit:
    """Reader for ``pickle``: windows of the one ``.pkl`` in ``--input-files``, shuffled by ``--seed``.

    The first ``--val-num`` shuffled windows form ``val`` (None when ``val_num == 0``); the rest
    form ``train``. Both share one token tensor and carry the file's document/token counts.

    Raises:
        UsageError: bad ``--input-files``/``--stride``/``--val-num``, or a bad file (see ``read_documents``).
    """
    path = _check_files(req.input_files)
    if req.stride < 1:
        raise UsageError(f"--stride {req.stride} must be >= 1 (tokens between window starts)")
    docs = read_documents(path, req.vocab_size)
    lengths = np.array([d.size for d in docs], dtype=np.int64)
    # Ids were range-checked, so the direct (unsafe) cast cannot wrap; int32 halves the memory.
    store = np.int32 if req.vocab_size <= np.iinfo(np.int32).max + 1 else np.int64
    tokens = torch.from_numpy(np.concatenate(docs, dtype=store, casting="unsafe"))
    del docs

    windows, dropped = document_windows(lengths, req.max_len, req.stride)
    n = windows.shape[0]
    if n == 0:
        raise UsageError(
            f"{path}: no document has the {max(req.max_len // 2, 2)} tokens needed for a window at "
            f"--max-len {req.max_len}; lower --max-len or use a corpus with longer documents"
        )
    if req.val_num >= n:
        raise UsageError(
            f"--val-num {req.val_num} leaves no training windows ({path} makes {n} at --max-len "
            f"{req.max_len} --stride {req.stride}); choose --val-num below {n}"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(req.seed))
    shuffled = torch.from_numpy(windows)[perm]  # (N, 2)

    def part(rows: torch.Tensor) -> WindowDataset:
        return WindowDataset(tokens, rows, req.max_len + 1, len(lengths), dropped)

    val_rows = shuffled[: req.val_num]
    val = part(val_rows) if req.val_num else None
    if req.windows == "document":
        return DatasetSplit(train=part(shuffled[req.val_num :]), val=val)
    return DatasetSplit(train=_stream_windows(req, tokens, val_rows, len(lengths)), val=val)


def _stream_windows(req: DataRequest, tokens: torch.Tensor, held_out: torch.Tensor,
                    num_documents: int) -> StreamWindows:
    """``packed`` / ``random`` training windows over every token outside the held-out windows."""
    keep = torch.ones(tokens.numel(), dtype=torch.bool)
    for start, length in held_out.tolist():
        keep[start : start + length] = False
    stream = tokens[keep]
    L = req.max_len + 1
    if stream.numel() < L:
        raise UsageError(
            f"{req.input_files[0]}: {stream.numel()} tokens are left outside the --val-num {req.val_num} "
            f"held-out windows, fewer than one window ({L}); lower --val-num or --max-len"
        )
    args = (stream, L, req.stride, num_documents, 0, int(tokens.numel()))
    if req.windows == "random":
        return RandomStreamWindows(*args, seed=req.seed)
    return StreamWindows(*args)
