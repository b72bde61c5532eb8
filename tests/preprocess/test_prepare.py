"""prepare_corpus.py: the whole path on a planted corpus, the manifest, skipping, re-running,
interruption, bad input, .bin/.idx that trains, and the seed's five commands as users type them."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2forge.core.errors import UsageError
from gpt2forge.data.indexed import IndexedDataset
from gpt2forge.preprocess import dedup, prepare
from gpt2forge.preprocess.prepare import STAGES, build_parser, prepare_corpus
from gpt2forge.text import vocab

ROOT = Path(__file__).resolve().parents[2]
ASSETS = vocab.asset_dir()
TR = ("Belediye meclisi salı günü, sakinlerin akşamları çalışmak için sıcak ve sessiz bir yer istemesi üzerine "
      "şehir kütüphanesinin çalışma saatlerini kış boyunca uzatma kararı aldı. ") * 12
STEP = re.compile(r"^step \d+ of epoch \d+, loss: ", re.M)
PLANTED = {"lang": 1, "min_tokens": 1, "exact_duplicate": 1, "near_duplicate": 2, "contaminated": 1}


def _words() -> list[str]:
    """3000 common English words: GPT-2's lowest-ranked whole-word tokens."""
    table = json.loads((ASSETS / vocab.VOCAB_FILE).read_text(encoding="utf-8"))
    ordered = sorted(table.items(), key=lambda kv: kv[1])
    whole = [w[1:] for w, _ in ordered if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()]
    return [w for w in whole if len(w) > 2][:3000]


def english(rng: np.random.Generator, words: list[str], sentences: int = 25) -> str:
    """~2 KB of English word salad: lid.176 says "en"; two of them share under 10% of character 5-grams."""
    return " ".join(" ".join(rng.choice(words, int(rng.integers(8, 16)))).capitalize() + "." for _ in range(sentences))


def edit(rng: np.random.Generator, words: list[str], text: str, fraction: float = 0.02) -> str:
    """`text` with `fraction` of its words replaced: a near duplicate (character 5-gram Jaccard ~0.9)."""
    ws = text.split(" ")
    for i in rng.choice(len(ws), max(1, int(fraction * len(ws))), replace=False):
        ws[i] = str(rng.choice(words))
    return " ".join(ws)


def write(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path) -> dict:
    """Two raw files with 8 distinct English documents plus one of each planted removal; eval files."""
    rng = np.random.default_rng(0)
    words = _words()
    docs = [english(rng, words) for _ in range(8)]
    passage = english(rng, words, sentences=4)
    contaminated = docs[7][:800] + " " + passage + " " + docs[7][800:]
    first = [{"text": d, "url": f"u{i}"} for i, d in enumerate(docs[:4])]
    first += [{"text": edit(rng, words, docs[1]), "url": "near-of-u1"},
              {"text": "  " + docs[2].upper().replace(" ", "   "), "url": "exact-of-u2"},  # same after normalizing
              {"text": TR, "url": "turkish"}, {"text": "Too short to keep.", "url": "short"}]
    # The second file repeats a URL of the first: documents are rows, so both u0 documents count.
    second = [{"text": docs[4], "url": "u0"}, {"text": docs[5], "url": "u5"},
              {"text": edit(rng, words, docs[5]), "url": "near-of-u5"}, {"text": docs[6], "url": "u6"},
              {"text": contaminated, "url": "contaminated"}]
    raw = [write(tmp_path / "raw1.jsonl", first), write(tmp_path / "raw2.jsonl", second)]
    lambada = write(tmp_path / "lambada_test.jsonl", [{"text": passage}, {"text": english(rng, words, 4)}])
    wiki = tmp_path / "wiki.test.tokens"
    wiki.write_text(" = Title = \n\n" + english(rng, words, 10) + "\n", encoding="utf-8")
    (tmp_path / "out").mkdir()
    return {"raw": raw, "eval": [wiki, lambada], "out": tmp_path / "out", "kept": 7}


def run(c: dict, *extra: str) -> prepare.Manifest:
    argv = ["--input", *map(str, c["raw"]), "--output-dir", str(c["out"]), "--eval-files", *map(str, c["eval"]),
            "--workers", "0", *extra]
    return prepare_corpus(build_parser().parse_args(argv))


