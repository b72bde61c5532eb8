"""``--dataset mmap`` against Megatron-Core 0.19.2's own datasets (the oracle).

The same ``.bin/.idx`` files, seed, split and sequence length go through Megatron-Core's
``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` + ``GPTDataset`` as Megatron-LM's
``pretrain_gpt.py`` builds them (sizes ``[train_iters x global_batch, valid, test]``), and every
training and validation sample, the blend's index arrays and the split boundaries must be equal.

Skips when megatron-core is not installed:
``.venv/bin/pip install --no-deps --ignore-requires-python megatron-core==0.19.2``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpt2forge.data import DataRequest, load_datasets
from gpt2forge.data import mmap as mm
from gpt2forge.data.args import DataArgs
from gpt2forge.data.blend import BlendedDataset
from gpt2forge.data.indexed import IndexedWriter
from gpt2forge.preprocess import megatron as preprocess
from gpt2forge.text.tokenizer import load_tokenizer

VOCAB = 96
SEQ = 16
SEED = 1234


@pytest.fixture(scope="module")
def mcore():
    """Megatron-Core's dataset modules. Its package ``__init__`` imports the whole training stack
    (triton, ...), which the data modules do not need: a bare package stands in for it."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (.venv/bin/pip install --no-deps "
                    "--ignore-requires-python megatron-core==0.19.2)")
    if "megatron.core" not in sys.modules:
        core = types.ModuleType("megatron.core")
        core.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "core")]
        sys.modules["megatron.core"] = core
        importlib.import_module("megatron.core.parallel_state")  # before utils: their import cycle
    try:
        builder = importlib.import_module("megatron.core.datasets.blended_megatron_dataset_builder")
        gpt = importlib.import_module("megatron.core.datasets.gpt_dataset")
        config = importlib.import_module("megatron.core.datasets.blended_megatron_dataset_config")
        utils = importlib.import_module("megatron.core.datasets.utils")
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError as exc:
        pytest.skip(f"megatron-core's dataset modules or C++ helpers do not load: {exc}")
    return SimpleNamespace(builder=builder, gpt=gpt, config=config, utils=utils)


