"""Weighted blends without Megatron-Core: the order's shares, the cache, resuming mid-blend, bad
input, per-split paths and a short training run that logs the shares (the equality with
Megatron-Core's own arrays is in test_megatron_core_parity.py)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.data import DataRequest, load_datasets
from gpt2forge.data import blend as bl
from gpt2forge.data.args import DataArgs
from gpt2forge.data.indexed import IndexedWriter

VOCAB = 96
STEP = re.compile(r"^step (\d+) of epoch (\d+), loss: (\S+), acc: (\S+), lr: (\S+), throughput: .*"
                  r"shares: (.*)$")


def write_corpus(prefix: Path, n_docs: int, seed: int, dtype=np.uint16) -> str:
    rng = np.random.default_rng(seed)
    with IndexedWriter(prefix, dtype) as w:
        for _ in range(n_docs):
            w.add_document(np.array([*rng.integers(1, VOCAB, size=int(rng.integers(1, 40))).tolist(), 0]))
    return str(prefix)


def request(files, max_len: int = 16, samples_per_step: int = 1, training_steps: int | None = None,
            **data) -> DataRequest:
    """An mmap request: `data` are DataArgs fields, the rest what the run decided."""
    return DataRequest(DataArgs(dataset="mmap", input_files=list(files), **data), max_len, VOCAB, samples_per_step,
                       training_steps=training_steps)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (1, 1, 1), (0.01, 0.99), (5, 1, 1, 3)])
def test_shares_stay_within_one_sample_of_the_weights(weights):
    w = bl.normalize(weights)
    size = 3000
    index, sample = bl.blending_indices(w, size)
    onehot = np.eye(len(w), dtype=np.int64)[index]  # (size, datasets)
    counts = np.cumsum(onehot, axis=0)  # samples of each corpus among the first n + 1
    expected = np.arange(1, size + 1)[:, None] * np.array(w)[None, :]
    assert np.abs(counts - expected).max() <= 1.0
    # Each corpus's samples are taken in order 0, 1, 2, ...
    for d in range(len(w)):
        assert np.array_equal(sample[index == d], np.arange((index == d).sum()))


def test_exhaustive_order_takes_every_sample_once():
    index, sample = bl.exhaustive_indices([7, 3, 5])
    assert np.bincount(index).tolist() == [7, 3, 5]
    for d, n in enumerate([7, 3, 5]):
        assert sample[index == d].tolist() == list(range(n))


def test_parse_blend_follows_megatron():
    assert bl.parse_blend(["A"], "--x") == bl.Blend(("A",), None)
    assert bl.parse_blend(["A.bin", "B"], "--x") == bl.Blend(("A", "B"), None)
    assert bl.parse_blend(["30", "A", "70", "B.idx"], "--x") == bl.Blend(("A", "B"), (30.0, 70.0))


@pytest.mark.parametrize("values,message", [
    (["-0.5", "A", "1", "B"], "weight -0.5 is negative"),
    (["0", "A", "0", "B"], "sum to zero"),
    (["0.7", "A", "0.3"], "weight 0.3 is not followed by a prefix"),
    (["0.7", "A", "B", "0.3"], "must alternate"),
    (["1", "A", "0", "B"], "weight 0 for B"),
    (["nan", "A", "1", "B"], "not finite"),
])
def test_bad_weights_name_the_flag(tmp_path, values, message):
    with pytest.raises(UsageError, match=f"--input-files/--data-path: .*{message}"):
        load_datasets(request(values))
    with pytest.raises(UsageError, match=f"--train-data-path: .*{message}"):
        load_datasets(DataRequest(DataArgs(dataset="mmap", train_data_path=list(values), seed=1), 16, VOCAB))


def test_more_corpora_than_the_int16_index_holds_are_refused():
    many = [f"c{i}" for i in range(bl.MAX_CORPORA + 1)]
    with pytest.raises(UsageError, match=r"--data-path: 32768 corpora; a blend holds at most 32767"):
        bl.parse_blend(many, "--data-path")
    with pytest.raises(UsageError, match="32768 corpora"):
        bl.parse_blend([x for p in many for x in ("1", p)], "--data-path")
    assert len(bl.parse_blend(many[:-1], "--data-path").prefixes) == bl.MAX_CORPORA


def test_prefixes_of_different_tokenizers_are_refused(tmp_path):
    a = write_corpus(tmp_path / "a", 40, 0)
    b = write_corpus(tmp_path / "b", 40, 1, dtype=np.int32)
    with pytest.raises(UsageError, match=r"--input-files/--data-path: .*b holds int32 token ids but .*a holds uint16.*"
                                         r"different tokenizers"):
        load_datasets(request(["0.5", a, "0.5", b]))
    big = str(tmp_path / "big")
    with IndexedWriter(big, np.uint16) as w:
        w.add_document(np.array([1, 2, VOCAB + 10, 0] * 10))
    with pytest.raises(UsageError, match="big.bin: token id 106 .* outside the model's vocabulary"):
        load_datasets(request(["0.5", a, "0.5", big]))


def test_blend_is_cached_keyed_and_pickles(tmp_path, monkeypatch):
    a, b = write_corpus(tmp_path / "a", 60, 0), write_corpus(tmp_path / "b", 80, 1)
    first = load_datasets(request(["0.7", a, "0.3", b], split="90,10,0", training_steps=100)).train
    files = {p.name for p in tmp_path.glob("a_*blend*.npy")}
    assert len(files) == 4 and not list(tmp_path.glob(".*tmp"))  # train + valid orders, two arrays each
    monkeypatch.setattr(bl, "blending_indices", lambda *a: pytest.fail("blend order rebuilt although cached"))
    again = load_datasets(request(["0.7", a, "0.3", b], split="90,10,0", training_steps=100)).train
    monkeypatch.undo()
    assert all(torch.equal(first[i], again[i]) for i in range(first.size))
    load_datasets(request(["0.6", a, "0.4", b], split="90,10,0", training_steps=100))
    assert len({p.name for p in tmp_path.glob("a_*blend*.npy")} - files) == 4  # new weights: new train and valid orders
    copy = pickle.loads(pickle.dumps(first))  # as a DataLoader worker receives it
    assert all(torch.equal(first[i], copy[i]) for i in range(first.size))


def test_resuming_mid_blend_continues_the_same_order(tmp_path):
    a, b, c = (write_corpus(tmp_path / n, 15 + 5 * i, i) for i, n in enumerate("abc"))
    blend, samples = ["0.5", a, "0.3", b, "0.2", c], 120
    whole = load_datasets(request(blend, split="1,0,0", training_steps=samples // 4, samples_per_step=4)).train
    per_epoch = len(whole) // 4 * 4  # what the trainer reads per epoch: whole host steps
    epochs = -(-samples // per_epoch)
    assert epochs >= 2
    order = torch.cat([whole.epoch_indices(e, per_epoch) for e in range(epochs)])[:samples]
    expected = [whole[int(i)] for i in order]
    for p in tmp_path.glob("*.npy"):  # a fresh process on another node: nothing cached
        p.unlink()
    resumed = load_datasets(request(blend, split="1,0,0", training_steps=samples // 4, samples_per_step=4)).train
    for start in (37, per_epoch + 5):  # samples already consumed, in the first epoch and in the second
        epoch, offset = divmod(start, per_epoch)
        tail = torch.cat([resumed.epoch_indices(e, per_epoch) for e in range(epoch, epochs)])
        tail = tail[offset:offset + samples - start]
        assert all(torch.equal(resumed[int(i)], x) for i, x in zip(tail, expected[start:], strict=True))
    assert resumed.realized_shares(samples) == whole.realized_shares(samples)


def test_per_split_paths_and_test_split(tmp_path):
    a, b, c, d = (write_corpus(tmp_path / n, 40, i) for i, n in enumerate("abcd"))
    both = DataArgs(dataset="mmap", train_data_path=["1", a, "3", b], valid_data_path=[c], test_data_path=[d], seed=1)
    data = load_datasets(DataRequest(both, 16, VOCAB, training_steps=50))
    assert isinstance(data.train, bl.BlendedDataset) and data.train.size >= 50
    assert list(data.train.realized_shares(40).values()) == [0.25, 0.75]
    assert data.val.data.prefix == c and data.test.data.prefix == d
    with pytest.raises(UsageError, match="exclude each other"):
        load_datasets(DataRequest(DataArgs(dataset="mmap", input_files=[a], train_data_path=[b], seed=1), 16, VOCAB))
    split = load_datasets(request([a], split="80,10,10"))
    assert split.test is not None and split.test.data.prefix == a


def test_valid_and_test_paths_replace_their_share_of_the_split(tmp_path):
    """Seed 001's Megatron --valid-data/--test-data: the training data keeps its --split share, the
    given files are read whole as validation/test data."""
    a, c = write_corpus(tmp_path / "a", 40, 0), write_corpus(tmp_path / "c", 10, 1)
    data = load_datasets(request([a], split="80,10,10", valid_data_path=[c]))
    assert data.train.data.prefix == a and data.train.doc_idx.max() < 32  # documents [0, 32) of a
    assert data.val.data.prefix == c and set(data.val.doc_idx.tolist()) == set(range(10))
    assert data.test.data.prefix == a and data.test.doc_idx.min() >= 36  # a's test share, [36, 40)
    with pytest.raises(UsageError, match="need --train-data-path or --input-files"):
        held_out_only = DataArgs(dataset="mmap", input_files=[c], valid_data_path=[c], seed=1)
        held_out_only.input_files = None  # past DataArgs' own check: the reader refuses it too
        load_datasets(DataRequest(held_out_only, 16, VOCAB))


@pytest.fixture
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(vocab_size=VOCAB)


def _train(tiny_config: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-config", str(tiny_config), "--max-len", "16", "--batch-size", "2", "--gradient-accumulation",
            "2", "--device-iterations", "1", "--learning-rate", "3e-3", "--split", "85,15,0",
            "--checkpoint-output-dir", str(out), "--dataset", "mmap", *extra]


@pytest.mark.slow
def test_training_on_a_blend_logs_shares_and_resumes_exactly(tiny_config, tmp_path, capsys):
    a, b = write_corpus(tmp_path / "A", 60, 0), write_corpus(tmp_path / "B", 60, 1)
    common = ("--data-path", "0.7", a, "0.3", b, "--training-steps", "3", "--num-workers", "0")
    assert train_main(_train(tiny_config, tmp_path / "full", *common, "--save-per-steps", "1")) == 0
    out = capsys.readouterr().out
    steps = [m.groups() for line in out.splitlines() if (m := STEP.match(line))]
    assert len(steps) == 3
    index, _ = bl.blending_indices([0.7, 0.3], 12)  # 3 steps x 4 samples read
    for step, n in zip(steps, (4, 8, 12)):
        share = float((index[:n] == 0).sum()) / n
        assert step[5] == f"A {share:.3f} B {1 - share:.3f}"
    assert re.search(r"blend train: .*A: weight 0.7000, samples \d+, share 0.6", out)
    assert re.search(r"blend train: .*B: weight 0.3000, samples \d+, share 0.3", out)
    resumed = _train(tiny_config, tmp_path / "part", *common[:-2], "--num-workers", "2",
                     "--checkpoint-input-dir", str(tmp_path / "full" / "step_1"), "--resume-training-from-checkpoint")
    assert train_main(resumed) == 0
    again = [m.groups() for line in capsys.readouterr().out.splitlines() if (m := STEP.match(line))]
    assert again == steps[1:]


def test_last_epoch_read_past_the_samples_wraps_only_what_is_never_trained(tmp_path):
    # The trainer reads epochs of whole host steps; a run asked for N samples stops inside its last
    # epoch, whose full index can run past the samples Megatron builds for N. Find such a run.
    prefix = write_corpus(tmp_path / "c", 120, 3)
    probe = load_datasets(request([prefix], split="1,0,0")).train
    tokens, per_epoch = int(probe.data.sizes.sum()), len(probe)

    def past_the_end(sps: int, steps: int) -> bool:
        built = next((e * tokens - 1) // 16 for e in range(1, 99) if (e * tokens - 1) // 16 >= steps * sps)
        count = per_epoch // sps * sps
        return -(-steps * sps // count) * count > built

    sps, steps = next((b, s) for b in range(2, per_epoch) for s in range(1, 6 * per_epoch // b) if past_the_end(b, s))
    count = per_epoch // sps * sps
    train = load_datasets(request([prefix], split="1,0,0", samples_per_step=sps, training_steps=steps)).train
    epochs = -(-steps * sps // count)
    read = torch.cat([train.epoch_indices(e, count) for e in range(epochs)])
    assert len(read) > train.built >= train.num_samples == steps * sps
    assert read[:steps * sps].tolist() == list(range(steps * sps))  # what the run trains on: in order
    assert int(read.max()) < train.built
    with pytest.raises(UsageError, match="outgrew"):
        train.epoch_indices(epochs + 5, count)
