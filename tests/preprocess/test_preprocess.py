"""Preprocessing tools and the Megatron indexed format (gpt2forge.data.indexed, gpt2forge.preprocess).

The indexed-format fixture is built byte by byte from the format specification with `struct`,
so "our bytes == Megatron's bytes" is checked against the spec, not against our own writer.
Tests that tokenize with GPT-2 skip when its vocabulary has not been fetched (`make`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from tqdm import tqdm

from gpt2forge.core.errors import UsageError
from gpt2forge.data.indexed import IndexedDataset, IndexedWriter, best_dtype
from gpt2forge.preprocess import megatron, tfrecord_writer, wikipedia
from gpt2forge.preprocess.describe import build_parser as inspect_parser
from gpt2forge.preprocess.describe import describe, inspect_main
from gpt2forge.text import vocab
from gpt2forge.text.tokenizer import GPT2Tokenizer, HFTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
ASSETS = vocab.asset_dir()
needs_vocab = pytest.mark.skipif(
    not vocab.verify(ASSETS / vocab.TIKTOKEN_FILE) or not (ASSETS / vocab.VOCAB_FILE).is_file(),
    reason="GPT-2 vocabulary not fetched; run `make`")
DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Ünïcödé text: naïve café, Привет мир, 日本語.",
    "",  # an empty text: no sequence, but its (empty) document entry stays, as Megatron's add_document
    "Short.",
    "A longer document that goes on for a while, with numbers 1, 22, 333 and punctuation!? " * 8,
]
TURKISH = ("Türkiye'nin başkenti Ankara'dır. İstanbul en kalabalık şehirdir. Çocuklar bahçede "
           "oynuyor ve öğretmenler sınıfta ders anlatıyor. Güzel bir gün geçirdik, çok teşekkürler.")


def handbuilt_mmap(path: Path, docs: list[list[int]], code: int = 8, fmt: str = "<H",
                   doc_idx: list[int] | None = None) -> None:
    """Write `<path>.idx/.bin` from the format spec (Megatron MMapIndexedDataset), with struct."""
    doc_idx = list(range(len(docs) + 1)) if doc_idx is None else doc_idx
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(doc_idx))
    idx += b"".join(struct.pack("<i", len(d)) for d in docs)
    offset, item = 0, struct.calcsize(fmt)
    for d in docs:
        idx += struct.pack("<q", offset)
        offset += len(d) * item
    idx += b"".join(struct.pack("<q", i) for i in doc_idx)
    Path(f"{path}.idx").write_bytes(idx)
    Path(f"{path}.bin").write_bytes(b"".join(struct.pack(fmt, t) for d in docs for t in d))


FIXTURE = [[50256, 15496, 995], [7], [1, 2, 3, 4, 65000]]


@pytest.mark.parametrize("dtype,code,fmt", [(np.uint16, 8, "<H"), (np.int32, 4, "<i")])
def test_writer_bytes_equal_handbuilt_fixture(tmp_path, dtype, code, fmt):
    handbuilt_mmap(tmp_path / "spec", FIXTURE, code, fmt)
    with IndexedWriter(tmp_path / "ours", dtype) as w:
        for doc in FIXTURE:
            w.add_document(doc)
    for ext in (".idx", ".bin"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()


def test_reader_reads_handbuilt_file_with_sentence_doc_idx(tmp_path):
    # Megatron with --split-sentences: 3 sequences, 2 documents ([0, 2, 3]).
    handbuilt_mmap(tmp_path / "m", FIXTURE, doc_idx=[0, 2, 3])
    ds = IndexedDataset(tmp_path / "m", vocab_size=65001)
    assert len(ds) == 3 and ds.num_documents == 2 and ds.dtype == np.uint16
    assert ds.sizes.tolist() == [3, 1, 5] and ds.pointers.tolist() == [0, 6, 8]
    assert ds[0].tolist() == FIXTURE[0] and ds.get(2, offset=1, length=2).tolist() == [2, 3]
    assert ds.document(0).tolist() == FIXTURE[0] + FIXTURE[1] and ds.num_tokens == 9
    assert pickle.loads(pickle.dumps(ds))[2].tolist() == FIXTURE[2]  # reopened by prefix


def test_best_dtype_follows_megatron():
    assert best_dtype(50257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(None) == np.int32


def _corrupt(tmp_path: Path, what: str) -> Path:
    p = tmp_path / "c"
    handbuilt_mmap(p, FIXTURE)
    idx, bin_ = bytearray(Path(f"{p}.idx").read_bytes()), Path(f"{p}.bin")
    if what == "magic":
        idx[0:9] = b"NOTMMIDX!"
    elif what == "version":
        idx[9:17] = struct.pack("<Q", 2)
    elif what == "code":
        idx[17] = 9
    elif what == "float":
        idx[17] = 6
    elif what == "idx-truncated":
        idx = idx[:-5]
    elif what == "bin-truncated":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif what == "pointers":
        idx[34 + 12 + 8:34 + 12 + 16] = struct.pack("<q", 2)
    Path(f"{p}.idx").write_bytes(bytes(idx))
    return p


@pytest.mark.parametrize("what,message", [
    ("magic", "magic"), ("version", "version 2"), ("code", "dtype code 9"),
    ("float", "not an integer token type"), ("idx-truncated", "truncated"),
    ("bin-truncated", "data file is 16 bytes"), ("pointers", "sizes and pointers disagree"),
    ("vocab", "token id 65000 at position 8 is outside"),
])
def test_corrupt_mmap_gives_clear_error(tmp_path, what, message):
    prefix = _corrupt(tmp_path, what)
    with pytest.raises(UsageError, match=message) as info:
        IndexedDataset(prefix, vocab_size=50257)
    text = str(info.value)
    assert str(prefix) in text and "python data/preprocess_data.py" in text and "\n" not in text


def test_writer_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert not any(tmp_path.iterdir())
    with pytest.raises(UsageError, match="does not fit uint16"):
        IndexedWriter(tmp_path / "y", np.uint16).add_document([70000])


def _jsonl(path: Path, docs=DOCS, key="text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)),
                    encoding="utf-8")
    return path


def _args(**kw):
    base = ["--input", str(kw.pop("input")), "--output-prefix", str(kw.pop("prefix"))]
    return megatron.build_parser().parse_args(base + kw.pop("extra", []))


@needs_vocab
def test_preprocess_data_workers_give_identical_output(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", DOCS * 30)
    for workers in ("1", "2"):
        stats = megatron.preprocess_data(_args(input=src, prefix=tmp_path / f"w{workers}", extra=[
            "--append-eod", "--workers", workers, "--chunk-size", "7"]))
        assert stats.documents == 4 * 30 and stats.skipped == 30
    for ext in (".bin", ".idx"):
        assert (Path(f"{tmp_path}/w1_text_document{ext}").read_bytes()
                == Path(f"{tmp_path}/w2_text_document{ext}").read_bytes())
    ds, tok = IndexedDataset(tmp_path / "w1_text_document", vocab_size=50257), load_tokenizer()
    nonempty = [d for d in DOCS * 30 if d]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(d) + [50256] for d in nonempty]
    assert ds.dtype == np.uint16


@needs_vocab
def test_resumable_and_interrupted_runs(tmp_path, capsys):
    src = _jsonl(tmp_path / "c.jsonl")
    args = _args(input=src, prefix=tmp_path / "r", extra=["--workers", "1"])
    assert megatron.preprocess_data(args) is not None
    mtime = os.stat(f"{tmp_path}/r_text_document.bin").st_mtime_ns
    assert megatron.preprocess_data(args) is None
    assert "nothing to do" in capsys.readouterr().out
    assert os.stat(f"{tmp_path}/r_text_document.bin").st_mtime_ns == mtime
    # A run that dies half-way (bad line 6 after 5 good ones) leaves no output and no temp files.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(src.read_text() + "\n{not json\n")  # line 7, after a blank line 6
    with pytest.raises(UsageError, match=r"bad.jsonl:7: not valid JSON"):
        megatron.preprocess_data(_args(input=bad, prefix=tmp_path / "b", extra=["--workers", "2"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.jsonl", "c.jsonl", "r_text_document.bin", "r_text_document.idx", "r_text_document.source.json"]


@needs_vocab
def test_rerun_into_a_prefix_made_from_other_input_is_refused(tmp_path, capsys):
    """Issue 46 item 10: another --input into a complete prefix was "nothing to do" (stale data used as new)."""
    first, other = _jsonl(tmp_path / "c.jsonl"), _jsonl(tmp_path / "d.jsonl", DOCS[:2])
    megatron.preprocess_data(_args(input=first, prefix=tmp_path / "r", extra=["--workers", "1"]))
    with pytest.raises(UsageError, match=r"made from another file .*c.jsonl.*not --input .*d.jsonl.* pass another "
                                         r"--output-prefix, or --overwrite to rebuild") as err:
        megatron.preprocess_data(_args(input=other, prefix=tmp_path / "r", extra=["--workers", "1"]))
    assert "\n" not in str(err.value)
    assert megatron.preprocess_data(_args(input=first, prefix=tmp_path / "r", extra=["--workers", "1"])) is None
    os.utime(first, ns=(0, 0))  # the same file, changed since
    with pytest.raises(UsageError, match="made from the same path, since changed"):
        megatron.preprocess_data(_args(input=first, prefix=tmp_path / "r", extra=["--workers", "1"]))
    stats = megatron.preprocess_data(_args(input=other, prefix=tmp_path / "r", extra=["--workers", "1", "--overwrite"]))
    assert stats.documents == 2 and len(IndexedDataset(tmp_path / "r_text_document")) == 2
    assert megatron.preprocess_data(_args(input=other, prefix=tmp_path / "r", extra=["--workers", "1"])) is None


@needs_vocab
@pytest.mark.parametrize("impl", ["lazy", "cached"])
def test_megatron_old_dataset_impls_are_written_as_mmap_with_one_line(tmp_path, capsys, impl):
    src = _jsonl(tmp_path / "c.jsonl")
    capsys.readouterr()
    megatron.preprocess_data(_args(input=src, prefix=tmp_path / "r", extra=["--workers", "1", "--dataset-impl", impl]))
    assert f"--dataset-impl {impl}: mmap replaces Megatron's lazy and cached formats" in capsys.readouterr().out
    assert len(IndexedDataset(tmp_path / "r_text_document")) == 4


@needs_vocab
def test_merge_concatenates(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl")
    for name in ("a", "b"):
        megatron.preprocess_data(_args(input=src, prefix=tmp_path / name, extra=["--workers", "1"]))
    out = tmp_path / "m_text_document"
    megatron.merge(megatron.merge_parser().parse_args([
        "--datasets", f"{tmp_path}/a_text_document", f"{tmp_path}/b_text_document",
        "--output-prefix", str(out)]))
    a, m = IndexedDataset(tmp_path / "a_text_document"), IndexedDataset(out)
    assert len(m) == 2 * len(a) and m.doc_idx.tolist() == a.doc_idx.tolist() + [len(a) + d for d in a.doc_idx[1:]]
    assert [m[i].tolist() for i in range(len(m))] == [a[i].tolist() for i in range(len(a))] * 2


def test_gather_documents_writes_them_in_the_order_given_as_one_writer_would(tmp_path):
    """Three parts (one empty, one with an empty document and a document of two sequences), read as
    one numbering and written in a shuffled order: the bytes of writing those documents directly."""
    docs = [[[1, 2, 3]], [], [[4], [5, 6]], [[7, 8]], [[9] * 40], [[10], [11], [12]]]  # sequences per document
    parts = [docs[:3], [], docs[3:]]

    def write(prefix, documents):
        with IndexedWriter(prefix, np.uint16) as w:
            flat = [t for d in documents for seq in d for t in seq]
            w.add_documents_flat(np.array(flat, np.uint16), [len(seq) for d in documents for seq in d],
                                 [len(d) for d in documents])

    prefixes = [tmp_path / f"part{k}" for k in range(3)]
    for prefix, part in zip(prefixes, parts):
        write(prefix, part)
    order = np.random.default_rng(3).permutation(len(docs))
    megatron.gather_documents(prefixes, order, tmp_path / "gathered", chunk=4)
    write(tmp_path / "direct", [docs[i] for i in order])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"gathered{suffix}").read_bytes() == (tmp_path / f"direct{suffix}").read_bytes()
    with pytest.raises(ValueError, match="order lists 5 documents, the datasets hold 6"):
        megatron.gather_documents(prefixes, order[:5], tmp_path / "short")


def test_trained_tokenizer_loads_and_preprocesses(tmp_path, capsys):
    corpus = tmp_path / "tr.txt"
    corpus.write_text("\n".join([TURKISH] * 20), encoding="utf-8")
    out = tmp_path / "tr-bpe"
    code = subprocess.run([sys.executable, REPO / "data/train_tokenizer.py", "--input", corpus,
                           "--vocab-size", "300", "--output-dir", out],
                          capture_output=True, text=True)
    assert code.returncode == 0, code.stderr
    tok = load_tokenizer(out)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300 and tok.eot_id == 0
    ids = tok.encode(TURKISH)
    assert tok.decode(ids) == TURKISH and len(ids) < len(TURKISH.encode()) * 2 // 3  # merges learned
    stats = megatron.preprocess_data(_args(input=_jsonl(tmp_path / "tr.jsonl", [TURKISH] * 3),
                                           prefix=tmp_path / "tr", extra=[
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", str(out),
        "--append-eod", "--workers", "2"]))
    ds = IndexedDataset(tmp_path / "tr_text_document", vocab_size=300)
    assert stats.documents == 3 and ds[2].tolist() == ids + [0] and ds.dtype == np.uint16
    # inspect_data.py decodes with the recorded tokenizer, not GPT-2's vocabulary; gone, it says so.
    capsys.readouterr()
    inspect_main(inspect_parser().parse_args([str(tmp_path / "tr_text_document"), "--sample-tokens", "1000"]))
    assert f"sample ({len(ids) + 1} tokens, {tok.name}): {tok.decode(ids + [0])!r}" in capsys.readouterr().out
    shutil.rmtree(out)
    inspect_main(inspect_parser().parse_args([str(tmp_path / "tr_text_document")]))
    assert "sample: not decoded (the data was made with a tokenizer that does not load here" in capsys.readouterr().out


@needs_vocab
def test_load_tokenizer_from_folders(tmp_path):
    gpt2 = load_tokenizer().save(tmp_path / "g")
    # Megatron's gpt2-vocab.json has GPT-2's content but not our bytes: still GPT-2 (tiktoken).
    vocab_map = json.loads((gpt2 / "vocab.json").read_text(encoding="utf-8"))
    (gpt2 / "vocab.json").write_text(json.dumps(vocab_map, indent=1), encoding="utf-8")
    assert isinstance(load_tokenizer(gpt2), GPT2Tokenizer)
    # The same files as a HF tokenizer.json: loads as HFTokenizer.
    hf = vocab.byte_level_bpe(ASSETS / vocab.VOCAB_FILE, ASSETS / vocab.MERGES_FILE)
    hf.save(str(tmp_path / "tokenizer.json"))
    other = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(other, HFTokenizer) and other.encode("Hello world") == [15496, 995]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds neither"):
        load_tokenizer(tmp_path / "empty")


def _tiny_wiki(folder: Path, n: int = 6) -> None:
    (folder / "AA").mkdir(parents=True)
    body = "".join(f'<doc id="{i}" url="u" title="T{i}">\nT{i}\n\n{DOCS[4]} {i}\nSecond line.\n\n</doc>\n'
                   for i in range(n))
    (folder / "AA" / "wiki_00").write_text(body, encoding="utf-8")


@needs_vocab
def test_pickle_has_one_eos_per_document(tmp_path):
    _tiny_wiki(tmp_path / "ex")
    args = wikipedia.build_parser().parse_args([
        "--input-file-path", str(tmp_path / "ex"), "--output-file-path", str(tmp_path / "out"),
        "--workers", "1"])
    stats = wikipedia.wikipedia_preprocess(args)
    docs = pickle.loads((tmp_path / "out" / wikipedia.PKL_NAME).read_bytes())
    assert stats.documents == 6 and len(docs) == 6
    assert all(d[-1] == 50256 and d.count(50256) == 1 for d in docs)
    assert wikipedia.wikipedia_preprocess(args) is None  # second run does nothing


@needs_vocab
def test_tfrecord_shards_indexes_and_identity(tmp_path):
    from tfrecord.reader import tfrecord_loader
    from tfrecord.tools.tfrecord2idx import create_index

    docs = [list(range(1, n)) for n in (300, 40, 129, 5)]
    pkl = tmp_path / "d.pkl"
    pkl.write_bytes(pickle.dumps(docs))
    # lengths 299, 39, 128, 4: 2 full windows (tail 43 < 64 dropped), 0, 1, 0
    for seq, expect in ((0, 4), (128, 3)):
        out = tmp_path / f"tf{seq}"
        n = tfrecord_writer.write_into_tfrecord(tfrecord_writer.build_parser().parse_args([
            "--input-file-path", str(pkl), "--output-file-path", str(out), "--seq-length", str(seq),
            "--num-output", "3"]))
        assert n == expect
        for i in range(3):
            create_index(str(out / f"data_{i}.tfrecord"), str(tmp_path / "ref.index"))
            assert (out / f"data_{i}.index").read_text() == (tmp_path / "ref.index").read_text()
    records = [r["input_ids"].tolist() for i in range(3) for r in tfrecord_loader(
        str(tmp_path / "tf0" / f"data_{i}.tfrecord"), None, ["input_ids"])]
    assert sorted(records) == sorted(docs)  # lossless with --seq-length 0
    assert list(tfrecord_writer.windows(np.arange(300), 128, 128))[-1].tolist() == list(range(128, 256))
    assert tfrecord_writer.is_complete(tmp_path / "tf0", 3)
    (tmp_path / "tf0" / "data_2.index").unlink()
    assert not tfrecord_writer.is_complete(tmp_path / "tf0", 3)


@needs_vocab
def test_describe_each_format(tmp_path):
    handbuilt_mmap(tmp_path / "m", FIXTURE)
    s = describe(str(tmp_path / "m.bin"))
    assert (s.documents, s.tokens, s.dtype, s.min_id, s.max_id) == (3, 9, "uint16", 1, 65000)
    (tmp_path / "d.pkl").write_bytes(pickle.dumps([[5, 6], [7]]))
    s = describe(str(tmp_path / "d.pkl"))
    assert (s.documents, s.tokens, s.min_id, s.max_id) == (2, 3, 5, 7)
    with pytest.raises(UsageError, match="not found"):
        describe(str(tmp_path / "absent"))


def test_openwebtext_extract_and_merge(tmp_path):
    from gpt2forge.preprocess.sources import extract_and_merge, openwebtext_parser

    src = tmp_path / "owt"
    src.mkdir()
    (tmp_path / "0001-abc.txt").write_text("first text", encoding="utf-8")
    with tarfile.open(src / "urlsf_subset00-1_data.xz", "w:xz") as tar:
        tar.add(tmp_path / "0001-abc.txt", arcname="0001-abc.txt")
    out = tmp_path / "owt.json"
    args = openwebtext_parser().parse_args([str(src), "--output", str(out), "--workers", "1"])
    assert extract_and_merge(args) == 1
    assert json.loads(out.read_text()) == {"text": "first text", "url": "0001-abc"}


def _run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=cwd, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _script(cmd: str, cwd: Path, monkeypatch, capsys) -> str:
    """Run a README line `python[3] <data script> ARGS` in this process (a subprocess would spend
    seconds importing torch): the real script's `main` parses the real argv. Returns stdout."""
    import importlib.util
    import shlex

    argv = shlex.split(cmd)
    assert argv[0] in ("python", "python3") and argv[1].endswith(".py"), cmd
    path = Path(argv[1]) if Path(argv[1]).is_absolute() else REPO / argv[1]
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    assert module.main(argv[2:]) == 0, capsys.readouterr()
    return capsys.readouterr().out


