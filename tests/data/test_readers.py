"""mmap and tfrecord readers: sample-index op parity, Megatron sample construction and splits, the
index-map cache, TFRecord sharding and checks, cross-format identity, and short training runs."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data import DataRequest, load_datasets
from gpt2forge.data import mmap as mm
from gpt2forge.data import tfrecord as tfr
from gpt2forge.data.args import DataArgs
from gpt2forge.data.indexed import IndexedDataset, IndexedWriter
from gpt2forge.data.pickled import read_documents
from gpt2forge.ops import build as ops_build
from gpt2forge.ops import library as custom_ops

tfrecord = pytest.importorskip("tfrecord")
from tfrecord.tools.tfrecord2idx import create_index  # noqa: E402
from tfrecord.writer import TFRecordWriter  # noqa: E402

VOCAB = 96
ROOT = Path(__file__).resolve().parents[2]


# -- sample index: C++ op vs numpy reference vs Megatron's loop ---------------------------------------

def megatron_loop(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch) -> np.ndarray:
    """Megatron's `_build_sample_idx`, transcribed: the oracle of the vectorized reference."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_i, offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[doc_i]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc_i, offset = doc_i + 1, 0
        out[s] = doc_i, offset
    return out


def _sizes(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(1, 60, size=300).astype(np.int32)
    if kind == "heavy_tail_with_empty":  # empty and 1-token documents, a few very long ones
        s = rng.pareto(1.2, size=400) * 5
        s[rng.random(400) < 0.1] = 0
        s[0] = 0  # doc_idx may start with an empty document
        return np.minimum(s, 5000).astype(np.int32)
    if kind == "shorter_than_sample":
        return rng.integers(0, 4, size=500).astype(np.int32)
    if kind == "many_docs":  # enough documents for the op's multi-threaded path (2^17 or more)
        return rng.integers(0, 7, size=150_000).astype(np.int32)
    return np.array([7000], dtype=np.int32)  # one document, many samples


@pytest.fixture(scope="module")
def sample_index_op():
    """`torch.ops.gpt2forge.build_sample_idx`: the repo's library when it has the op, else a build of
    custom_ops/build_info.cpp + sample_index.cpp (only those two, to keep this test file fast)."""
    default = custom_ops.library_path()
    has_op = default.is_file() and b"build_sample_idx(Tensor sizes" in default.read_bytes()
    if hasattr(torch.ops.gpt2forge, "build_info"):  # a library is already loaded in this process
        if not hasattr(torch.ops.gpt2forge, "build_sample_idx"):
            pytest.skip("a custom ops library without build_sample_idx is already loaded")
        return torch.ops.gpt2forge.build_sample_idx
    if not has_op:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler to build the custom ops library")
        import tempfile

        src = Path(tempfile.mkdtemp())
        for name in ("build_info.cpp", "sample_index.cpp"):
            shutil.copy(ops_build.SOURCE_DIR / name, src / name)
        default = ops_build.build(src / "out", verbose=False, source_dir=src)
    torch.ops.load_library(str(default))
    return torch.ops.gpt2forge.build_sample_idx


@pytest.mark.parametrize("kind", ["uniform", "heavy_tail_with_empty", "shorter_than_sample", "one_doc",
                                  "many_docs"])
@pytest.mark.parametrize("epochs", [1, 3])
def test_sample_index_op_matches_reference_and_megatron(sample_index_op, kind, epochs):
    rng = np.random.default_rng(len(kind) * 10 + epochs)
    sizes = _sizes(kind, rng)
    seq = 16 if kind != "one_doc" else 128
    tokens = int(sizes.sum())
    doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    ref = mm.build_sample_idx_reference(sizes, doc_idx, seq, epochs, tokens)
    op = sample_index_op(torch.from_numpy(sizes), torch.from_numpy(doc_idx), seq, epochs, tokens).numpy()
    assert ref.dtype == op.dtype == np.int32
    np.testing.assert_array_equal(op, ref)
    if len(doc_idx) < 100_000:  # the Python loop is slow
        np.testing.assert_array_equal(ref, megatron_loop(sizes, doc_idx, seq, epochs, tokens))
    # int64 document ids give the same rows
    op64 = sample_index_op(torch.from_numpy(sizes), torch.from_numpy(doc_idx.astype(np.int64)), seq, epochs, tokens)
    np.testing.assert_array_equal(op64.numpy(), ref)


def test_sample_index_errors_agree(sample_index_op):
    sizes, doc_idx = np.array([5, 5], np.int32), np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="fewer than"):
        mm.build_sample_idx_reference(sizes, doc_idx, 4, 2, 10)  # 2 epochs asked, doc_idx holds 1
    with pytest.raises(ValueError, match="fewer than"):
        sample_index_op(torch.from_numpy(sizes), torch.from_numpy(doc_idx), 4, 2, 10)
    bad = np.array([0, 2], np.int32)
    with pytest.raises(ValueError, match="doc_idx"):
        mm.build_sample_idx_reference(sizes, bad, 4, 1, 10)
    with pytest.raises(ValueError, match="doc_idx"):
        sample_index_op(torch.from_numpy(sizes), torch.from_numpy(bad), 4, 1, 10)