def test_whole_path_removes_exactly_what_was_planted(corpus):
    m = run(corpus)
    manifest = json.loads((corpus["out"] / "manifest.json").read_text())
    assert manifest["removed_by_rule"] == PLANTED
    stages = manifest["stages"]
    assert list(stages) == list(STAGES[:-1])  # no --output-prefix: no tokenize stage
    assert stages["clean"]["docs_in"] == 13 and stages["shuffle"]["docs_out"] == corpus["kept"]
    for a, b in zip(STAGES, STAGES[1:-1]):  # each stage reads what the one before wrote
        assert stages[a]["docs_out"] == stages[b]["docs_in"] and stages[a]["chars_out"] == stages[b]["chars_in"]
    assert stages["near_dedup"]["examples"]["near_duplicate"][0].startswith("near-of-u1: ")
    assert all(len(x) <= 220 for s in stages.values() for ex in s["examples"].values() for x in ex)
    assert stages["clean"]["settings"]["lang"] == "en" and m.skipped == []
    shuffled = [json.loads(line)["url"] for line in (corpus["out"] / "shuffled.jsonl").read_text().splitlines()]
    assert sorted(shuffled) == ["u0", "u0", "u1", "u2", "u3", "u5", "u6"]  # both u0 rows: rows, not keys
    assert shuffled != sorted(shuffled, key=["u0", "u1", "u2", "u3", "u5", "u6"].index)  # seed 1234 moves them


def test_output_dir_is_created_as_the_docs_examples_expect(corpus):
    # docs/corpus.md and README: `--output-dir out/` on a fresh folder (it used to stop: "create it first").
    new = corpus["out"] / "a" / "b"
    run({**corpus, "out": f"{new}/"})
    assert (new / "manifest.json").is_file() and (new / "shuffled.jsonl").is_file()
    with pytest.raises(UsageError, match="a file, not a folder"):
        run({**corpus, "out": corpus["raw"][0]})


def test_second_run_skips_every_stage_and_a_changed_setting_reruns_from_its_stage(corpus):
    run(corpus)
    assert run(corpus).skipped == list(STAGES[:-1])
    assert run(corpus, "--shuffle-seed", "7").skipped == list(STAGES[:4])
    again = run(corpus, "--lang", "tr")  # cleaning changes, so everything after it re-runs
    assert again.skipped == []
    assert again.stages["clean"]["removed"] == {"lang": 11, "min_tokens": 1}
    assert run(corpus, "--lang", "tr", "--overwrite").skipped == []
    with pytest.raises(UsageError, match="clean removed every document"):
        run(corpus, "--lang", "tr", "--min-tokens", "100000")


def test_interrupted_stage_leaves_nothing_that_looks_complete(corpus, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dedup, "near_duplicates", killed)
    with pytest.raises(KeyboardInterrupt):
        run(corpus)
    out = corpus["out"]
    assert sorted(p.name for p in out.iterdir()) == ["clean.jsonl", "exact.jsonl", "fingerprints.npz",
                                                     "manifest.json", "manifest.lock"]
    assert list(json.loads((out / "manifest.json").read_text())["stages"]) == ["clean", "exact_dedup"]
    monkeypatch.undo()
    assert run(corpus).skipped == ["clean", "exact_dedup"]
    (out / "near.jsonl").write_text("")  # an output whose size disagrees with the manifest is redone
    assert run(corpus).skipped == ["clean", "exact_dedup"]

    before = (out / "shuffled.jsonl").read_bytes()
    monkeypatch.setattr(os, "fsync", killed)  # the shuffle with a new seed dies before its rename
    with pytest.raises(KeyboardInterrupt):
        run(corpus, "--shuffle-seed", "7")
    monkeypatch.undo()
    assert (out / "shuffled.jsonl").read_bytes() == before and not list(out.glob(".*"))  # the old, complete one
    assert json.loads((out / "manifest.json").read_text())["stages"]["shuffle"]["settings"]["shuffle_seed"] == 1234
    assert run(corpus, "--shuffle-seed", "7").skipped == list(STAGES[:4])


def _script():
    spec = importlib.util.spec_from_file_location("prepare_corpus", ROOT / "data" / "prepare_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_line_names_file_and_line_exit_2_or_is_counted(corpus, capsys):
    raw = corpus["raw"][1]
    raw.write_text(raw.read_text() + '{"text": oops}\n')
    argv = ["--input", *map(str, corpus["raw"]), "--output-dir", str(corpus["out"]), "--workers", "0"]
    assert _script().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "raw2.jsonl:6:" in err and "--skip-bad-lines" in err
    assert sorted(p.name for p in corpus["out"].iterdir()) == ["manifest.lock"]  # the lock, no output
    assert _script().main(argv + ["--skip-bad-lines"]) == 0
    assert json.loads((corpus["out"] / "manifest.json").read_text())["stages"]["clean"]["bad_lines"] == 1


def test_a_second_run_on_a_busy_folder_stops_and_touches_nothing(corpus, capsys):
    """Two runs on one folder (a scheduler's requeue while the first still runs, a second terminal):
    the second stops with exit code 2 and one line naming the holder, before removing the first
    one's temporaries; once the first ends, the folder is free again (also after a SIGKILL: the
    kernel drops the lock with the process)."""
    out = corpus["out"]
    out.mkdir(exist_ok=True)
    running = out / ".clean.jsonl.tmp-12345"  # the first run's output being written
    running.write_text("partial")
    argv = ["--input", *map(str, corpus["raw"]), "--output-dir", str(out), "--workers", "0"]
    with prepare.hold_folder(out):
        assert _script().main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(out) in err and f"pid {os.getpid()}" in err and "rerun" in err
        assert running.read_text() == "partial" and not (out / "manifest.json").exists()
    assert _script().main(argv) == 0 and not running.exists()


def tiny_gpt2_config(path: Path) -> Path:
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 32,
                                "n_layer": 2, "n_head": 2}))
    return path