@pytest.mark.slow
@needs_vocab
def test_seed_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """Seed 000 (Megatron-DeepSpeed README) and seed 004 (the reference README), verbatim
    except for paths: `tools/` -> our `data/`, and `python write_into_tfrecord.py` run from the
    preprocessed folder as the README does."""
    shutil.copy(ASSETS / "vocab.json", tmp_path / "gpt2-vocab.json")
    shutil.copy(ASSETS / "merges.txt", tmp_path / "gpt2-merges.txt")
    _jsonl(tmp_path / "my-corpus.json", DOCS)
    _script("python data/preprocess_data.py --input my-corpus.json --output-prefix my-gpt2 "
            "--vocab gpt2-vocab.json --dataset-impl mmap --tokenizer-type GPT2BPETokenizer "
            "--merge-file gpt2-merges.txt --append-eod --workers 8", tmp_path, monkeypatch, capsys)
    made = IndexedDataset(tmp_path / "my-gpt2_text_document", vocab_size=50257)
    assert made.num_documents == len(DOCS) and len(made) == 4  # the empty text keeps its document entry
    for part in ("p1", "p2"):
        for ext in (".bin", ".idx"):
            shutil.copy(tmp_path / f"my-gpt2_text_document{ext}",
                        tmp_path / f"meg-{part}_text_document{ext}")
    _script("python data/merge_preprocessed_data.py --datasets meg-p1_text_document "
            "meg-p2_text_document --output-prefix meg-gpt2_oscar_text_document",
            tmp_path, monkeypatch, capsys)
    assert len(IndexedDataset(tmp_path / "meg-gpt2_oscar_text_document")) == 8
    # Seed 004, step 3 and the TFRecord section (the index loop is shell, run by bash).
    _tiny_wiki(tmp_path / "extracted")
    _script("python3 ./data/wikipedia_preprocess.py --input-file-path extracted "
            "--output-file-path preprocessed", tmp_path, monkeypatch, capsys)
    pre = tmp_path / "preprocessed"
    (pre / "tfrecords").mkdir()
    _script(f"python {REPO}/data/write_into_tfrecord.py", pre, monkeypatch, capsys)
    _run("for f in *.tfrecord; do python3 -m tfrecord.tools.tfrecord2idx $f "
         "`basename $f .tfrecord`.index; done", pre / "tfrecords")
    assert tfrecord_writer.is_complete(pre / "tfrecords", 4)
    out = _script("python data/inspect_data.py data_0.tfrecord", pre / "tfrecords", monkeypatch, capsys)
    assert "format: TFRecord (feature input_ids, index present)" in out


