"""Seeded fuzzing of every format the project reads: make valid files, mutate one, read it back.

Each format is a `Format`: `make(folder)` writes a small valid instance (its files), `read(files)`
opens it the way the product does and consumes what training or evaluation would (items, token
ids, an encoded string, model weights). A case is `(format, seed)`: the seed picks the file to
mutate and the mutation (bit flips, truncation, insertion, appended junk, a zeroed range, or a
structure-aware overwrite of an aligned integer field with an extreme value), so any failure is
reproduced by its seed alone. The outcome must be success or `UsageError` (the CLIs' one line and
exit code 2); anything else is a failure.

Why a hand-written mutator and not hypothesis: the inputs are binary files whose valid instances
come from the project's own writers, each case must be reproducible from one integer printed by
the long-run command (`make fuzz`), and the structure-aware part is a handful of integer fields;
hypothesis' shrinking adds little to byte mutations of files this small.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 512
EXTREMES = (0, 1, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1)


@dataclass(frozen=True)
class Format:
    name: str
    make: Callable[[Path], list[Path]]
    read: Callable[[list[Path]], None]


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """One random mutation of `data` (never returns it unchanged unless it is empty)."""
    buf = bytearray(data)
    kind = int(rng.integers(6))
    n = len(buf)
    if kind == 0 and n:  # flip 1-8 bits
        for _ in range(int(rng.integers(1, 9))):
            i = int(rng.integers(n))
            buf[i] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # truncate
        del buf[int(rng.integers(n)) if n else 0:]
    elif kind == 2:  # insert random bytes
        i = int(rng.integers(n + 1))
        buf[i:i] = rng.integers(0, 256, int(rng.integers(1, 17)), dtype=np.uint8).tobytes()
    elif kind == 3:  # append junk
        buf += rng.integers(0, 256, int(rng.integers(1, 65)), dtype=np.uint8).tobytes()
    elif kind == 4 and n:  # zero a range
        i = int(rng.integers(n))
        buf[i:i + int(rng.integers(1, 65))] = bytes(min(n - i, 64))
        buf = buf[:n]
    elif n >= 8:  # overwrite an aligned 4- or 8-byte field with an extreme value
        width = 8 if rng.integers(2) else 4
        i = int(rng.integers(max(n // width, 1))) * width
        value = int(rng.choice(EXTREMES)) % (1 << (8 * width))
        buf[i:i + width] = value.to_bytes(width, "little")[: max(0, min(width, n - i))]
    else:
        buf += b"\x00"
    return bytes(buf)


def _docs(rng: np.random.Generator, count: int = 12) -> list[np.ndarray]:
    return [rng.integers(0, VOCAB, int(rng.integers(1, 40))) for _ in range(count)]


# -- Megatron .bin/.idx ---------------------------------------------------------------------------

def make_megatron(folder: Path) -> list[Path]:
    from gpt2forge.data.indexed import IndexedWriter

    with IndexedWriter(folder / "corpus", dtype=np.uint16) as w:
        for doc in _docs(np.random.default_rng(0), 30):
            w.add_document(doc)
    return [folder / "corpus.bin", folder / "corpus.idx"]


def read_megatron(files: list[Path]) -> None:
    from gpt2forge.data.args import DataArgs
    from gpt2forge.data.contract import DataRequest
    from gpt2forge.data.indexed import IndexedDataset
    from gpt2forge.data.mmap import load

    prefix = str(files[0].parent / "corpus")
    ds = IndexedDataset(prefix, vocab_size=VOCAB)
    for i in range(len(ds)):
        assert int(ds[i].max(initial=0)) < VOCAB
    split = load(DataRequest(DataArgs(dataset="mmap", input_files=[prefix], seed=1, split="90,10,0"), 8, VOCAB))
    for item in (split.train[i] for i in range(min(len(split.train), 8))):
        assert item.shape == (9,) and int(item.max()) < VOCAB


# -- TFRecord shard + index -----------------------------------------------------------------------

def make_tfrecord(folder: Path) -> list[Path]:
    from tfrecord.tools.tfrecord2idx import create_index
    from tfrecord.writer import TFRecordWriter

    path = folder / "shard0.tfrecord"
    writer = TFRecordWriter(str(path))
    for doc in _docs(np.random.default_rng(1), 10):
        writer.write({"input_ids": (doc.tolist(), "int")})
    writer.close()
    create_index(str(path), str(folder / "shard0.index"))
    return [path, folder / "shard0.index"]


def read_tfrecord(files: list[Path]) -> None:
    from gpt2forge.data.args import DataArgs
    from gpt2forge.data.contract import DataRequest
    from gpt2forge.data.tfrecord import load

    shard = next(str(f) for f in files if f.suffix == ".tfrecord")
    split = load(DataRequest(DataArgs(dataset="tfrecord", input_files=[shard], seed=1, split="1,0,0", verify=True),
                             8, VOCAB))
    for item in split.train.epoch_stream(0, 2):
        assert item.shape == (9,)


# -- the reference's pickle -----------------------------------------------------------------------

def make_pickle(folder: Path) -> list[Path]:
    path = folder / "data.pkl"
    path.write_bytes(pickle.dumps([d.tolist() for d in _docs(np.random.default_rng(2), 10)], protocol=2))
    return [path]


def read_pickle(files: list[Path]) -> None:
    from gpt2forge.data.args import DataArgs
    from gpt2forge.data.contract import DataRequest
    from gpt2forge.data.pickled import load

    split = load(DataRequest(DataArgs(dataset="pickle", input_files=[str(files[0])], seed=1, stride=8), 8, VOCAB))
    for i in range(len(split.train)):
        assert split.train[i].shape == (9,)


# -- JSONL preprocess input -----------------------------------------------------------------------

def make_jsonl(folder: Path) -> list[Path]:
    path = folder / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i} about the sea, é ü 字", "url": f"u{i}"}) for i in range(8)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [path]


def read_jsonl(files: list[Path]) -> None:
    from gpt2forge.preprocess.jsonl import read_documents

    for doc in read_documents(files[0]):
        assert isinstance(doc.text, str)


# -- tokenizer files ------------------------------------------------------------------------------

def make_tokenizer(folder: Path) -> list[Path]:
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    merges = ["t h", "th e", "s e", "se a", "a n", "an d"]
    for m in merges:
        vocab.setdefault(m.replace(" ", ""), len(vocab))
    vocab["Ġ"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return [folder / "vocab.json", folder / "merges.txt"]


def read_tokenizer(files: list[Path]) -> None:
    from gpt2forge.text.tokenizer import load_tokenizer

    tok = load_tokenizer(files[0].parent)
    ids = tok.encode("the sea and the ship")
    assert all(0 <= i < tok.vocab_size for i in ids)


# -- model config (JSON) and run config (YAML) ----------------------------------------------------

def make_model_config(folder: Path) -> list[Path]:
    path = folder / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": VOCAB, "n_positions": 16, "n_embd": 16,
                                "n_layer": 1, "n_head": 2}))
    return [path]


def read_model_config(files: list[Path]) -> None:
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel

    cfg = ModelConfig.from_json(files[0])
    if cfg.num_params() < 5_000_000:  # build only what fits a test (a mutated size is refused later, by plan)
        GPT2LMHeadModel(cfg)


def make_run_config(folder: Path) -> list[Path]:
    path = folder / "run.yaml"
    path.write_text("dataset: generated\nbatch_size: 2\nlearning_rate: 0.001\nlr_schedule: cosine\n"
                    "training_steps: 3\nlayers_per_ipu: [0, 2]\n")
    return [path]


def read_run_config(files: list[Path]) -> None:
    from gpt2forge.frontends.graphcore import parse_args

    parse_args(["--config", str(files[0])])


# -- checkpoint folder ----------------------------------------------------------------------------

def make_checkpoint(folder: Path) -> list[Path]:
    import torch

    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    from gpt2forge.train.run_folder import save_checkpoint

    model = GPT2LMHeadModel(ModelConfig(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    model.init_weights(torch.Generator().manual_seed(0))
    state = {"progress": {"step": 1, "epoch": 0, "step_in_epoch": 1, "updates": 1},
             "optimizer": {"state": {}, "param_groups": []}}
    ckpt = save_checkpoint(folder, "step_1", model, state, {})
    return [ckpt / "model.safetensors", ckpt / "config.json", ckpt / "training_state.pt"]


def read_checkpoint(files: list[Path]) -> None:
    """The trainer's path: config, weights into a model built from it, the training state."""
    import torch

    from gpt2forge.model.checkpoint import load_model_config, load_weights
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    from gpt2forge.train.run_folder import load_training_state

    ckpt = files[0].parent
    cfg = load_model_config(ckpt)
    if cfg.num_params() > 5_000_000:  # a mutated size: the weights cannot match it (refused below)
        cfg = dataclasses.replace(cfg, n_layer=1, n_embd=16, n_head=2)
    model = GPT2LMHeadModel(cfg)
    load_weights(model, ckpt)
    load_training_state(ckpt)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("megatron", make_megatron, read_megatron),
    Format("tfrecord", make_tfrecord, read_tfrecord),
    Format("pickle", make_pickle, read_pickle),
    Format("jsonl", make_jsonl, read_jsonl),
    Format("tokenizer", make_tokenizer, read_tokenizer),
    Format("model_config", make_model_config, read_model_config),
    Format("run_config", make_run_config, read_run_config),
    Format("checkpoint", make_checkpoint, read_checkpoint),
)}


def run_case(fmt: Format, seed: int, folder: Path, pristine: dict[str, bytes]) -> str | None:
    """Mutate one file of a fresh copy of the valid instance and read it; None, or what went wrong."""
    from gpt2forge.core.errors import UsageError

    for name, data in pristine.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for stale in folder.rglob("*_idx.npy"):  # index maps a previous case built
        stale.unlink()
    rng = np.random.default_rng(seed)
    names = sorted(pristine)
    victim = names[int(rng.integers(len(names)))]
    (folder / victim).write_bytes(mutate(pristine[victim], rng))
    files = [folder / n for n in names]
    try:
        fmt.read(files)
    except UsageError as exc:
        if "\n" in str(exc).strip():
            return f"multi-line UsageError: {str(exc)[:200]!r}"
        return None
    except Exception as exc:  # noqa: BLE001 -- the point: anything but UsageError is a failure
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''} (mutated {victim})"
    return None


def pristine_files(fmt: Format, folder: Path) -> dict[str, bytes]:
    """The valid instance's files, by path relative to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    files = fmt.make(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}
