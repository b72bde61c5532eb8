"""--dataset jsonl|text: the tokenized cache equals preprocess_data.py's output, is rebuilt when an input or the
tokenizer changes and reused otherwise, is built once by concurrent runs; --loss-on completion items; bad input."""

import contextlib
import io
import json
import multiprocessing as mp
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from gpt2forge.cli import train_main
from gpt2forge.core.errors import UsageError
from gpt2forge.core.labels import IGNORE_INDEX
from gpt2forge.data import DataRequest, collate, load_datasets, rawtext, split_batch
from gpt2forge.data.args import DataArgs
from gpt2forge.data.indexed import IndexedDataset
from gpt2forge.data.text_cache import DEFAULT_DIR
from gpt2forge.preprocess import megatron
from gpt2forge.text.tokenizer import load_tokenizer

GPT2_VOCAB = 50257
TEXTS = ["Hello world. " * 5, "Ünïcödé — naïve café\nsecond line", "  leading spaces and\ttabs ", "x",
         "<|endoftext|> is plain text here", "数字 123 456 and emoji 🙂 " * 3]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}, ensure_ascii=i % 2 == 0) + "\n"
                            for i, t in enumerate(texts)), encoding="utf-8")
    return path


def request(files, dataset: str = "jsonl", max_len: int = 8, vocab_size: int = GPT2_VOCAB, **data) -> DataRequest:
    """A raw-text request; `data` are DataArgs fields."""
    return DataRequest(DataArgs(dataset=dataset, input_files=list(map(str, files)), **data), max_len, vocab_size)


def cache_of(files, dataset: str = "jsonl", **kw) -> Path:
    files = rawtext.resolve_inputs(tuple(map(str, files)), dataset)
    return rawtext.cached_prefix(files, dataset, request(files, dataset, **kw))


def test_cache_equals_preprocess_data_output(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS * 20)
    args = megatron.build_parser().parse_args(["--input", str(src), "--output-prefix", str(tmp_path / "ref"),
                                               "--append-eod", "--workers", "1"])
    megatron.preprocess_data(args)
    ref = IndexedDataset(tmp_path / "ref_text_document")
    # Small pieces and no in-process shortcut: several pieces tokenized by a pool of worker processes.
    monkeypatch.setattr(rawtext, "PIECE_BYTES", 300)
    monkeypatch.setattr(rawtext, "PARALLEL_BYTES", 0)
    assert len(rawtext.jsonl_pieces(src, 300)) > 4
    ours = IndexedDataset(cache_of([src]))
    assert ours.dtype == ref.dtype
    assert np.array_equal(ours.sizes, ref.sizes) and np.array_equal(ours.doc_idx, ref.doc_idx)
    assert np.array_equal(np.asarray(ours.document(0)), np.asarray(ref.document(0)))
    assert (tmp_path / "ref_text_document.bin").read_bytes() == Path(f"{ours.prefix}.bin").read_bytes()


def test_text_files_are_one_document_each(tmp_path):
    for name, text in [("b.txt", TEXTS[1]), ("a.txt", TEXTS[0] + "\n\n" + TEXTS[5])]:
        (tmp_path / name).write_text(text, encoding="utf-8")
    data = IndexedDataset(cache_of([tmp_path / "*.txt"], "text"))
    tok = load_tokenizer()
    expected = [tok.encode(TEXTS[0] + "\n\n" + TEXTS[5]) + [tok.eot_id], tok.encode(TEXTS[1]) + [tok.eot_id]]
    assert [data[i].tolist() for i in range(len(data))] == expected  # sorted glob: a.txt, then b.txt


def test_changed_input_or_tokenizer_rebuilds_and_unchanged_reuses(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS * 3)
    first = cache_of([src])
    assert "tokenizing 1 file(s)" in capsys.readouterr().out
    manifest = next((tmp_path / DEFAULT_DIR).glob("*.manifest.json"))
    written = manifest.stat().st_mtime_ns

    assert cache_of([src]) == first  # how fast: benchmarks/rawtext_tokenize.py
    out = capsys.readouterr().out
    assert "reusing the tokenized cache" in out and "tokenizing" not in out
    assert manifest.stat().st_mtime_ns == written

    os.utime(src, ns=(written + 10**9, written + 10**9))  # touched, same bytes: still reused
    assert cache_of([src]) == first and "reusing" in capsys.readouterr().out

    write_jsonl(src, TEXTS * 3 + ["one more document"])
    second = cache_of([src])
    assert second != first and "tokenizing 1 file(s)" in capsys.readouterr().out
    assert len(IndexedDataset(second)) == len(IndexedDataset(first)) + 1

    folder = load_tokenizer().save(tmp_path / "tok")  # same ids, other tokenizer files: a new build
    third = cache_of([src], tokenizer_name_or_path=str(folder))
    assert third not in (first, second) and "tokenizing" in capsys.readouterr().out
    assert cache_of([src], tokenizer_name_or_path=str(folder)) == third and "reusing" in capsys.readouterr().out
    (folder / "tokenizer_config.json").write_text("{}")  # the tokenizer's files changed, same path
    assert cache_of([src], tokenizer_name_or_path=str(folder)) != third and "tokenizing" in capsys.readouterr().out
    assert not list((tmp_path / DEFAULT_DIR).glob(".*.tmp"))  # no temporaries left behind