def train_three_steps(prefix: str, tmp_path: Path, capsys) -> None:
    from gpt2forge.cli import train_main  # the top layer: only this test trains
    argv = ["--model-config", str(tiny_gpt2_config(tmp_path / "tiny.json")), "--dataset", "mmap",
            "--input-files", prefix, "--max-len", "16", "--batch-size", "2", "--gradient-accumulation", "2",
            "--device-iterations", "1", "--num-workers", "0", "--learning-rate", "3e-3", "--split", "100,0,0",
            "--training-steps", "3", "--checkpoint-output-dir", str(tmp_path / "ckpt")]
    capsys.readouterr()
    assert train_main(argv) == 0
    assert len(STEP.findall(capsys.readouterr().out)) == 3


@pytest.mark.slow
def test_output_prefix_writes_bin_idx_that_trains(corpus, tmp_path, capsys):
    prefix = str(corpus["out"] / "corpus")
    m = run(corpus, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--append-eod")
    ds = IndexedDataset(f"{prefix}_text_document", vocab_size=50257)
    assert ds.num_documents == corpus["kept"] == m.stages["tokenize"]["docs_out"]
    assert m.stages["tokenize"]["tokens"] == int(sum(len(d) for d in ds.documents()))
    ds.close()
    assert run(corpus, "--output-prefix", prefix, "--append-eod").skipped == list(STAGES)
    train_three_steps(f"{prefix}_text_document", tmp_path, capsys)


@pytest.mark.slow
def test_seed_five_commands_as_typed_then_train(corpus, tmp_path, capsys):
    """cleanup_dataset.py -> find_duplicates.py -> group_duplicate_url.py -> remove_group_duplicates.py
    -> preprocess_data.py, in the seed's words, then 3 training steps on the result."""
    lines = [json.loads(x) for p in corpus["raw"] for x in p.read_text().splitlines()]
    lines[8]["url"] = "u4"  # the seed keys documents by url: one url per document
    write(tmp_path / "raw.json", lines)
    shutil.copy(ASSETS / vocab.VOCAB_FILE, tmp_path / "gpt2-vocab.json")
    shutil.copy(ASSETS / vocab.MERGES_FILE, tmp_path / "gpt2-merges.txt")
    commands = [
        "cleanup_dataset.py raw.json clean.json",
        "find_duplicates.py --inputs clean.json url --output pairs.json",
        "group_duplicate_url.py pairs.json groups.json 0.7",
        "remove_group_duplicates.py groups.json clean.json dedup.json",
        "preprocess_data.py --input dedup.json --output-prefix my-gpt2 --vocab gpt2-vocab.json --dataset-impl mmap "
        "--tokenizer-type GPT2BPETokenizer --merge-file gpt2-merges.txt --append-eod --workers 1",
    ]
    for command in commands:
        name, *args = command.split()
        proc = subprocess.run([sys.executable, str(ROOT / "data" / name), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
    kept = [json.loads(x)["url"] for x in (tmp_path / "dedup.json").read_text().splitlines()]
    # No decontamination in the seed's five steps: the contaminated document stays.
    assert kept == ["u0", "u1", "u2", "u3", "u4", "u5", "u6", "contaminated"]
    ds = IndexedDataset(tmp_path / "my-gpt2_text_document", vocab_size=50257)
    assert ds.num_documents == len(kept)
    ds.close()
    train_three_steps(str(tmp_path / "my-gpt2_text_document"), tmp_path, capsys)


def test_documented_commands_parse():
    """Every `python data/prepare_corpus.py ...` line of docs/corpus.md parses with the real parser."""
    import shlex
    text = (ROOT / "docs" / "corpus.md").read_text(encoding="utf-8").replace("\\\n", " ")
    commands = [line.split("prepare_corpus.py", 1)[1] for line in text.splitlines()
                if line.strip().startswith("python data/prepare_corpus.py")]
    assert commands
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        assert args.input and args.output_dir
