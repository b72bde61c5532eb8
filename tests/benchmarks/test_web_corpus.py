"""benchmarks/web_corpus.py: the same bytes for a seed, a truth that describes the corpus (the
duplicates are what it says, at the Jaccard it says), and prepare_corpus.py's drops, stage by stage
and rule by rule, scored against it on a corpus contaminated with the real evaluation sets."""

import importlib.util
import json
import shlex
import statistics
from pathlib import Path

import ftfy
import pytest

from gpt2forge.preprocess.decontaminate import eval_ngrams, overlaps, words
from gpt2forge.preprocess.minhash import exact_hash, jaccard, shingle_hashes
from gpt2forge.preprocess.prepare import build_parser, prepare_corpus

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("web_corpus", ROOT / "benchmarks" / "web_corpus.py")
web_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(web_corpus)


def documents(path: Path) -> dict[int, str]:
    with open(path, "rb") as f:
        return {(d := json.loads(line))["id"]: d["text"] for line in f}


@pytest.mark.slow
def test_same_seed_same_bytes_from_the_documented_command(tmp_path, capsys):
    command = web_corpus.__doc__.split("\n\n")[1].replace("\\\n", " ").split("web_corpus.py", 1)[1]
    argv = shlex.split(command.replace("[", "").replace("]", ""))  # the optional --contaminate too
    values = {"--docs": "300", "--output": str(tmp_path / "a.jsonl"), "--truth": str(tmp_path / "a.json")}
    argv = [values.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
    argv = argv[:argv.index("--contaminate")]
    assert web_corpus.main(argv) == 0
    assert "documents/s" in capsys.readouterr().out
    web_corpus.main(["--docs", "300", "--output", str(tmp_path / "b.jsonl"), "--truth", str(tmp_path / "b.json"),
                     "--seed", "0"])
    web_corpus.main(["--docs", "300", "--output", str(tmp_path / "c.jsonl"), "--truth", str(tmp_path / "c.json"),
                     "--seed", "1"])
    for name in ("jsonl", "json"):
        assert (tmp_path / f"a.{name}").read_bytes() == (tmp_path / f"b.{name}").read_bytes()
        assert (tmp_path / f"a.{name}").read_bytes() != (tmp_path / f"c.{name}").read_bytes()
    truth = json.loads((tmp_path / "a.json").read_text())
    assert sum(truth["counts"].values()) == 300 and truth["counts"]["contaminated"] == 0  # no --contaminate
    with pytest.raises(SystemExit):
        web_corpus.main(["--docs", "0", "--output", "x", "--truth", "y"])


@pytest.mark.slow
def test_the_truth_describes_the_corpus(tmp_path):
    truth, _, _ = web_corpus.write_corpus(1500, tmp_path / "c.jsonl", tmp_path / "t.json", seed=3)
    assert truth == json.loads((tmp_path / "t.json").read_text())
    docs = documents(tmp_path / "c.jsonl")
    assert list(docs) == list(range(1500))
    planted = truth["planted"]
    assert sorted(i for ids in planted.values() for i in ids) == list(range(1500))
    assert all(n > 0 for kind, n in truth["counts"].items() if kind != "contaminated")
    lengths = [len(docs[i]) for i in planted["distinct"]]  # log-normal, median 2.5 kB, a tail to 100 kB
    assert min(lengths) >= web_corpus.MIN_CHARS and max(lengths) <= web_corpus.MAX_CHARS + 400
    assert 2000 < statistics.median(lengths) < 3000 and max(lengths) > 20_000
    assert all(len(docs[i]) < 300 for i in planted["short"])
    exact = truth["exact_duplicates"]
    assert set(exact["how"]) == {"identical", "case_space", "mojibake"}
    for i, of, how in zip(exact["id"], exact["of"], exact["how"]):
        assert of < i and (docs[i] == docs[of]) == (how == "identical")
        assert exact_hash(ftfy.fix_text(docs[i])) == exact_hash(ftfy.fix_text(docs[of]))  # what clean then sees
        assert ("\u00e2\u20ac" in docs[i]) == (how == "mojibake")  # an em dash read as Windows-1252
    near = truth["near_duplicates"]
    off = []
    for i, of, j, target in zip(near["id"], near["of"], near["jaccard"], near["target"]):
        assert of < i and exact_hash(docs[i]) != exact_hash(docs[of])
        assert j == round(jaccard(shingle_hashes(docs[i]), shingle_hashes(docs[of])), 4)
        if target is not None:
            off.append(abs(j - target))
    assert statistics.median(off) <= 0.02 and max(off) <= 0.1
    assert len({exact_hash(docs[i]) for i in near["id"]}) == len(near["id"])  # no copy is another's exact one


@pytest.mark.slow
@pytest.mark.data_only
def test_each_stage_drops_what_was_planted(tmp_path, eval_data):
    """The whole path with --quality on a corpus contaminated with both evaluation sets: clean, exact
    dedup and decontamination drop exactly the planted documents (rule by rule), near dedup drops no
    document that is not a planted copy and finds those at Jaccard 0.9 and above as often as 10 bands
    of 10 rows promise (1 - (1 - 0.9^10)^10 = 0.98)."""
    evals = [eval_data / "lambada" / "lambada_test.jsonl", eval_data / "wikitext" / "wiki.test.raw"]
    corpus, out = tmp_path / "c.jsonl", tmp_path / "out"
    truth, _, _ = web_corpus.write_corpus(1000, corpus, tmp_path / "t.json", seed=5, contaminate=evals)
    table = eval_ngrams(evals, 13)
    docs = documents(corpus)
    hit = {i for i, text in docs.items() if overlaps(words(text)[0], table, 13).size}  # the stage's own test
    assert hit == set(truth["planted"]["contaminated"]) and len(hit) >= 5

    prepare_corpus(build_parser().parse_args(["--input", str(corpus), "--output-dir", str(out), "--quality",
                                              "--eval-files", *map(str, evals), "--workers", "0"]))
    manifest = json.loads((out / "manifest.json").read_text())
    expected = web_corpus.expected_removals(truth, quality=True)
    for stage, rules in expected.items():
        if stage != "near_dedup":
            assert manifest["stages"][stage]["removed"] == {rule: len(ids) for rule, ids in rules.items() if ids}
    scores = web_corpus.account(truth, web_corpus.stage_removals(corpus, out), quality=True)
    for stage in ("clean", "exact_dedup", "decontaminate"):
        assert scores[stage]["recall"] == scores[stage]["precision"] == 1.0, (stage, scores[stage])
    near = scores["near_dedup"]
    assert near["precision"] == 1.0 and near["recall_by_jaccard"]["0.9"] >= 0.95, near
