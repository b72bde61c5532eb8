"""prepare_corpus.py killed (SIGKILL) in every stage, then rerun: the output is byte-identical to an
uninterrupted run's, no leftover file stays behind, and the stages finished before a kill are not
redone (the rerun skips them and their manifest records, times included, are unchanged). The
corpus is benchmarks/web_corpus.py's, with passages of the real LAMBADA test set planted; the run
uses every stage, .bin/.idx included."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2forge.preprocess.prepare import STAGES

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("web_corpus", ROOT / "benchmarks" / "web_corpus.py")
web_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(web_corpus)

WRITE = "gpt2forge.preprocess.jsonl.JsonlWriter.write"
COPY = "gpt2forge.preprocess.dedup.atomic_file:write"  # the dedup stages copy kept lines as bytes
KILLS = (  # (stage, what the killed call is, its number in the stage): one run of the chain each
    ("clean", WRITE, 200),                                           # clean.jsonl's temporary half written
    ("exact_dedup", COPY, 200),                                      # fingerprints.npz in place, exact.jsonl half
    ("exact_dedup", "gpt2forge.preprocess.prepare.Manifest.save", 1),  # both in place, not in the manifest
    ("near_dedup", COPY, 200),
    ("decontaminate", WRITE, 200),
    ("shuffle", "os.fsync", 1),                                      # written in full, not renamed
    ("tokenize", "os.replace", 2),                                   # the .bin renamed, the .idx not
)
DOCS = 1000


def prepare(out: Path, corpus: Path, lambada: Path, kill: tuple | None = None) -> subprocess.CompletedProcess:
    argv = ["--input", str(corpus), "--output-dir", str(out), "--eval-files", str(lambada), "--workers", "0",
            "--output-prefix", str(out / "corpus"), "--append-eod"]
    script = ["data/prepare_corpus.py"] if kill is None else \
        ["tests/preprocess/prepare_killer.py", kill[0], kill[1], str(kill[2]), "--"]
    return subprocess.run([sys.executable, *script, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"TQDM_DISABLE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def stages(out: Path) -> dict:
    path = out / "manifest.json"
    return json.loads(path.read_text())["stages"] if path.is_file() else {}


def files(out: Path) -> dict[str, bytes]:
    """Every file of the output folder, the input's time taken out of the .bin/.idx's record of its
    source (manifest.json: `counts`; manifest.lock names the last run's process)."""
    found = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name not in ("manifest.json", "manifest.lock")}
    source = json.loads(found["corpus_text_document.source.json"])
    del source["input"]["mtime_ns"]
    found["corpus_text_document.source.json"] = json.dumps(source).encode()
    return found


def counts(records: dict) -> dict:
    """The manifest's records without what differs between folders and runs (paths, times)."""
    return {name: {k: v for k, v in r.items() if k not in ("inputs", "outputs", "seconds")}
            for name, r in records.items()}


@pytest.mark.slow
@pytest.mark.data_only
def test_killed_in_every_stage_then_rerun_gives_the_uninterrupted_output(tmp_path, eval_data):
    lambada = eval_data / "lambada" / "lambada_test.jsonl"
    corpus = tmp_path / "web.jsonl"
    web_corpus.write_corpus(DOCS, corpus, tmp_path / "truth.json", seed=1, contaminate=[lambada])
    killed = tmp_path / "out"  # the same folder for both runs: fingerprints.npz and the .bin/.idx name it
    done = prepare(killed, corpus, lambada)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = files(killed)
    assert {"shuffled.jsonl", "corpus_text_document.bin", "corpus_text_document.idx"} <= set(expected)
    whole = killed.rename(tmp_path / "whole")

    before = {}
    for stage, target, call in KILLS:
        run = prepare(killed, corpus, lambada, (stage, target, call))
        assert run.returncode == -9, f"not killed in {stage}: {run.stdout[-1000:]} {run.stderr[-2000:]}"
        after = stages(killed)
        assert list(after) == list(STAGES[:STAGES.index(stage)]), (stage, list(after))
        for name in before.keys() & after.keys():  # finished by an earlier run: skipped, not redone
            assert f"{name}: complete (" in run.stdout and after[name] == before[name], (stage, name)
        if target != KILLS[2][1]:  # killed mid-stage: the stage's temporary file is there, written in part
            assert any(p.name.startswith(".") and p.stat().st_size for p in killed.iterdir()), \
                (stage, [(p.name, p.stat().st_size) for p in sorted(killed.iterdir())])
        before = after

    final = prepare(killed, corpus, lambada)
    assert final.returncode == 0, final.stderr[-2000:]
    for name in before:
        assert f"{name}: complete (" in final.stdout and stages(killed)[name] == before[name], name
    got = files(killed)
    assert sorted(got) == sorted(expected)  # no temporary of a killed run left behind
    assert [name for name in expected if got[name] != expected[name]] == []
    assert counts(stages(killed)) == counts(stages(whole))