def test_wikipedia_extract_script_on_tiny_dump(tmp_path):
    pytest.importorskip("wikiextractor")
    dump = tmp_path / "wikidump.xml"
    # WikiExtractor reads the dump line by line: one tag per line, as in real dumps.
    page = ("<page>\n<title>{t}</title>\n<ns>0</ns>\n<id>{i}</id>\n<revision>\n<id>{i}</id>\n"
            "<text xml:space=\"preserve\">'''{t}''' is a [[topic]] about things.\n\n== History ==\n"
            "More text.</text>\n</revision>\n</page>\n")
    dump.write_text("<mediawiki>\n<siteinfo>\n<sitename>W</sitename>\n<base>https://en.wikipedia"
                    ".org/wiki/Main</base>\n<namespaces>\n<namespace key=\"0\" />\n"
                    "<namespace key=\"10\">Template</namespace>\n</namespaces>\n"
                    "</siteinfo>\n" + "".join(page.format(t=t, i=i) for i, t in
                                               enumerate(["Alpha", "Beta"], 1))
                    + "</mediawiki>\n", encoding="utf-8")
    _run(f"{REPO}/data/wikipedia_extract.sh {dump} {tmp_path}/extracted 1", tmp_path)
    text = (tmp_path / "extracted" / "AA" / "wiki_00").read_text()
    assert text.count("<doc ") == 2 and "Alpha is a topic about things." in text
    again = _run(f"{REPO}/data/wikipedia_extract.sh {dump} {tmp_path}/extracted 1", tmp_path)
    assert "nothing to do" in again.stdout


