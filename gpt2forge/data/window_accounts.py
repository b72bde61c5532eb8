"""The pickle reader's accounts (``DataAccount``): which documents and tokens its windows hold, and
which they drop, and why.

Windows are ``(start, length)`` rows into the documents laid end to end; ``per_document`` says how
many tokens of each document the union of some rows holds, each token counted once however many
windows overlap it. Every account below is built from it, so each token of the file is counted
exactly once: kept, or dropped for one reason.
"""

from __future__ import annotations

import numpy as np

from gpt2forge.data.contract import DataAccount, DataRequest, Drop


def merged(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of ``(start, length)`` rows as disjoint intervals ``[a, b)``, sorted (two 1-D int64)."""
    if not len(rows):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    starts, ends = rows[:, 0].astype(np.int64), (rows[:, 0] + rows[:, 1]).astype(np.int64)
    reach = np.maximum.accumulate(ends)
    first = np.flatnonzero(np.concatenate([[True], starts[1:] > reach[:-1]]))  # rows that open an interval
    last = np.concatenate([first[1:], [len(rows)]]) - 1
    return starts[first], reach[last]


def tokens_before(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each position in ``x``: tokens of the disjoint sorted intervals ``[a, b)`` before it."""
    if not len(a):
        return np.zeros(len(x), np.int64)
    sizes = b - a
    done = np.concatenate([[0], np.cumsum(sizes)])
    k = np.searchsorted(a, x, side="right")  # intervals starting at or before x; all but the last end before it
    last = np.maximum(k - 1, 0)
    return done[last] + np.where(k > 0, np.minimum(x - a[last], sizes[last]), 0)


def per_document(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Tokens of each document that the union of ``rows`` holds (int64, one per document)."""
    a, b = merged(np.asarray(rows, dtype=np.int64).reshape(-1, 2))
    ends = np.cumsum(lengths)
    bounds = tokens_before(np.concatenate([[0], ends]), a, b)
    return np.diff(bounds)


def document_account(source: str, req: DataRequest, lengths: np.ndarray, min_len: int, windows: np.ndarray,
                     train_rows: np.ndarray) -> DataAccount:
    """``--windows document``: training windows ``train_rows`` of all document windows ``windows``."""
    in_windows, in_train = per_document(windows, lengths), per_document(train_rows, lengths)
    short = lengths < min_len
    drops = (
        Drop(f"shorter than {min_len} tokens (--windows packed keeps them)", int(lengths[short].sum()),
             int(short.sum()), whole=True),
        Drop(f"between windows (--stride {req.data.stride} > --max-len {req.max_len} + 1)",
             int((lengths - in_windows)[~short].sum())),
        Drop(f"held out for validation (--val-num {req.data.val_num})", int((in_windows - in_train).sum()),
             int(((in_train == 0) & ~short).sum())),
    )
    return DataAccount("train", source, len(lengths), int(lengths.sum()), len(train_rows), "windows",
                       int(in_train.sum()), int((in_train > 0).sum()), drops)


def stream_account(source: str, req: DataRequest, mode: str, lengths: np.ndarray,
                   held_rows: np.ndarray) -> DataAccount:
    """``--windows packed`` / ``random``: windows of the documents end to end, the held-out tokens cut."""
    L, stride = req.max_len + 1, req.data.stride
    left = lengths - per_document(held_rows, lengths)  # each document's tokens in the stream
    offset = np.cumsum(left) - left  # where each document starts in the stream
    total = int(left.sum())
    n = (total - L) // stride + 1
    held = Drop(f"held out for validation (--val-num {req.data.val_num})", int(lengths.sum()) - total,
                int(((left == 0) & (lengths > 0)).sum()))
    if mode == "random":  # every start is drawn: every stream token can be in a window
        kept_tokens, kept, drops = total, left > 0, (held,)
    else:
        if stride <= L:  # the windows cover [0, end) of the stream
            kept_tokens = (n - 1) * stride + L
            kept, cut = (left > 0) & (offset < kept_tokens), "after the last full window"
        else:  # window i covers [i * stride, i * stride + L): the first that ends past a document's start
            i = np.maximum(-((L - 1 - offset) // stride), 0)
            kept_tokens, kept = n * L, (left > 0) & (i < n) & (i * stride < offset + left)
            cut = f"between and after windows (--stride {stride} > --max-len {req.max_len} + 1)"
        drops = (held, Drop(cut, total - kept_tokens, int(((left > 0) & ~kept).sum())))
    item = "random-start windows" if mode == "random" else "packed windows"
    return DataAccount("train", source, len(lengths), int(lengths.sum()), n, item, kept_tokens, int(kept.sum()),
                       drops)


def held_out_account(source: str, lengths: np.ndarray, val_rows: np.ndarray, packed: bool) -> DataAccount:
    """The held-out windows: what they hold (they drop nothing: their tokens are their input)."""
    held = per_document(val_rows, lengths)
    tokens, documents = int(held.sum()), int((held > 0).sum())
    return DataAccount("valid", source, documents, tokens, len(val_rows), "packed windows" if packed else "windows",
                       tokens, documents)