def test_build_sample_idx_falls_back_with_notice(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv(custom_ops.LIBRARY_ENV, str(tmp_path / "missing.so"))
    custom_ops.load_custom_ops.cache_clear()
    try:
        sizes, doc_idx = np.array([9, 3, 12], np.int32), np.array([2, 0, 1], np.int32)
        out = mm.build_sample_idx(sizes, doc_idx, 4, 1, 24)
    finally:
        custom_ops.load_custom_ops.cache_clear()
    np.testing.assert_array_equal(out, megatron_loop(sizes, doc_idx, 4, 1, 24))
    assert "custom ops library not built" in capfd.readouterr().err


# -- mmap: splits, samples, cache ------------------------------------------------------------------

@pytest.mark.parametrize("split,size,expected", [
    ("949,50,1", 1000, [0, 949, 999, 1000]),
    ("969,30,1", 10, [0, 10, 10, 10]),
    ("1,1,1", 10, [0, 3, 7, 10]),  # Megatron-Core rounds the running total (Megatron-LM's old formula: 4)
    ("949,50,1", 250, [0, 237, 250, 250]),  # the old formula: [0, 238, 250, 250]
    ("95/5", 7, [0, 7, 7, 7]),
    ("80,20", 50, [0, 40, 50, 50]),
])
def test_split_boundaries_follow_megatron(split, size, expected):
    assert mm.split_boundaries(split, size) == expected


@pytest.mark.parametrize("split", ["a,b", "0,0,0", "-1,2", "1,1,1,1", ""])
def test_bad_split_is_a_usage_error(split):
    with pytest.raises(UsageError, match="--split"):
        mm.split_boundaries(split, 10)


def corpus(n_docs: int = 60, seed: int = 0) -> list[list[int]]:
    """Documents of varied length (a few empty), token ids in [1, VOCAB), EOS (0) at the end."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        n = int(rng.integers(0, 50))
        docs.append([*rng.integers(1, VOCAB, size=n).tolist(), 0] if n else [])
    return docs


def write_mmap(prefix: Path, docs: list[list[int]]) -> str:
    with IndexedWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(np.array(d, dtype=np.int64))
    return str(prefix)


def request(dataset: str, files, max_len: int = 16, samples_per_step: int = 1, epochs: int = 1,
            training_steps: int | None = None, **data) -> DataRequest:
    """A reader's request: `data` are DataArgs fields, the rest what the run decided."""
    files = [files] if isinstance(files, str) else list(files)
    return DataRequest(DataArgs(dataset=dataset, input_files=files, **data), max_len, VOCAB, samples_per_step,
                       epochs, training_steps)


def test_mmap_items_equal_direct_computation(tmp_path):
    docs = corpus()
    prefix = write_mmap(tmp_path / "c_text_document", docs)
    data = load_datasets(request("mmap", prefix, split="80,20,0", epochs=2))
    train, val = data.train, data.val
    a = mm.split_boundaries("80,20,0", len(docs))[1]
    tokens = sum(len(d) for d in docs[:a])
    assert len(train) == (tokens - 1) // 16 and train.num_samples == 2 * len(train)
    # doc_idx: each training document once per epoch; sample j = tokens [16 j, 16 j + 17) of the
    # documents laid end to end in doc_idx order; item i = sample shuffle_idx[i].
    assert sorted(np.asarray(train.doc_idx).tolist()) == sorted(list(range(a)) * 2)
    stream = np.concatenate([np.array(docs[d], dtype=np.int64) for d in train.doc_idx])
    built = (2 * tokens - 1) // 16  # Megatron builds every sample of the epochs, >= num_samples
    assert sorted(np.asarray(train.shuffle_idx).tolist()) == list(range(built))
    for i in range(built):
        j = int(train.shuffle_idx[i])
        assert torch.equal(train[i], torch.from_numpy(stream[16 * j: 16 * j + 17])), i
    assert sorted(set(np.asarray(val.doc_idx).tolist())) == [d for d in range(a, len(docs))]
    assert all(val[i].shape == (17,) for i in range(len(val)))
    assert torch.equal(train.epoch_indices(1, 5), torch.arange(5, 10))


def test_mmap_training_steps_decide_samples(tmp_path):
    prefix = write_mmap(tmp_path / "c", corpus())
    one = load_datasets(request("mmap", prefix, split="1,0,0")).train
    steps_per_epoch = len(one) // 4
    steps = 2 * steps_per_epoch + 1
    more = load_datasets(request("mmap", prefix, split="1,0,0", samples_per_step=4, training_steps=steps)).train
    # Megatron-LM asks for the samples the run consumes (train_iters x global batch), not whole epochs;
    # the epochs they span are built whole (3 here) and every sample read stays inside them.
    tokens = sum(len(d) for d in corpus())
    assert more.num_samples == 4 * steps and more.built == (3 * tokens - 1) // 16
    assert torch.equal(more.epoch_indices(2, 4 * steps_per_epoch)[-1], torch.tensor(12 * steps_per_epoch - 1))
    same = load_datasets(request("mmap", prefix, split="1,0,0", samples_per_step=1, training_steps=4 * steps)).train
    assert same.paths == more.paths
    assert load_datasets(request("mmap", prefix, split="1,0,0")).val is None


def test_index_maps_cached_reused_and_keyed(tmp_path, monkeypatch, capsys):
    prefix = write_mmap(tmp_path / "c", corpus())
    def cached() -> set[str]:
        return {p.name for p in tmp_path.glob("c_*indexmap*.npy")}

    load_datasets(request("mmap", prefix, split="80,20,0"))
    first = cached()
    assert len(first) == 6 and not list(tmp_path.glob(".*tmp"))  # train + valid, three maps each

    def no_build(*args, **kwargs):
        raise AssertionError("index maps rebuilt although cached")

    monkeypatch.setattr(mm, "build_index_maps", no_build)
    again = load_datasets(request("mmap", prefix, split="80,20,0"))
    assert capsys.readouterr().out.count("reusing index maps") == 2
    reloaded = load_datasets(request("mmap", prefix, split="80,20,0"))
    assert cached() == first and torch.equal(again.train[3], reloaded.train[3])
    monkeypatch.undo()
    # Each input of the maps gives new files: 3 (train) + 3 (valid) unless only the train side changes.
    for change, new in (({"seed": 7}, 6), ({"max_len": 8}, 6), ({"split": "90,10,0"}, 6), ({"epochs": 2}, 3)):
        before = cached()
        load_datasets(request("mmap", prefix, split=change.pop("split", "80,20,0"), **change))
        assert len(cached() - before) == new and before <= cached(), change


def test_interrupted_or_damaged_cache_is_rebuilt(tmp_path):
    prefix = write_mmap(tmp_path / "c", corpus())
    ref = load_datasets(request("mmap", prefix)).train
    expected = [ref[i] for i in range(len(ref))]
    shuffle = next(tmp_path.glob("c_train_*shuffle_idx.npy"))
    (tmp_path / f".{shuffle.name}.123.tmp").write_bytes(b"half a file")  # a killed writer's leftover
    shuffle.unlink()  # killed between two renames
    sample = next(tmp_path.glob("c_train_*sample_idx.npy"))
    sample.write_bytes(sample.read_bytes()[:100])  # damaged by hand
    again = load_datasets(request("mmap", prefix)).train
    assert len(again) == len(expected) and all(torch.equal(again[i], x) for i, x in enumerate(expected))
    assert len(list(tmp_path.glob("c_train_*.npy"))) == 3


def test_mmap_errors(tmp_path):
    prefix = write_mmap(tmp_path / "c", corpus())
    with pytest.raises(UsageError, match="not found"):
        load_datasets(request("mmap", str(tmp_path / "nope")))
    with pytest.raises(UsageError, match="--input-files/--data-path: weight -1 is negative"):
        load_datasets(request("mmap", ("-1", prefix, "2", prefix)))
    with pytest.raises(UsageError, match="fewer than one sample"):
        load_datasets(request("mmap", prefix, max_len=5000))
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-2])
    with pytest.raises(UsageError, match=r"c\.bin.*truncated"):
        load_datasets(request("mmap", prefix))
    small = write_mmap(tmp_path / "v", [[1, 2, VOCAB + 3, 4] * 10])
    with pytest.raises(UsageError, match="vocabulary"):
        load_datasets(request("mmap", small))