def test_trainer_takes_vocab_from_tokenizer_and_ships_it(tmp_path, capsys):
    from gpt2forge.cli import train_main
    from gpt2forge.preprocess.bpe import train_bpe

    tok = train_bpe([TURKISH] * 20, vocab_size=300)
    tok.save(tmp_path / "tok")
    docs = [tok.encode(TURKISH) + [tok.eot_id] for _ in range(12)]
    (tmp_path / "d.pkl").write_bytes(pickle.dumps(docs))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_positions": 64,
                               "n_embd": 32, "n_layer": 2, "n_head": 2}))
    out = tmp_path / "ckpt"
    assert train_main(["--model-config", str(cfg), "--dataset", "pickle", "--input-files",
                       str(tmp_path / "d.pkl"), "--tokenizer-name-or-path", str(tmp_path / "tok"),
                       "--max-len", "16", "--batch-size", "2", "--gradient-accumulation", "1",
                       "--device-iterations", "1", "--epochs", "1", "--num-workers", "0",
                       "--checkpoint-output-dir", str(out)]) == 0
    saved = json.loads((out / "epoch_1" / "config.json").read_text())
    assert saved["vocab_size"] == 300  # from the tokenizer, not the config's 96
    shipped = load_tokenizer(out / "epoch_1")
    assert isinstance(shipped, HFTokenizer) and shipped.encode(TURKISH) == docs[0][:-1]


