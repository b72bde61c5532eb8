"""gpt2forge/preprocess/sharded.py without a cluster (tests/cluster/test_sharded_corpus.py runs it as
job arrays on namespaced nodes): the parts tile the input, every line read once and in order; shard
tasks plus the merge in this process equal the one-machine run byte for byte, in one pass and in
two (a task failing in its second pass reruns only what it had not finished); bad flags and an
early merge stop with one line; the job scripts' and docs' example flags parse."""

import json
import re
import shlex
from pathlib import Path

import pytest

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess import megatron, sharded
from gpt2forge.preprocess.jsonl import read_documents
from gpt2forge.preprocess.prepare import build_parser, prepare_corpus

ROOT = Path(__file__).resolve().parents[2]


def test_parts_read_every_line_once_in_order_whatever_the_cuts(tmp_path):
    """Two files, lines of very different lengths (a cut falls inside long lines, parts with no line
    start), a blank line, no newline at the end of the second file."""
    lines = [json.dumps({"text": f"doc {i} " + "x" * (i * 37 % 500)}) for i in range(40)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:25]) + "\n\n")
    b.write_text("\n".join(lines[25:]))
    want = [json.loads(line)["text"] for line in lines]
    for n in (1, 2, 3, 7, 40, 200):
        got = [doc.text for part in sharded.parts([a, b], n) for path, start, end in part
               for doc in read_documents(path, span=(start, end))]
        assert got == want, n


def test_bad_line_in_a_part_names_the_files_own_line(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": "t" * 50}) + "\n" for _ in range(9)) + "{broken\n")
    [[(path, start, end)]] = sharded.parts([raw], 2)[1:]
    with pytest.raises(UsageError, match=r"raw.jsonl:10: .*--skip-bad-lines"):
        list(read_documents(path, span=(start, end)))


def _flags(tmp_path: Path, out: str, *extra: str) -> list[str]:
    return ["--input", str(tmp_path / "web.jsonl"), "--output-dir", str(tmp_path / out), "--workers", "0",
            "--eval-files", str(tmp_path / "eval.jsonl"), *extra]


@pytest.fixture
def web(tmp_path) -> Path:
    import importlib.util
    spec = importlib.util.spec_from_file_location("web_corpus", ROOT / "benchmarks" / "web_corpus.py")
    web_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(web_corpus)
    passage = ("The ferry had not come for nine days because the harbour master feared the swell more than he "
               "feared the mayor, so the keeper counted the gulls on the northern rocks, wrote their number in the "
               "ledger beside the price of lamp oil and the weight of the bread, and waited for the storm to pass")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"text": passage}) + "\n")
    web_corpus.write_corpus(90, tmp_path / "web.jsonl", tmp_path / "truth.json", seed=4,
                            contaminate=[tmp_path / "eval.jsonl"])
    letter = ("A letter from the coast, read aloud at the village meeting last winter. " + passage + ". The rest of "
              "the letter was about the weather, the price of coal, the school that needed a new roof, and the "
              "neighbours who had promised to mend the fences before the sheep were brought down from the hills. ")
    with open(tmp_path / "web.jsonl", "a") as f:  # one document sure to be found (planting is by chance)
        f.write(json.dumps({"text": letter * 3}) + "\n")
    return tmp_path


@pytest.mark.slow
def test_shard_tasks_then_merge_equal_one_machine_and_an_early_merge_names_the_missing_tasks(web, capsys):
    prepare_corpus(build_parser().parse_args(_flags(web, "one")))
    shards = _flags(web, "sharded", "--num-shards", "3")
    prepare_corpus(build_parser().parse_args([*shards, "--shard", "2"]))
    with pytest.raises(UsageError, match=r"shard task\(s\) 0,1 not complete .*--array=0,1"):
        prepare_corpus(build_parser().parse_args(shards))
    for k in (1, 0):  # any order
        prepare_corpus(build_parser().parse_args([*shards, "--shard", str(k)]))
    prepare_corpus(build_parser().parse_args([*shards, "--shard", "1", "--lang", "de"]))
    with pytest.raises(UsageError, match=r"shard task\(s\) 1 not complete"):  # a task run with other flags
        prepare_corpus(build_parser().parse_args(shards))
    capsys.readouterr()
    prepare_corpus(build_parser().parse_args([*shards, "--shard", "1"]))
    assert "clean: running again: its record has other settings" in capsys.readouterr().out
    merged = prepare_corpus(build_parser().parse_args(shards))
    for name in ("exact.jsonl", "near.jsonl", "decontaminated.jsonl", "shuffled.jsonl"):
        assert (web / "sharded" / name).read_bytes() == (web / "one" / name).read_bytes(), name
    one = json.loads((web / "one" / "manifest.json").read_text())["stages"]
    assert {k: r["removed"] for k, r in merged.stages.items()} == {k: r["removed"] for k, r in one.items()}
    assert one["exact_dedup"]["removed"] and one["near_dedup"]["removed"]