def write_corpus(prefix: Path, n_docs: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    with IndexedWriter(prefix, np.uint16) as w:
        for _ in range(n_docs):
            n = int(rng.integers(0, 50))
            w.add_document(np.array([*rng.integers(1, VOCAB, size=n).tolist(), 0] if n else [], dtype=np.int64))
    return str(prefix)


def megatron_build(mcore, tmp_path: Path, sizes, split: str | None = None, blend=None, blend_per_split=None):
    tokenizer = SimpleNamespace(vocab_size=VOCAB, eod=0, unique_identifiers={"vocab": VOCAB})  # what it reads
    cfg = mcore.gpt.GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ, blend=blend, blend_per_split=blend_per_split, split=split,
        path_to_cache=str(tmp_path / "megatron_cache"), tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    return mcore.builder.BlendedMegatronDatasetBuilder(mcore.gpt.GPTDataset, sizes, lambda: True, cfg).build()


def sample_of(megatron_item: dict) -> torch.Tensor:
    """Megatron's (tokens, labels) pair back to the ``seq + 1`` tokens of the sample."""
    return torch.cat([megatron_item["tokens"], megatron_item["labels"][-1:]])


def assert_same_samples(ours, theirs, what: str) -> None:
    if isinstance(ours, BlendedDataset):
        assert np.array_equal(np.asarray(ours.dataset_index), theirs.dataset_index), what
        assert np.array_equal(np.asarray(ours.dataset_sample_index), theirs.dataset_sample_index), what
        count = ours.size
    else:
        count = ours.built
    assert count == len(theirs) > 0, what
    for i in range(count):
        assert torch.equal(ours[i], sample_of(theirs[i])), f"{what}: sample {i}"


def request(files, train_samples: int, **data) -> DataRequest:
    """An mmap request for `train_samples` training samples (steps of one sample); `data` are DataArgs fields."""
    return DataRequest(DataArgs(dataset="mmap", input_files=list(files), seed=SEED, **data), SEQ, VOCAB,
                       training_steps=train_samples)


@pytest.mark.parametrize("n_docs,split,epochs", [
    (200, "949,50,1", 1.0),   # one epoch
    (200, "949,50,1", 1.5),   # partial last epoch under 80%: Megatron shuffles it on its own
    (200, "90,10,0", 2.9),    # partial last epoch over 80%: shuffled with the others
    (250, "949,50,1", 1.0),   # the boundaries differ from Megatron-LM's old formula here
])
def test_single_prefix_samples_equal_megatron_core(mcore, tmp_path, n_docs, split, epochs):
    prefix = write_corpus(tmp_path / "c_text_document", n_docs, seed=n_docs)
    one = load_datasets(request([prefix], split=split, train_samples=1))
    samples = int(epochs * len(one.train))
    ours = load_datasets(request([prefix], split=split, train_samples=samples))
    theirs = megatron_build(mcore, tmp_path, [samples, None, None], split=split, blend=([prefix], None))
    assert ours.train.num_samples == theirs[0].num_samples == samples
    assert_same_samples(ours.train, theirs[0], "train")
    assert_same_samples(ours.val, theirs[1], "valid")


@pytest.mark.parametrize("weights", [(0.7, 0.3), (3.0, 1.0, 1.0), (0.2, 0.5, 0.3)])
def test_blend_index_arrays_and_samples_equal_megatron_core(mcore, tmp_path, weights):
    prefixes = [write_corpus(tmp_path / f"c{i}", 60 + 30 * i, seed=i) for i in range(len(weights))]
    blend = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    samples = 150
    ours = load_datasets(request(blend, split="90,10,0", train_samples=samples))
    valid = len(ours.val)  # a validation blend of one pass over every corpus's valid split
    theirs = megatron_build(mcore, tmp_path, [samples, valid, 0], split="90,10,0",
                            blend=(prefixes, list(weights)))
    assert ours.test is None and theirs[2] is None
    assert_same_samples(ours.train, theirs[0], "train")
    assert_same_samples(ours.val, theirs[1], "valid")


def test_bare_prefixes_and_per_split_blends_equal_megatron_core(mcore, tmp_path):
    a, b, c = (write_corpus(tmp_path / f"c{i}", 50 + 20 * i, seed=10 + i) for i in range(3))
    ours = load_datasets(request([a, b], split="80,20,0", train_samples=120))
    theirs = megatron_build(mcore, tmp_path, [120, None, None], split="80,20,0", blend=([a, b], None))
    assert_same_samples(ours.train, theirs[0], "bare train")
    assert_same_samples(ours.val, theirs[1], "bare valid (every sample once)")
    per_split = DataArgs(dataset="mmap", train_data_path=["0.6", a, "0.4", b], valid_data_path=[c], seed=SEED)
    ours = load_datasets(DataRequest(per_split, SEQ, VOCAB, training_steps=200))
    theirs = megatron_build(mcore, tmp_path, [200, None, None],
                            blend_per_split=[([a, b], [0.6, 0.4]), ([c], None), None])
    assert_same_samples(ours.train, theirs[0], "per-split train")
    assert_same_samples(ours.val, theirs[1], "per-split valid")


def test_split_boundaries_equal_megatron_core(mcore):
    to_matrix = mcore.config.convert_split_vector_to_split_matrix
    for split in ("949,50,1", "969,30,1", "1,1,1", "98,2,0", "80,20"):
        matrix = to_matrix(mcore.config.parse_and_normalize_split(split))
        for n in range(1, 1001):
            ours = mm.split_boundaries(split, n)
            for k, bookend in enumerate(matrix):
                theirs = (0, 0) if bookend is None else (int(round(bookend[0] * float(n))),
                                                         int(round(bookend[1] * float(n))))
                got = (ours[k], ours[k + 1])
                assert got == theirs or bookend is None and got[0] == got[1], (split, n, k)


def megatron_encode(tok, text, append_eod: bool) -> tuple[list[int], list[int]]:
    """Megatron-LM's ``tools/preprocess_data.py`` ``Encoder.encode`` (not in the megatron-core wheel),
    transcribed: a list-valued text is a list of sentences, each one sequence; EOD ends the last."""
    doc_ids, lens = [], []
    for sentence in text if isinstance(text, list) else [text]:
        ids = tok.encode(sentence)
        if ids:
            doc_ids.extend(ids)
            lens.append(len(ids))
    if doc_ids and append_eod:
        doc_ids.append(tok.eot_id)
        lens[-1] += 1
    return doc_ids, lens


def test_preprocess_writes_what_megatron_writes(mcore, tmp_path):
    try:
        tok = load_tokenizer()
    except Exception as exc:  # noqa: BLE001 - any failure means the vocabulary was not fetched
        pytest.skip(f"GPT-2 vocabulary not available ({exc}); run `make`")
    indexed = importlib.import_module("megatron.core.datasets.indexed_dataset")
    texts = ["A plain document.", ["First sentence.", "", "Second one!"], "", [], ["Only one."], "Last."]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    args = preprocess.build_parser().parse_args(["--input", str(src), "--output-prefix", str(tmp_path / "ours"),
                                                 "--append-eod", "--workers", "1"])
    preprocess.preprocess_data(args)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for t in texts:
        builder.add_document(*megatron_encode(tok, t, append_eod=True))
    builder.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes(), ext