# -- tfrecord --------------------------------------------------------------------------------------

def write_tfrecords(folder: Path, docs: list[list[int]], per_file: list[int]) -> str:
    """Records = documents, ``per_file[k]`` of them in ``data_k.tfrecord``, each with its ``.index``."""
    folder.mkdir(parents=True, exist_ok=True)
    it = iter(docs)
    for k, n in enumerate(per_file):
        path = folder / f"data_{k}.tfrecord"
        writer = TFRecordWriter(str(path))
        for _ in range(n):
            writer.write({"input_ids": (next(it), "int")})
        writer.close()
        create_index(str(path), str(folder / f"data_{k}.index"))
    return str(folder / "*.tfrecord")


def _ids(items) -> list[int]:
    """Record identity: its first token (the test corpus makes them unique)."""
    return [int(x[0]) for x in items]


@pytest.fixture
def records(tmp_path):
    docs = [[i, *range(1, 1 + i % 30)] for i in range(1, 58)]  # first token i: unique per record
    return docs, write_tfrecords(tmp_path / "tf", docs, [20, 7, 30])


def test_tfrecord_shards_cover_every_record_once(records):
    docs, pattern = records
    train = load_datasets(request("tfrecord", pattern, split="1,0,0")).train
    everything = [d[0] for d in docs]
    for epoch, block, group, world, workers in ((0, 3, 1, 2, 2), (1, 3, 2, 2, 2), (0, 4, 3, 3, 0),
                                                (0, 1, 1, 4, 0), (2, 5, 2, 1, 0), (0, 60, 1, 2, 0)):
        seen = []
        for rank in range(world):
            view = train.epoch_stream(epoch, block, group=group)
            view.shard(rank, world)
            got = _ids(DataLoader(view, batch_size=None, num_workers=workers))
            assert len(got) == view.local_len()
            seen += got
        assert sorted(seen) == everything and len(train) == len(everything)
    orders = {tuple(f for f, _, _ in train.epoch_stream(e, 3).segments()) for e in range(6)}
    assert len(orders) > 1  # the file order is reshuffled per epoch


