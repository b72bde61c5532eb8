"""Decontamination: planted evaluation passages are removed (drop) or cut out (cut); others kept."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from gpt2forge.preprocess.decontaminate import (
    DecontaminateConfig,
    NgramSet,
    cut,
    decontaminate_file,
    eval_ngrams,
    plain_words,
    words,
)

ROOT = Path(__file__).resolve().parents[2]
FILLER = " ".join(f"The farmer counted {i} sheep in the northern field before the rain arrived." for i in range(40))
UNRELATED = "A completely different story about ships, harbours and the long voyage home. " * 20


def write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_words_lowercase_and_strip_punctuation():
    assert words("Hello, World! -- it's")[0] == ["hello", "world", "its"]


def test_plain_words_equal_words_on_any_text():
    """drop mode's fast split (the whole text lower-cased and stripped, then split) gives the words of
    the per-word one, on random mixtures of cased letters (final sigma, dotted I), punctuation and
    Unicode whitespace."""
    rng = random.Random(0)
    alphabet = "aZΣσςİIıßǅĲ .,;—-'\"\u00a0\u2028\t\n\x1c\x85!?…«»[]\\^“”"
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert plain_words(text) == words(text)[0], repr(text)
    ascii = [chr(c) for c in range(128)]  # the bytes path: every ASCII character, the separators 0x1C-0x1F too
    for _ in range(5000):
        text = "".join(rng.choice(ascii) for _ in range(rng.randint(0, 40)))
        assert plain_words(text) == words(text)[0], repr(text)


def test_an_ngram_set_finds_what_a_binary_search_of_its_table_finds():
    """The bitmap only drops hashes the table cannot hold: hashes sharing a member's low 24 bits but
    not its high ones are searched and not found, members are found at their index."""
    rng = np.random.default_rng(0)
    table = np.unique(rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True))
    near = table[:300] ^ np.uint64(1 << 40)  # same low bits, another hash
    h = np.concatenate([table[::7], near, rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True)])
    h = h[rng.permutation(len(h))]
    idx = np.minimum(np.searchsorted(table, h), len(table) - 1)
    want = np.flatnonzero(table[idx] == h)
    at, found = NgramSet(table).find(h)
    assert len(want) == len(table[::7]) and np.array_equal(at, want) and np.array_equal(found, idx[want])
    assert [len(x) for x in NgramSet(table[:0]).find(h)] == [0, 0] and len(NgramSet(table).find(h[:0])[0]) == 0


def passage(tmp_path, eval_data: Path | None) -> tuple[Path, str]:
    """An evaluation file and one of its passages: the real LAMBADA test set when present."""
    if eval_data is not None:
        lambada = eval_data / "lambada" / "lambada_test.jsonl"
        with lambada.open(encoding="utf-8") as f:
            return lambada, json.loads(f.readline())["text"]
    text = " ".join(f"evaluation sentence number {i} about a lighthouse keeper and his dog." for i in range(10))
    return write(tmp_path / "eval.jsonl", [{"text": text}]), text


def test_planted_lambada_passage_is_dropped_and_unrelated_kept(tmp_path, eval_data_or_none):
    eval_file, text = passage(tmp_path, eval_data_or_none)
    planted = FILLER + " " + text.replace("\n", " ").upper() + " " + FILLER  # case and spacing differ
    src = write(tmp_path / "train.json", [{"text": planted, "url": "p"}, {"text": UNRELATED, "url": "u"}])
    summary = decontaminate_file(src, tmp_path / "out.json", [str(eval_file)], DecontaminateConfig(), workers=0)
    out = [json.loads(ln)["url"] for ln in (tmp_path / "out.json").read_text().splitlines()]
    assert out == ["u"] and summary.docs_contaminated == 1


def test_cut_mode_removes_the_span_and_keeps_both_sides(tmp_path):
    evaluation = " ".join(f"secret benchmark words {i} nobody should train upon ever" for i in range(3))
    table = eval_ngrams([write(tmp_path / "e.jsonl", [{"text": evaluation}])], 13)
    doc = FILLER + " " + evaluation + " " + UNRELATED
    pieces, matched = cut(doc, table, DecontaminateConfig(mode="cut", margin=10))
    assert matched > 0 and len(pieces) == 2
    assert "secret" not in " ".join(pieces)
    assert pieces[0].startswith("The farmer") and pieces[1].endswith("voyage home.")
    assert cut(UNRELATED, table, DecontaminateConfig(mode="cut")) == ([UNRELATED], 0)


def test_plain_text_eval_file_and_ngram_flag(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(" = Title = \n\n The quick brown fox jumps over the lazy dog . \n")
    table = eval_ngrams([tmp_path / "wiki.test.raw"], 5)
    assert cut("I saw the quick brown fox jumps over it", table, DecontaminateConfig(ngram=5)) == ([], 2)


def test_command_cut_mode_and_bad_input(tmp_path):
    eval_file = write(tmp_path / "e.jsonl", [{"text": FILLER}])
    src = write(tmp_path / "train.json", [{"text": UNRELATED + FILLER + UNRELATED}])
    cmd = [sys.executable, str(ROOT / "data" / "filter_ngrams.py"), "--input", str(src), "--output",
           str(tmp_path / "out.json"), "--eval", str(eval_file), "--mode", "cut"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(ln) for ln in (tmp_path / "out.json").read_text().splitlines()]
    assert [o["piece"] for o in out] == [0, 1] and "farmer" not in out[0]["text"] + out[1]["text"]
    src.write_text('{"text": 3}\n')
    proc = subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "train.json:1:" in proc.stderr and proc.stderr.count("\n") == 1


def test_real_lambada_table_is_compact(eval_data):
    table = eval_ngrams([eval_data / "lambada" / "lambada_test.jsonl"], 13)
    assert table.dtype.itemsize == 8 and 100_000 < len(table) < 1_000_000


BOILERPLATE = "this article is licensed under the creative commons attribution share alike license version three"
PASSAGE = BOILERPLATE + " the lighthouse keeper named orlando fed seventeen gulls every morning before sunrise"
SHORT = "seven silent swans slept beside the frozen mill pond"  # 9 words: whole with --min-ngram-size 8


def test_megatron_flags_cut_rare_ngrams_and_keep_common_ones(tmp_path):
    """Megatron's tools/openwebtext command line: --tasks lambada --lambada-path L --dedup-dataset FILE KEY
    --output F cuts (its only mode) what overlaps LAMBADA, counts whole short texts (8+ words), and keeps
    n-grams that 10 or more training documents hold (--key-threshold: boilerplate, not contamination)."""
    lambada = write(tmp_path / "lambada.jsonl", [{"text": PASSAGE}, {"text": SHORT}])
    docs = [{"content": f"{FILLER} {PASSAGE} {UNRELATED}", "id": "passage"},
            {"content": f"{FILLER} {SHORT} {UNRELATED}", "id": "short"}]
    docs += [{"content": f"{UNRELATED[:300]} copy {i} {BOILERPLATE} {FILLER[:300]}", "id": f"b{i}"} for i in range(10)]
    src = write(tmp_path / "train.json", docs)
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "data" / "filter_ngrams.py"), "--tasks", "lambada", "--lambada-path",
           str(lambada), "--dedup-dataset", str(src), "content", "--output", str(out), "--num-threads", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    pieces = {i: [r["content"] for r in rows if r["id"] == i] for i in ("passage", "short")}
    assert len(pieces["passage"]) == 2 and not any("orlando" in p for p in pieces["passage"])
    assert len(pieces["short"]) == 2 and not any("swans" in p for p in pieces["short"])
    assert [r for r in rows if r["id"].startswith("b")] == docs[2:]  # boilerplate in 11 documents: kept whole
    # without the threshold the boilerplate documents are cut too
    proc = subprocess.run(cmd + ["--key-threshold", "100", "--overwrite"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not any(BOILERPLATE in json.loads(ln)["content"] for ln in out.read_text().splitlines())
    for extra, needle in [(["--tasks", "squad"], "--tasks squad: Megatron read it from the Hugging Face hub"),
                          (["--tasks", "lambada"], "--tasks lambada needs --lambada-path")]:
        bad = [sys.executable, str(ROOT / "data" / "filter_ngrams.py"), "--dedup-dataset", str(src), "content",
               "--output", str(tmp_path / "x.json"), *extra]
        proc = subprocess.run(bad, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_saved_ngram_tables_load_instead_of_the_evaluation_files(tmp_path):
    lambada = write(tmp_path / "lambada.jsonl", [{"text": PASSAGE}])
    src = write(tmp_path / "train.json", [{"text": f"{FILLER} {PASSAGE} {UNRELATED}"}, {"text": UNRELATED}])
    cfg = DecontaminateConfig(mode="cut", min_ngram=8, key_threshold=10)
    first = decontaminate_file(src, tmp_path / "a.json", [str(lambada)], cfg, workers=0,
                               save_path=str(tmp_path / "t.npz"))
    second = decontaminate_file(src, tmp_path / "b.json", [], cfg, workers=0, load_path=str(tmp_path / "t.npz"))
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
    assert first.docs_contaminated == second.docs_contaminated == 1