@needs_vocab
def test_same_corpus_same_tokens_in_every_format(tmp_path):
    """jsonl -> mmap, one-article-per-line text -> pkl, and both -> TFRecord (whole documents)
    hold the same documents (pkl and TFRecord are shuffled, so compared as sorted lists)."""
    from tfrecord.reader import tfrecord_loader

    texts = [d for d in DOCS if d]
    megatron.preprocess_data(_args(input=_jsonl(tmp_path / "c.jsonl", texts), prefix=tmp_path / "m",
                                   extra=["--append-eod", "--workers", "2"]))
    (tmp_path / "articles.txt").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    wikipedia.wikipedia_preprocess(wikipedia.build_parser().parse_args([
        "--input-file-path", str(tmp_path / "articles.txt"), "--output-file-path", str(tmp_path),
        "--min-length", "1", "--workers", "1"]))
    mm = IndexedDataset(tmp_path / "m_text_document")
    from_mmap = sorted(d.tolist() for d in mm.documents())
    from_pkl = sorted(pickle.loads((tmp_path / wikipedia.PKL_NAME).read_bytes()))
    assert from_mmap == from_pkl and len(from_pkl) == len(texts)
    for name, src in (("tf_m", tmp_path / "m_text_document"), ("tf_p", tmp_path / wikipedia.PKL_NAME)):
        tfrecord_writer.write_into_tfrecord(tfrecord_writer.build_parser().parse_args([
            "--input-file-path", str(src), "--output-file-path", str(tmp_path / name),
            "--seq-length", "0", "--num-output", "2"]))
        records = sorted(r["input_ids"].tolist() for i in range(2) for r in tfrecord_loader(
            str(tmp_path / name / f"data_{i}.tfrecord"), None, ["input_ids"]))
        assert records == from_mmap


def test_bad_json_lines_name_file_and_line_in_the_tokenizer_trainer_and_the_wikipedia_reader(tmp_path):
    from gpt2forge.preprocess.bpe import iter_texts
    from gpt2forge.preprocess.sources import iter_extracted

    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
    with pytest.raises(UsageError, match=r"c\.jsonl:3: no 'text' field \(fields: body\); .*--json-key"):
        list(iter_texts([bad], "text", tqdm(disable=True)))
    wiki = tmp_path / "wiki_00"
    wiki.write_text('{"id": "1", "text": "an article"}\n{"id": "2", "text": 7}\n')
    with pytest.raises(UsageError, match=r"wiki_00:2: the 'text' field is a JSON int, not a string"):
        list(iter_extracted(wiki))
