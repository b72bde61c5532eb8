"""No silent loss of data (issue 53): every reader accounts for each split's documents and tokens, kept or
dropped with the reason, the start-up prints it, a corpus of short documents is packed by default, and
held-out windows of short documents work with packed training."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data import DataRequest, load_datasets
from gpt2forge.data.args import DataArgs
from gpt2forge.data.indexed import IndexedWriter
from gpt2forge.data.pickled import StreamWindows, WindowDataset, choose_windows
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.text.tokenizer import load_tokenizer
from gpt2forge.train.batches import load_data

VOCAB = 1000
GPT2_VOCAB = 50257


def started(capsys, *flags: str, vocab_size: int = VOCAB):
    """The datasets and the start-up output of `load_data`, as a run parses and loads them."""
    data, _, _ = load_data(parse_args([*flags, "--batch-size", "1"]), vocab_size, 1)
    return data, capsys.readouterr().out


def distinct_docs(lengths: list[int]) -> list[list[int]]:
    """Documents whose token ids are all different (so a window's tokens say where they came from)."""
    out, first = [], 1
    for n in lengths:
        out.append(list(range(first, first + n)))
        first += n
    return out


def write_pickle(tmp_path: Path, docs: list[list[int]]) -> str:
    path = tmp_path / "docs.pkl"
    path.write_bytes(pickle.dumps(docs))
    return str(path)


def held_ids(dataset) -> set[int]:
    """Token ids some item of `dataset` holds (every window, or the whole stream of random windows)."""
    if hasattr(dataset, "epoch_indices"):
        return set(dataset.stream.tolist())
    items = torch.stack([dataset[i] for i in range(len(dataset))])
    return set(items[items != IGNORE_INDEX].tolist())


# -- pickle ------------------------------------------------------------------------------------------


def pickle_request(path: str, max_len: int = 7, vocab_size: int = VOCAB, seed: int = 0, **data) -> DataRequest:
    """A pickle request for `path`; `data` are DataArgs fields."""
    return DataRequest(DataArgs(dataset="pickle", input_files=[path], seed=seed, **data), max_len, vocab_size)

LENGTHS = [22, 8, 5, 3, 2, 0, 12, 1, 30]  # --max-len 7: 3 documents under 3 tokens (3 tokens in all)


@pytest.mark.parametrize("windows,stride,val_num", [
    ("document", 4, 0), ("document", 4, 2), ("document", 10, 0), ("packed", 4, 2), ("packed", 10, 0),
    ("packed", 3, 3), ("random", 4, 2),
])
def test_pickle_account_counts_every_token_as_the_windows_hold_them(tmp_path, windows, stride, val_num):
    docs = distinct_docs(LENGTHS)
    split = load_datasets(pickle_request(write_pickle(tmp_path, docs), stride=stride, val_num=val_num, windows=windows))
    train = split.accounts[0]
    kept = held_ids(split.train)
    assert (train.tokens, train.documents, train.items) == (sum(LENGTHS), len(LENGTHS), len(split.train))
    assert train.kept_tokens == len(kept) and train.kept_tokens + train.dropped_tokens == train.tokens
    assert train.kept_documents == sum(bool(kept & set(d)) for d in docs)
    short = [d for d in train.drops if d.reason.startswith("shorter than")]
    assert [(d.documents, d.tokens) for d in short] == ([(3, 3)] if windows == "document" else [])
    if val_num:
        valid, val = split.accounts[1], held_ids(split.val)
        assert valid.split == "valid" and valid.items == val_num == len(split.val)
        assert valid.kept_tokens == valid.tokens == len(val)
        held = next(d for d in train.drops if d.reason.startswith("held out"))
        assert held.tokens == len(val - kept)  # tokens only in held-out windows


def test_pickle_start_up_line_names_the_dropped_documents(tmp_path, capsys):
    path = write_pickle(tmp_path, distinct_docs(LENGTHS))
    data, out = started(capsys, "--dataset", "pickle", "--input-files", path, "--max-len", "7", "--stride", "4")
    assert isinstance(data.train, WindowDataset)  # 3 of 83 tokens in short documents: document windows
    assert (f"train data: pickle {path}: 9 documents, 83 tokens; kept {len(data.train)} windows from 6 documents "
            "(80 tokens); dropped 3 documents (3 tokens) shorter than 3 tokens (--windows packed keeps them)\n") in out


def test_short_documents_are_packed_by_default_and_the_line_says_so(tmp_path, capsys):
    path = write_pickle(tmp_path, distinct_docs([2] * 50 + [30]))  # 100 of 130 tokens in documents under 3
    data, out = started(capsys, "--dataset", "pickle", "--input-files", path, "--max-len", "7", "--stride", "4")
    assert isinstance(data.train, StreamWindows) and data.accounts[0].dropped_documents == 0
    assert ("train data: pickle " + path + ": 51 documents, 130 tokens; kept 31 packed windows from 51 documents "
            "(128 tokens); dropped 2 tokens after the last full window; --windows packed, the default here: "
            "--windows document would drop 100 of the 130 tokens\n") in out

    data, out = started(capsys, "--dataset", "pickle", "--input-files", path, "--max-len", "7", "--stride", "4",
                        "--windows", "document")  # asked for: kept, and the line says what it costs
    assert isinstance(data.train, WindowDataset) and len(data.train) == 7  # the 30-token document's
    assert "dropped 50 documents (100 tokens) shorter than 3 tokens (--windows packed keeps them)\n" in out


def test_more_than_half_the_tokens_in_short_documents_is_a_corpus_of_short_documents():
    req = pickle_request("x.pkl")
    assert choose_windows(req, np.array([2] * 10 + [20])) == ("document", False)  # exactly half
    assert choose_windows(req, np.array([2] * 11 + [20])) == ("packed", True)
    assert choose_windows(pickle_request("x.pkl", windows="random"),
                          np.array([2] * 11 + [20])) == ("random", True)


def test_document_windows_without_a_document_long_enough_name_packed(tmp_path):
    path = write_pickle(tmp_path, distinct_docs([2, 2, 1] * 5))
    with pytest.raises(UsageError, match="use --windows packed"):
        load_datasets(pickle_request(path, windows="document"))
    assert load_datasets(pickle_request(path)).accounts[0].kept_tokens == 8  # packed


def test_held_out_windows_of_short_documents_work_with_packed_training(tmp_path):
    rng = np.random.default_rng(0)
    # 300 documents under --max-len // 2 = 7 tokens, and 5 that make document windows
    docs = distinct_docs([*rng.integers(2, 7, 300).tolist(), *[20] * 5])
    path = write_pickle(tmp_path, docs)
    splits = {w: load_datasets(pickle_request(path, 15, 4000, seed=1, stride=8, val_num=20, windows=w))
              for w in (None, "packed", "random", "document")}
    val = [torch.stack([s.val[i] for i in range(len(s.val))]) for s in splits.values()]
    assert val[0].shape == (20, 16) and not (val[0] == IGNORE_INDEX).any()  # whole windows across documents
    assert all(torch.equal(val[0], v) for v in val[1:])  # the same held-out tokens whatever --windows draws
    held = set(val[0].flatten().tolist())
    for windows, split in splits.items():
        assert len(split.train) > 0 and not held & held_ids(split.train), windows  # no held-out token trained on
        assert split.accounts[1].line().startswith(f"valid data: pickle {path}: ")
    with pytest.raises(UsageError, match="--val-num 300 leaves no training windows"):
        load_datasets(pickle_request(path, 15, 4000, seed=1, val_num=300))


def test_training_on_short_documents_validates_and_prints_the_account(make_tiny_config, tmp_path, capsys):
    docs = [[(7 * i + j) % 95 + 1 for j in range(3 + i % 5)] for i in range(200)]  # 3-7 tokens, --max-len 16
    path = write_pickle(tmp_path, docs)
    assert train_main(["--model-config", str(make_tiny_config()), "--dataset", "pickle", "--input-files", path,
                       "--max-len", "16", "--stride", "16", "--val-num", "4", "--batch-size", "2",
                       "--training-steps", "3", "--num-workers", "0", "--eval-every-steps", "3",
                       "--checkpoint-output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^train data: pickle .*; --windows packed, the default here: --windows document would drop "
                     r"1,000 of the 1,000 tokens$", out, re.M)
    assert re.search(r"^valid data: pickle .*; kept 4 packed windows from \d+ documents \(68 tokens\)", out, re.M)
    assert re.search(r"validation after step 3: loss [\d.]+, perplexity [\d.]+, tokens 64", out)


# -- generated ---------------------------------------------------------------------------------------

def test_generated_account_drops_nothing(capsys):
    data, out = started(capsys, "--dataset", "generated", "--max-len", "15")
    assert (data.accounts[0].items, data.accounts[0].tokens, data.accounts[0].dropped_tokens) == (4, 64, 0)
    assert ("train data: generated (uniform random token ids): 4 samples, 64 tokens; kept 4 samples (64 tokens); "
            "nothing dropped\n") in out


# -- mmap, jsonl and text ------------------------------------------------------------------------------

def write_mmap(prefix: Path, lengths: list[int]) -> str:
    with IndexedWriter(prefix, np.uint16) as w:
        for doc in distinct_docs(lengths):
            w.add_document(np.array(doc, dtype=np.int64))
    return str(prefix)


def test_mmap_account_counts_the_cut_after_a_pass_and_a_split_too_small_for_a_sample(tmp_path, capsys):
    lengths = [10, 0, 7, 30, 12, 5, 3, 4, 9, 6]  # 86 tokens; --split 90,10,0: the valid split is the last document
    prefix = write_mmap(tmp_path / "c", lengths)
    data, out = started(capsys, "--dataset", "mmap", "--input-files", prefix, "--max-len", "16", "--split", "90,10,0")
    train, valid = data.accounts
    assert (train.documents, train.tokens, train.items) == (9, 80, len(data.train)) == (9, 80, 4)
    assert train.kept_tokens == 4 * 16 + 1 and train.dropped_tokens == 80 - 65  # (80 - 1) // 16 samples a pass
    assert data.val is None and (valid.items, valid.dropped_documents, valid.dropped_tokens) == (0, 1, 6)
    assert (f"train data: mmap {prefix}: 9 documents, 80 tokens; kept 4 samples (65 tokens); dropped 15 tokens after "
            "the last full sample of a pass (samples cross documents, Megatron's cut)\n") in out
    assert (f"valid data: mmap {prefix}: 1 document, 6 tokens; kept 0 samples (0 tokens); dropped 1 document "
            "(6 tokens) in fewer tokens than one sample of --max-len 16 + 1\n") in out


@pytest.mark.parametrize("dataset", ["jsonl", "text"])
def test_raw_text_accounts_name_the_files(tmp_path, capsys, dataset):
    texts = ["Hello world. " * 5, "a short one", "x", "more words here " * 4]
    if dataset == "jsonl":
        files = [tmp_path / "docs.jsonl"]
        files[0].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        pattern = str(files[0])
    else:
        files = [tmp_path / f"doc{i}.txt" for i in range(len(texts))]
        for f, t in zip(files, texts):
            f.write_text(t)
        pattern = str(tmp_path / "*.txt")
    data, out = started(capsys, "--dataset", dataset, "--input-files", pattern, "--max-len", "8", "--split",
                        "1,0,0", vocab_size=GPT2_VOCAB)
    tok = load_tokenizer(None)
    tokens = sum(len(tok.encode(t)) + 1 for t in texts)  # each document and its end-of-document token
    (train,) = data.accounts
    assert (train.source, train.documents, train.tokens) == (f"{dataset} {pattern}", 4, tokens)
    assert train.dropped_tokens == tokens - (len(data.train) * 8 + 1)
    assert (f"train data: {dataset} {pattern}: 4 documents, {tokens} tokens; kept {len(data.train)} samples "
            f"({tokens - train.dropped_tokens} tokens); dropped {train.dropped_tokens} tokens after the last full "
            "sample of a pass") in out


def test_completion_records_account_for_the_cut_tokens(tmp_path, capsys):
    path = tmp_path / "sft.jsonl"
    records = [("short prompt", " yes"), ("a much longer prompt " * 6, " and a completion"), ("q", " a")]
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in records))
    data, out = started(capsys, "--dataset", "jsonl", "--input-files", str(path), "--loss-on", "completion",
                        "--max-len", "15", "--split", "1,0,0", vocab_size=GPT2_VOCAB)
    tok = load_tokenizer(None)
    lengths = [len(tok.encode(p)) + len(tok.encode(c)) + 1 for p, c in records]
    (train,) = data.accounts
    assert (train.tokens, train.items, train.dropped_tokens) == (sum(lengths), 3, lengths[1] - 16)
    assert (f"dropped {lengths[1] - 16} tokens of 1 record longer than --max-len 15 + 1 (the prompt's start cut "
            "first)\n") in out