def _records(stages: dict) -> dict:
    """A manifest's records without what differs between folders and runs (paths, times, the prefix)."""
    return {name: {k: v for k, v in r.items() if k not in ("inputs", "outputs", "seconds")}
            | {"settings": {k: v for k, v in r["settings"].items() if k != "output_prefix"}}
            for name, r in stages.items()}


@pytest.mark.slow
def test_two_passes_decontaminate_and_tokenize_in_the_tasks_and_equal_one_machine(web, capsys, monkeypatch):
    tokens = ["--append-eod", "--output-prefix"]
    prepare_corpus(build_parser().parse_args(_flags(web, "one", *tokens, str(web / "one" / "corpus"))))
    two = _flags(web, "two", *tokens, str(web / "two" / "corpus"), "--num-shards", "4", "--two-passes")
    capsys.readouterr()
    for k in (2, 0, 3, 1):
        prepare_corpus(build_parser().parse_args([*two, "--shard", str(k)]))
        assert f"shard {k} of 4: first pass complete" in capsys.readouterr().out
    merge = prepare_corpus(build_parser().parse_args(two))
    assert "next, the second pass: the shard tasks again" in capsys.readouterr().out
    assert list(merge.stages) == ["clean", "exact_dedup", "near_dedup"]
    prepare_corpus(build_parser().parse_args([*two, "--shard", "1"]))
    with pytest.raises(UsageError, match=r"shard task\(s\) 0,2,3 have not decontaminated .*--array=0,2,3"):
        prepare_corpus(build_parser().parse_args(two))
    for k in (3, 0):
        prepare_corpus(build_parser().parse_args([*two, "--shard", str(k)]))
    with monkeypatch.context() as patch:  # task 2 fails in its tokenization, then reruns it alone
        patch.setattr(megatron, "preprocess_data", lambda *_: (_ for _ in ()).throw(OSError("disk gone")))
        with pytest.raises(OSError, match="disk gone"):
            prepare_corpus(build_parser().parse_args([*two, "--shard", "2"]))
    task = prepare_corpus(build_parser().parse_args([*two, "--shard", "2"]))
    assert task.skipped == ["clean", "fingerprint", "decontaminate"]
    capsys.readouterr()
    task = prepare_corpus(build_parser().parse_args([*two, "--shard", "1"]))  # every stage already complete
    assert task.skipped == ["clean", "fingerprint", "decontaminate", "tokenize"]
    assert "shard 1 of 4: second pass complete" in capsys.readouterr().out
    merge = prepare_corpus(build_parser().parse_args(two))
    one, out = web / "one", web / "two"
    for name in ("exact.jsonl", "near.jsonl", "shuffled.jsonl", "corpus_text_document.bin",
                 "corpus_text_document.idx"):
        assert (out / name).read_bytes() == (one / name).read_bytes(), name
    parts = b"".join((sharded.shard_dir(out, k, 4) / "decontaminated.jsonl").read_bytes() for k in range(4))
    assert parts == (one / "decontaminated.jsonl").read_bytes()
    stages = json.loads((one / "manifest.json").read_text())["stages"]
    assert _records(merge.stages) == _records(stages)
    assert stages["decontaminate"]["removed"] and stages["tokenize"]["tokens"]


@pytest.mark.parametrize("extra, message", [
    (["--shard", "1"], "--shard 1: needs --num-shards N"),
    (["--shard", "3", "--num-shards", "3"], r"--shard 3: must be in \[0, 2\] for --num-shards 3 .*--array=0-2"),
    (["--num-shards", "-1"], "--num-shards -1: must be >= 1"),
    (["--two-passes"], "--two-passes: needs --num-shards N"),
])
def test_bad_shard_flags_stop_with_one_line(tmp_path, extra, message):
    (tmp_path / "raw.jsonl").write_text('{"text": "x"}\n')
    args = build_parser().parse_args(["--input", str(tmp_path / "raw.jsonl"), "--output-dir", str(tmp_path / "o"),
                                      *extra])
    with pytest.raises(UsageError, match=message):
        prepare_corpus(args)


def test_the_job_scripts_and_docs_example_flags_parse():
    """FLAGS="..." in run/prepare_corpus_array.{sbatch,pbs} and docs/corpus.md: the real parser takes
    them, as a task (with --shard) and as the merge."""
    texts = [(ROOT / "run" / name).read_text() for name in ("prepare_corpus_array.sbatch", "prepare_corpus_array.pbs")]
    found = [m for text in [*texts, (ROOT / "docs" / "corpus.md").read_text()]
             for m in re.findall(r'FLAGS="([^"]+)"', text)]
    assert len(found) == 4
    for flags in found:
        argv = shlex.split(flags.replace("*", ""))
        assert build_parser().parse_args([*argv, "--shard", "0"]).num_shards == 8
        assert build_parser().parse_args(argv).shard is None
    assert [build_parser().parse_args(shlex.split(flags.replace("*", ""))).two_passes for flags in found] == \
        [False, False, False, True]