def test_tfrecord_ranks_together_read_what_one_process_reads(records):
    train = load_datasets(request("tfrecord", records[1], split="1,0,0")).train
    single = _ids(train.epoch_stream(1, 2, group=4))  # one process, 4 micro-batches of 2 per update
    ranks = []
    for rank in (0, 1):  # two processes, 2 micro-batches each per update
        view = train.epoch_stream(1, 2, group=2)
        view.shard(rank, 2)
        ranks.append(_ids(view))
    merged = [x for u in range(len(single) // 8) for x in ranks[0][4 * u: 4 * u + 4] + ranks[1][4 * u: 4 * u + 4]]
    assert len(merged) == 56 and merged == single[:56]


def test_tfrecord_stream_order_ignores_workers_and_resumes(records):
    train = load_datasets(request("tfrecord", records[1], split="1,0,0")).train
    full = _ids(train.epoch_stream(2, 4))
    for workers in (1, 2):
        loader = DataLoader(train.epoch_stream(2, 4), batch_size=4, num_workers=workers)
        assert _ids(x for batch in loader for x in batch) == full
    assert _ids(train.epoch_stream(2, 4, start_block=5)) == full[20:]


def test_tfrecord_items_pad_and_cut(records):
    docs, pattern = records
    data = load_datasets(request("tfrecord", pattern, max_len=8, split="50,50,0"))
    items = list(data.val)
    assert all(x.shape == (9,) for x in items)
    by_id = {d[0]: d for d in docs}
    for x in items:
        d = by_id[int(x[0])]
        n = min(len(d), 9)
        assert x[:n].tolist() == d[:n] and (x[n:] == IGNORE_INDEX).all()


def _expect_error(pattern: str, match: str, **kw):
    with pytest.raises(UsageError, match=match):
        src = load_datasets(request("tfrecord", pattern, split="1,0,0", **kw))
        list(src.train)


def test_tfrecord_checks(records, tmp_path):
    docs, pattern = records
    folder = Path(pattern).parent
    _expect_error(str(tmp_path / "none*.tfrecord"), "no TFRecord file matches")
    index = folder / "data_1.index"
    lines = index.read_text().splitlines()
    index.write_text("\n".join(lines[:-1]) + "\n")  # stale index: a record missing
    _expect_error(pattern, r"data_1\.tfrecord: does not match its index")
    index.write_text("0 12\nnot numbers\n")
    _expect_error(pattern, r"data_1\.index: not an index")
    index.unlink()
    _expect_error(pattern, r"index file .*data_1\.index is missing.*tfrecord2idx")
    create_index(str(folder / "data_1.tfrecord"), str(index))
    data = folder / "data_2.tfrecord"
    raw = bytearray(data.read_bytes())
    data.write_bytes(raw[:-7])  # truncated
    _expect_error(pattern, r"data_2\.tfrecord: does not match its index")
    raw[-6] ^= 0x01  # a flipped bit in the last record's payload: only the CRC sees it
    data.write_bytes(raw)
    load_datasets(request("tfrecord", pattern))
    _expect_error(pattern, r"data_2\.tfrecord: record 29 fails its CRC check", verify=True)


def test_tfrecord_out_of_vocab_and_feature(tmp_path):
    _expect_error(write_tfrecords(tmp_path / "a", [[1, 2, VOCAB]], [1]), "outside the model's vocabulary")
    path = tmp_path / "b" / "x.tfrecord"
    path.parent.mkdir()
    w = TFRecordWriter(str(path))
    w.write({"text": (b"hello", "byte")})
    w.close()
    create_index(str(path), str(tmp_path / "b" / "x.index"))
    _expect_error(str(path), "has no Int64List feature 'input_ids'")


# -- the same corpus in three formats --------------------------------------------------------------

def test_pickle_tfrecord_mmap_decode_to_identical_token_streams(tmp_path):
    docs = [d for d in corpus(40, seed=3) if d]
    pkl = tmp_path / "docs.pkl"
    pkl.write_bytes(pickle.dumps(docs))
    prefix = write_mmap(tmp_path / "docs_text_document", docs)
    pattern = write_tfrecords(tmp_path / "tf", docs, [15, len(docs) - 15])
    from_pickle = [d.tolist() for d in read_documents(str(pkl), VOCAB)]
    from_mmap = [d.tolist() for d in IndexedDataset(prefix, VOCAB).documents()]
    files = tfr.expand_inputs((pattern,))
    source = tfr.RecordSource(tuple(files), tuple(tfr.read_index(f) for f in files), VOCAB)
    from_tfrecord = []
    for f, path in enumerate(files):
        with open(path, "rb") as h:
            from_tfrecord += [x.tolist() for x in source.read(h, f, 0, int(source.counts[f]), True)]
    assert from_pickle == from_mmap == from_tfrecord == docs
    # data/write_into_tfrecord.py (whole documents: --seq-length 0) from the pickle and from the mmap
    # files: the same records, and every document exactly once.
    tool = pytest.importorskip("gpt2forge.preprocess.tfrecord_writer")
    written = []
    for name, source_path in (("from_pkl", str(pkl)), ("from_mmap", prefix)):
        args = tool.build_parser().parse_args(["--input-file-path", source_path, "--output-file-path",
                                               str(tmp_path / name), "--seq-length", "0", "--num-output", "2"])
        tool.write_into_tfrecord(args)
        files = tfr.expand_inputs((str(tmp_path / name / "*.tfrecord"),))
        written.append([x.tolist() for x in load_datasets(request("tfrecord", files, max_len=64, split="1,0,0"))
                        .train.epoch_stream(0, 1)])
    assert written[0] == written[1]
    assert sorted(r[: len(r) - (np.array(r) == IGNORE_INDEX).sum()] for r in written[0]) == sorted(docs)


# -- training on each format -----------------------------------------------------------------------

STEP = re.compile(r"^step (\d+) of epoch (\d+), loss: (\S+), acc: (\S+), lr: (\S+), throughput: .*"
                  r"data wait: [\d.]+%")


@pytest.fixture
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(vocab_size=VOCAB)


def train_args(cfg: Path, out: Path, *extra: str) -> list[str]:
    return ["--model-config", str(cfg), "--max-len", "16", "--batch-size", "2", "--gradient-accumulation", "2",
            "--device-iterations", "1", "--num-workers", "0", "--learning-rate", "3e-3", "--split", "85,15,0",
            "--checkpoint-output-dir", str(out), *extra]


def _steps(text: str) -> list[tuple[str, ...]]:
    return [m.groups() for line in text.splitlines() if (m := STEP.match(line))]


def test_training_on_mmap_logs_validation(tiny_config, tmp_path, capsys):
    prefix = write_mmap(tmp_path / "c_text_document", corpus(80))
    args = train_args(tiny_config, tmp_path / "o", "--train-path", "dynamic", "--data-prefix", prefix,
                      "--training-steps", "4", "--eval-steps", "2")
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert len(_steps(out)) == 4
    assert len(re.findall(r"validation after step \d+: loss [\d.]+", out)) >= 2


def test_training_on_tfrecord_logs_validation_and_resumes_exactly(tiny_config, tmp_path, capsys):
    docs = [[int(t) for t in np.random.default_rng(i).integers(1, VOCAB, size=17)] for i in range(32)]
    pattern = write_tfrecords(tmp_path / "tf", docs, [13, 19])
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("--dataset", "tfrecord", "--input-files", pattern, "--epochs", "2", "--eval-steps", "3")
    assert train_main(train_args(tiny_config, full, *common, "--save-per-steps", "5")) == 0
    out = capsys.readouterr().out
    lines = _steps(out)
    assert len(lines) == 2 * (27 // 4)  # 27 training records (--split 85,15,0), 4 per host step, 2 epochs
    assert re.search(r"validation after step 3: loss [\d.]+", out)
    resumed = train_args(tiny_config, part, *common, "--checkpoint-input-dir", str(full / "step_5"),
                         "--resume-training-from-checkpoint", "--num-workers", "2")
    assert train_main(resumed) == 0
    assert _steps(capsys.readouterr().out) == lines[5:]


def test_tfrecord_error_through_cli_exit_2(tiny_config, tmp_path, capsys):
    pattern = write_tfrecords(tmp_path / "tf", [[1, 2, 3]] * 4, [4])
    (tmp_path / "tf" / "data_0.index").unlink()
    args = train_args(tiny_config, tmp_path / "o", "--train-path", "tfrecord", "--tfrecord-path", pattern)
    assert train_main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "data_0.index is missing" in errors[0] and "tfrecord2idx" in errors[0]
    assert "Traceback" not in err


@pytest.mark.slow
def test_tfrecord_two_processes_equal_one(tmp_path):
    """torchrun with 2 gloo processes reads, per update, the records one process reads (losses and
    validation equal), through the rank-aware TFRecord stream."""
    import os
    import subprocess
    import sys

    docs = [[int(t) for t in np.random.default_rng(i).integers(1, VOCAB, size=17)] for i in range(40)]
    pattern = write_tfrecords(tmp_path / "tf", docs, [17, 23])
    config = tmp_path / "no_dropout.json"  # dropout would draw different masks in each process
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": VOCAB, "n_positions": 32, "n_embd": 32,
                                  "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                  "attn_pdrop": 0.0}))
    argv = ["train_gpt2.py", "--model-config", str(config), "--dataset", "tfrecord", "--input-files", pattern,
            "--max-len", "16", "--batch-size", "2", "--gradient-accumulation", "2", "--device-iterations", "1",
            "--training-steps", "3", "--num-workers", "0", "--learning-rate", "3e-3", "--replication-factor", "2",
            "--eval-steps", "3", "--split", "85,15,0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    lines = []
    for launcher in ([], ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]):
        proc = subprocess.run([sys.executable, *launcher, *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines.append([re.sub(r", throughput.*", "", line) for line in proc.stdout.splitlines()
                      if line.startswith(("step ", "validation "))])
    assert len(lines[0]) == 4 and lines[0] == lines[1]