# -- tfrecord ----------------------------------------------------------------------------------------

def write_tfrecords(folder: Path, docs: list[list[int]], per_file: list[int]) -> str:
    tfrecord = pytest.importorskip("tfrecord")
    from tfrecord.tools.tfrecord2idx import create_index

    folder.mkdir()
    it = iter(docs)
    for k, n in enumerate(per_file):
        path = folder / f"data_{k}.tfrecord"
        writer = tfrecord.TFRecordWriter(str(path))
        for _ in range(n):
            writer.write({"input_ids": (next(it), "int")})
        writer.close()
        create_index(str(path), str(folder / f"data_{k}.index"))
    return str(folder / "*.tfrecord")


def test_tfrecord_account_counts_tokens_past_the_window_with_verify(tmp_path, capsys):
    lengths = [12, 5, 9, 20, 3, 9, 10, 4, 7, 30]  # --max-len 8: items hold 9 tokens of each record
    pattern = write_tfrecords(tmp_path / "tf", distinct_docs(lengths), [4, 6])
    data, out = started(capsys, "--dataset", "tfrecord", "--input-files", pattern, "--max-len", "8", "--split",
                        "8,1,1", "--verify", "true")
    train, valid, test = data.accounts
    assert data.test is not None and len(data.test) == 1  # the test share is evaluated, not lost
    assert (train.tokens, train.dropped_tokens, valid.dropped_tokens, test.dropped_tokens) == (72, 3 + 11 + 1, 0, 21)
    assert (f"train data: tfrecord {pattern}: 8 records, 72 tokens; kept 8 records (57 tokens); dropped 15 tokens "
            "past the first 9 of 3 records longer than --max-len 8 + 1\n") in out

    data, out = started(capsys, "--dataset", "tfrecord", "--input-files", pattern, "--max-len", "8", "--split",
                        "8,1,1")  # only each file's first record read: tokens not counted, the cut still named
    assert data.accounts[0].tokens is None
    assert ("8 records; kept 8 records; dropped uncounted tokens past the first 9 of each longer "
            "record (records read on open hold up to 12); tokens not counted: --verify reads every record on "
            "open\n") in out


# -- hf ------------------------------------------------------------------------------------------------

def test_hf_account_counts_the_batch_remainders(tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    texts = ["the cat sat on a mat", "hello world and dog ran far away", "one", "café and more words"] * 3
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(texts) + "\n")
    data, out = started(capsys, "--dataset", "hf", "--input-files", str(path), "--max-len", "16",
                        "--validation-split-percentage", "0", "--keep-linebreaks", "False", vocab_size=GPT2_VOCAB)
    tok = load_tokenizer(None)
    tokens = sum(len(tok.encode(t)) for t in texts)  # one batch of 12 records: its remainder is dropped
    (train,) = data.accounts
    assert (train.documents, train.tokens, train.items, train.dropped_tokens) == (12, tokens, tokens // 16, tokens % 16)
    assert (f"train data: hf {path}: 12 records, {tokens} tokens; kept {tokens // 16} blocks ({tokens // 16 * 16} "
            f"tokens); dropped {tokens % 16} tokens left after the last block of each batch of 1,000 records "
            "(run_clm's group_texts)\n") in out