def _build_in_child(src: str, cache: str, queue, started, release) -> None:
    """Child process: load the jsonl dataset, its build (if it builds) held open until `release`."""
    original = rawtext.write_build

    def slow_build(*args, **kwargs):
        started.set()
        release.wait(30)
        return original(*args, **kwargs)
    rawtext.write_build = slow_build
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        split = load_datasets(request([src], data_cache_dir=cache))
        total = int(sum(int(split.train[i].sum()) for i in range(len(split.train))))
    queue.put((out.getvalue(), total))


def test_concurrent_runs_build_one_cache_and_both_read_it(tmp_path):
    src = str(write_jsonl(tmp_path / "d.jsonl", TEXTS * 10))
    ctx = mp.get_context("fork")
    queue, started, release = ctx.Queue(), ctx.Event(), ctx.Event()
    first = ctx.Process(target=_build_in_child, args=(src, str(tmp_path / "cache"), queue, started, release))
    first.start()
    assert started.wait(60), "the first run never started its build"
    second = ctx.Process(target=_build_in_child, args=(src, str(tmp_path / "cache"), queue, ctx.Event(), ctx.Event()))
    second.start()
    time.sleep(1.0)
    assert second.is_alive() and not list((tmp_path / "cache").glob("*.manifest.json"))  # it waits
    release.set()
    results = [queue.get(timeout=60) for _ in range(2)]
    first.join(30), second.join(30)
    assert first.exitcode == 0 and second.exitcode == 0
    logs = sorted(out for out, _ in results)
    built = [out for out in logs if "tokenizing" in out]
    assert len(built) == 1, logs
    waited = [out for out in logs if "waiting for another process" in out]
    assert len(waited) == 1 and "reusing the tokenized cache" in waited[0]
    assert results[0][1] == results[1][1] > 0
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1


def test_loss_on_completion_scores_only_completion_tokens(tmp_path):
    tok = load_tokenizer()
    pairs = [(f"Question {i}: what is {i} plus {i}?", f" It is {2 * i}.") for i in range(30)]
    pairs.append(("A very long prompt " * 20, " short answer"))
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    max_len = 24
    split = load_datasets(request([path], max_len=max_len, loss_on="completion", split="8,2,0"))
    assert len(split.train) + len(split.val) == len(pairs) and len(split.val) == round(len(pairs) * 0.2)
    items = [split.train[i] for i in range(len(split.train))] + [split.val[i] for i in range(len(split.val))]
    assert all(item.shape == (2, max_len + 1) for item in items)
    _, labels = split_batch(collate(items))
    for (prompt, completion), row in zip(pairs, labels.tolist()):
        p, c = tok.encode(prompt), tok.encode(completion) + [tok.eot_id]
        p = p[max(len(p) + len(c) - (max_len + 1), 0):]  # cut from the left of the prompt
        full = p + c
        expected = [full[t + 1] if len(p) <= t + 1 < len(full) else IGNORE_INDEX for t in range(max_len)]
        assert row == expected
    assert sum(v != IGNORE_INDEX for v in labels[-1].tolist()) == len(tok.encode(pairs[-1][1])) + 1


