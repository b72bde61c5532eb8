"""Data readers: window rules, item/batch contract, seeded split, generated data, safe unpickling."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.data import (
    DATASETS,
    IGNORE_INDEX,
    DataRequest,
    collate,
    load_datasets,
    split_batch,
)
from gpt2forge.data.args import DataArgs
from gpt2forge.data.generated import GeneratedDataset
from gpt2forge.data.pickled import document_windows
from gpt2forge.data.safe_pickle import safe_load

VOCAB = 1000


def _write(tmp_path, obj, name="docs.pkl", protocol=4) -> str:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=protocol)
    return path


def _docs(lengths: list[int]) -> list[list[int]]:
    """Documents whose tokens are distinct (so windows can be told apart) and inside VOCAB."""
    out, next_id = [], 1
    for n in lengths:
        out.append(list(range(next_id, next_id + n)))
        next_id += n
    return out


def _pickle_req(path, **kw) -> DataRequest:
    """A pickle request for `path` at --max-len 7; `kw` are DataArgs fields."""
    args = dict(dataset="pickle", input_files=[path], seed=0, stride=4)
    args.update(kw)
    return DataRequest(DataArgs(**args), max_len=7, vocab_size=VOCAB)


# ---------------------------------------------------------------- windows


def test_document_windows_exact():
    # max_len 7 -> L = 8, stride 4 (< L, so windows overlap), min length max(7 // 2, 2) = 3.
    lengths = [22, 8, 5, 3, 2, 0, 12]
    windows, dropped = document_windows(np.array(lengths), max_len=7, stride=4)
    expected = [
        (0, 8), (4, 8), (8, 8), (12, 8), (14, 8),  # doc 0 (22 tokens): 4 strided + tail at 22 - 8
        (22, 8),  # doc 1: exactly L tokens -> one window, no tail
        (30, 5),  # doc 2: 5 tokens, whole document (reference kept only its last tokens)
        (35, 3),  # doc 3: 3 = max_len // 2 tokens, whole document
        # doc 4 (2 tokens) and doc 5 (empty) are dropped
        (40, 8), (44, 8),  # doc 6 (12 tokens): 0, 4; window at 4 ends at 12 -> no tail
    ]
    assert [tuple(w) for w in windows.tolist()] == expected
    assert dropped == 2


def test_document_windows_stride_longer_than_window():
    windows, dropped = document_windows(np.array([22]), max_len=7, stride=10)
    assert [tuple(w) for w in windows.tolist()] == [(0, 8), (10, 8), (14, 8)]  # gap, then tail
    assert dropped == 0


def test_items_are_full_length_with_padding(tmp_path):
    docs = _docs([22, 5, 2])
    split = load_datasets(_pickle_req(_write(tmp_path, docs)))
    train = split.train
    assert split.val is None
    items = [train[i] for i in range(len(train))]
    assert all(x.dtype == torch.int64 and x.shape == (8,) for x in items)
    got = {tuple(x.tolist()) for x in items}
    d0, d1 = docs[0], docs[1]
    expected = {tuple(d0[s : s + 8]) for s in (0, 4, 8, 12, 14)}
    expected.add(tuple(d1 + [IGNORE_INDEX] * 3))  # whole short document, padded at the end
    assert got == expected
    account = split.accounts[0]
    assert (account.documents, account.dropped_documents, account.tokens) == (3, 1, 29)


def test_numpy_documents_and_scalars_accepted(tmp_path):
    docs = [np.arange(1, 9, dtype=np.int32), np.arange(20, 28, dtype=np.uint16), [np.int64(5)] * 8]
    for protocol in (2, 4, 5):
        path = _write(tmp_path, docs, name=f"p{protocol}.pkl", protocol=protocol)
        train = load_datasets(_pickle_req(path)).train
        got = {tuple(train[i].tolist()) for i in range(len(train))}
        assert got == {tuple(range(1, 9)), tuple(range(20, 28)), (5,) * 8}


# ---------------------------------------------------------------- batches


def test_collate_and_split_batch():
    a = torch.tensor([5, 6, 7, 8, 9])
    b = torch.tensor([1, 2, 3, IGNORE_INDEX, IGNORE_INDEX])
    batch = collate([a, b])
    assert batch.shape == (2, 5) and batch.dtype == torch.int64
    input_ids, labels = split_batch(batch)
    assert input_ids.shape == labels.shape == (2, 4)
    assert input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 0]]  # padded input -> 0
    assert labels.tolist() == [[6, 7, 8, 9], [2, 3, IGNORE_INDEX, IGNORE_INDEX]]  # skipped by loss
    with pytest.raises(ValueError):
        collate([a, b[:4]])


def test_dataloader_end_to_end(tmp_path):
    split = load_datasets(_pickle_req(_write(tmp_path, _docs([40, 30])), val_num=2))
    loader = torch.utils.data.DataLoader(split.train, batch_size=3, collate_fn=collate, drop_last=True)
    input_ids, labels = split_batch(next(iter(loader)))
    assert input_ids.shape == labels.shape == (3, 7)


# ---------------------------------------------------------------- shuffle and validation split


def _window_rows(ds) -> list[tuple[int, int]]:
    return [tuple(r) for r in ds.windows.tolist()]


def test_seeded_shuffle_and_val_split(tmp_path):
    path = _write(tmp_path, _docs([200, 150, 5]))
    a = load_datasets(_pickle_req(path, seed=3, val_num=5))
    b = load_datasets(_pickle_req(path, seed=3, val_num=5))
    c = load_datasets(_pickle_req(path, seed=4, val_num=5))
    assert _window_rows(a.train) == _window_rows(b.train)
    assert _window_rows(a.val) == _window_rows(b.val)
    assert _window_rows(a.train) != _window_rows(c.train)
    assert len(a.val) == 5
    train, val = set(_window_rows(a.train)), set(_window_rows(a.val))
    assert not train & val
    all_windows, _ = document_windows(np.array([200, 150, 5]), max_len=7, stride=4)
    assert train | val == {tuple(w) for w in all_windows.tolist()}
    assert len(a.train) + len(a.val) == len(all_windows)


def test_val_num_and_stride_errors(tmp_path):
    path = _write(tmp_path, _docs([22]))  # 5 windows
    with pytest.raises(UsageError, match="--val-num"):
        load_datasets(_pickle_req(path, val_num=5))
    assert len(load_datasets(_pickle_req(path, val_num=4)).train) == 1
    with pytest.raises(UsageError, match="--stride"):
        load_datasets(_pickle_req(path, stride=0))


def test_packed_and_random_windows_hold_out_the_same_validation(tmp_path):
    docs = _docs([200, 150, 5, 60])
    path = _write(tmp_path, docs)
    split = {w: load_datasets(_pickle_req(path, seed=3, val_num=5, windows=w))
             for w in ("document", "packed", "random")}
    val = [torch.stack([s.val[i] for i in range(len(s.val))]) for s in split.values()]
    assert torch.equal(val[0], val[1]) and torch.equal(val[0], val[2])
    held_out = set(val[0][val[0] != IGNORE_INDEX].tolist())  # token ids are distinct across the corpus
    stream = [t for d in docs for t in d if t not in held_out]  # documents end to end, held-out tokens cut

    packed = split["packed"].train
    assert len(packed) == (len(stream) - 8) // 4 + 1
    for i in (0, 1, len(packed) - 1):  # stride 4, windows of max_len + 1 = 8, crossing documents
        assert packed[i].tolist() == stream[4 * i : 4 * i + 8]
    assert not held_out & {t for i in range(len(packed)) for t in packed[i].tolist()}

    random_windows = split["random"].train
    assert len(random_windows) == len(packed)
    starts = random_windows.epoch_indices(0, 50)
    assert torch.equal(starts, random_windows.epoch_indices(0, 50))  # seeded: a resume draws the same
    assert not torch.equal(starts, random_windows.epoch_indices(1, 50))
    assert int(starts.min()) >= 0 and int(starts.max()) <= len(stream) - 8
    assert random_windows[int(starts[0])].tolist() == stream[int(starts[0]) : int(starts[0]) + 8]


def test_windows_choice_is_checked():
    with pytest.raises(UsageError, match="--windows stream is not one of document, packed, random"):
        _pickle_req("x.pkl", windows="stream")


def test_input_files_must_be_one_pkl(tmp_path):
    path = _write(tmp_path, _docs([22]))
    for files in ([], [path, path], [str(tmp_path / "docs.txt")]):
        with pytest.raises(UsageError, match="--input-files"):
            load_datasets(_pickle_req(path, input_files=files))


# ---------------------------------------------------------------- generated


def test_generated_deterministic_in_range():
    req = DataRequest(DataArgs(dataset="generated", seed=7), max_len=63, vocab_size=5, samples_per_step=3)
    train = load_datasets(req).train
    assert load_datasets(req).val is None
    assert len(train) == 12
    other = load_datasets(req).train
    x = train[5]
    assert x.shape == (64,) and x.dtype == torch.int64
    assert torch.equal(x, train[5]) and torch.equal(x, other[5])
    assert torch.equal(train[-1], train[11])
    assert not torch.equal(train[4], train[5])
    assert not torch.equal(x, GeneratedDataset(12, 64, 5, seed=8)[5])
    values = torch.cat([train[i] for i in range(len(train))])
    assert values.min() == 1 and values.max() == 4  # [1, vocab): 0 and vocab never drawn
    with pytest.raises(IndexError):
        train[12]


# ---------------------------------------------------------------- restricted unpickler


class _RunsCommand:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


class _Custom:
    pass


def test_os_system_payload_refused_and_not_run(tmp_path):
    control, target = tmp_path / "control", tmp_path / "pwned"
    # The payload is real: a plain pickle.load would run it.
    pickle.loads(pickle.dumps(_RunsCommand(str(control))))
    assert control.exists()
    path = _write(tmp_path, [[1, 2, 3], _RunsCommand(str(target))])
    with pytest.raises(UsageError, match="system") as exc:
        load_datasets(_pickle_req(path))
    assert path in str(exc.value) and "\n" not in str(exc.value)
    assert not target.exists()


@pytest.mark.parametrize(
    "payload, name",
    [(_Custom(), "test_datasets._Custom"), ([eval], "builtins.eval"), (complex(1, 2), "builtins.complex")],
)
def test_other_globals_refused(tmp_path, payload, name):
    path = _write(tmp_path, [[1, 2, 3], payload])
    with pytest.raises(UsageError, match=f"{name}, which was refused") as exc:
        safe_load(path)
    assert path in str(exc.value)


@pytest.mark.parametrize("value", [np.ones(3), np.float32(1.5), np.array([1, 2], dtype=object)])
def test_safe_load_builds_only_integer_numpy(tmp_path, value):
    path = _write(tmp_path, [value])
    with pytest.raises(UsageError, match="dtype"):
        safe_load(path)
    ok = _write(tmp_path, [np.arange(3, dtype=np.int16), np.uint32(7)], name="ok.pkl", protocol=5)
    loaded = safe_load(ok)
    assert loaded[0].tolist() == [0, 1, 2] and loaded[1] == 7


@pytest.mark.parametrize(
    "docs, message",
    [
        ([np.ones(8)], "float64"),
        ([np.array([1, 2], dtype=object)], "object"),
        ([[1.5] * 8], "document 0"),
        ([list(range(8)), "some text"], "document 1"),
        ([[[1, 2], [3, 4]]], "document 0"),
        ({"doc": [1, 2]}, "list of documents"),
        ([], "no documents"),
    ],
)
def test_bad_structure_refused(tmp_path, docs, message):
    path = _write(tmp_path, docs)
    with pytest.raises(UsageError, match=message) as exc:
        load_datasets(_pickle_req(path))
    assert path in str(exc.value)


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_token_ids_outside_vocab_refused(tmp_path, bad):
    path = _write(tmp_path, [list(range(1, 9)), [1, 2, bad, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(UsageError) as exc:
        load_datasets(_pickle_req(path))
    msg = str(exc.value)
    assert path in msg and f"token id {bad}" in msg and str(VOCAB) in msg and "tokenizer" in msg


def test_missing_empty_garbage_files(tmp_path):
    missing = str(tmp_path / "missing.pkl")
    empty = tmp_path / "empty.pkl"
    empty.write_bytes(b"")
    text = tmp_path / "text.pkl"
    text.write_text("one article per line\n")
    truncated = tmp_path / "truncated.pkl"
    truncated.write_bytes(pickle.dumps(_docs([50, 50]), protocol=4)[:40])
    cases = [(missing, "not found"), (empty, "empty"), (text, "not a pickle"), (truncated, "corrupt")]
    for path, message in cases:
        with pytest.raises(UsageError, match=message) as exc:
            load_datasets(_pickle_req(str(path)))
        msg = str(exc.value)
        assert str(path) in msg and "wikipedia_preprocess.py" in msg and "\n" not in msg


def test_unknown_dataset_lists_choices():
    with pytest.raises(UsageError, match="--dataset nope is unknown; choose one of generated, pickle"):
        load_datasets(DataRequest(DataArgs(dataset="nope", seed=0), max_len=8, vocab_size=VOCAB))
    assert set(DATASETS) == {"generated", "pickle", "mmap", "tfrecord", "jsonl", "text", "hf"}