def _bad(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("dataset,name,content,kw,match", [
    ("jsonl", "bad.jsonl", b'{"text": "a"}\n\n{"text": oops}\n', {}, r"bad\.jsonl:3: not valid JSON"),
    ("jsonl", "bad.jsonl", b'{"text": "a"}\n{"body": "b"}\n', {}, r"bad\.jsonl:2: no 'text' field .*--json-key"),
    ("jsonl", "bad.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', {}, r"bad\.jsonl:2: invalid UTF-8"),
    ("jsonl", "bad.jsonl", b'["text"]\n', {}, r"bad\.jsonl:1: a JSON list, not an object"),
    ("jsonl", "bad.jsonl", b"\n  \n", {}, r"bad\.jsonl: the file is empty"),
    ("text", "bad.txt", b"", {}, r"bad\.txt: the file is empty"),
    ("text", "bad.txt", b"fine\nstill fine\n\xff\xfe\n", {}, r"bad\.txt:3: invalid UTF-8"),
    ("jsonl", "bad.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n', {"loss_on": "completion"},
     r"bad\.jsonl:2: no 'completion' field .*--loss-on completion"),
    ("jsonl", "bad.jsonl", b'{"prompt": "a", "completion": "b"}\n', {}, r"bad\.jsonl:1: .*add --loss-on completion"),
])
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, dataset, name, content, kw, match):
    path = _bad(tmp_path, name, content)
    with pytest.raises(UsageError, match=match) as err:
        load_datasets(request([path], dataset, **kw))
    assert "\n" not in str(err.value)
    cache = tmp_path / DEFAULT_DIR
    assert not list(cache.glob("*.bin")) and not list(cache.glob("*.manifest.json")) and not list(cache.glob(".*"))


def test_bad_line_found_by_a_worker_process(tmp_path, monkeypatch):
    monkeypatch.setattr(rawtext, "PIECE_BYTES", 64)
    monkeypatch.setattr(rawtext, "PARALLEL_BYTES", 0)
    path = _bad(tmp_path, "late.jsonl", b'{"text": "fine"}\n' * 30 + b'{"txt": "typo"}\n' + b'{"text": "ok"}\n' * 5)
    with pytest.raises(UsageError, match=r"^.*late\.jsonl:31: no 'text' field \(fields: txt\)") as err:
        load_datasets(request([path]))
    assert "\n" not in str(err.value)
    assert not [p for p in (tmp_path / DEFAULT_DIR).iterdir() if not p.name.endswith(".lock")]


def test_inputs_that_name_nothing_and_out_of_vocabulary_ids(tmp_path):
    with pytest.raises(UsageError, match=r"--input-files .*missing\.txt: no such file"):
        load_datasets(request([tmp_path / "missing.txt"], "text"))
    with pytest.raises(UsageError, match=r"--input-files .*nope/\*\.jsonl: matches no file"):
        load_datasets(request([tmp_path / "nope" / "*.jsonl"]))
    src = write_jsonl(tmp_path / "e.jsonl", TEXTS)
    with pytest.raises(UsageError, match=r"token ids up to 50256 but the model's vocabulary has 96"):
        load_datasets(request([src], vocab_size=96))
    with pytest.raises(UsageError, match=r"--loss-on completion reads .* --dataset jsonl"):
        as_text = request([src], "text")
        as_text.data.loss_on = "completion"  # past DataArgs' own check: the reader refuses it too
        load_datasets(as_text)
    with pytest.raises(UsageError, match=r"cannot create the tokenized-data cache .*--data-cache-dir"):
        load_datasets(request([src], data_cache_dir=str(src / "cache")))  # under a file: not a folder


def test_weighted_input_files_give_one_cache_per_corpus(tmp_path, monkeypatch):
    a = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    b = write_jsonl(tmp_path / "b.jsonl", TEXTS[::-1])
    seen = []
    monkeypatch.setattr(rawtext.mmap, "load", lambda req, labels: seen.append(req))
    rawtext.load(request(["0.7", a, "0.3", tmp_path / "b*.jsonl"]))
    (req,) = seen
    weights, prefixes = tuple(req.data.input_files[::2]), req.data.input_files[1::2]
    assert req.data.dataset == "mmap" and weights == ("0.7", "0.3") and len(set(prefixes)) == 2
    assert [IndexedDataset(p).sizes.tolist() for p in prefixes] == \
        [IndexedDataset(cache_of([a])).sizes.tolist(), IndexedDataset(cache_of([b])).sizes.tolist()]


STEP = re.compile(r"^step \d+ of epoch \d+, loss: ([^,\s]+),", re.M)


@pytest.mark.slow
@pytest.mark.parametrize("loss_on", ["all", "completion"])
def test_three_training_steps_from_jsonl(tmp_path, make_tiny_config, capsys, loss_on):
    if loss_on == "all":
        write_jsonl(tmp_path / "docs.jsonl", TEXTS * 10)
    else:
        (tmp_path / "docs.jsonl").write_text("".join(
            json.dumps({"prompt": f"Q{i}: {t}", "completion": f" A{i}."}) + "\n" for i, t in enumerate(TEXTS * 5)))
    cfg = make_tiny_config(vocab_size=GPT2_VOCAB)
    code = train_main(["--model-config", str(cfg), "--dataset", "jsonl", "--input-files", str(tmp_path / "*.jsonl"),
                       "--loss-on", loss_on, "--max-len", "16", "--batch-size", "2", "--gradient-accumulation", "1",
                       "--device-iterations", "1", "--training-steps", "3", "--num-workers", "0",
                       "--checkpoint-output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    losses = [float(x) for x in STEP.findall(out)]
    assert len(losses) == 3 and all(np.isfinite(losses)) and "tokenizing 1 file(s)" in out
