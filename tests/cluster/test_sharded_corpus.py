"""data/prepare_corpus.py as users run it on many machines: a job array of shard tasks, then one
merge (or with --two-passes: array, merge, array, merge), on namespaced nodes with the scheduler
stand-ins (run/prepare_corpus_array.pbs through `qsub -J`, run/prepare_corpus_array.sbatch through
`sbatch --array` and `srun`). The merge's outputs equal the one-machine run's on the same input
byte for byte, exact.jsonl through the .bin/.idx, and its manifest's counts equal that run's. A task
killed (SIGKILL) in its fingerprint stage fails the array and the merge refuses to start, naming it;
rerun alone, it skips the clean stage it had finished, and resubmitting the whole array redoes
nothing (every task's manifest and files unchanged).

Corpus: benchmarks/web_corpus.py's (planted exact and near duplicates, some of whose originals fall
in an earlier shard, so the merge's choices cross shards; passages of a small evaluation file).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_fixtures import cluster_fixture  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # six to nine prepare_corpus.py processes each, as the other cluster cases

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("web_corpus", ROOT / "benchmarks" / "web_corpus.py")
web_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(web_corpus)

DOCS = 160
DECONTAMINATED = "decontaminated.jsonl"
COMPARED = ("exact.jsonl", "near.jsonl", DECONTAMINATED, "shuffled.jsonl", "corpus_text_document.bin",
            "corpus_text_document.idx")
EVAL_TEXT = ("The lighthouse keeper counted seventeen gulls on the northern rocks before the storm arrived and "
             "wrote their number in the ledger beside the price of lamp oil the weight of the bread delivered on "
             "Tuesday and a note about the ferry that had not come for nine days because the harbour master "
             "feared the swell more than he feared the mayor who wanted his letters")
JOB_TIMEOUT_S = 240  # a stuck job fails the test instead of hanging it


def flags(corpus: dict, out: Path, *extra: str) -> list[str]:
    """The flags of both runs: every stage, .bin/.idx included, in this process (2 cores host all)."""
    return ["--input", str(corpus["raw"]), "--output-dir", str(out), "--eval-files", str(corpus["eval"]),
            "--output-prefix", str(out / "corpus"), "--append-eod", "--workers", "0", *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The corpus, and the one-machine run's outputs and manifest on it."""
    folder = tmp_path_factory.mktemp("sharded_corpus")
    (folder / "eval.jsonl").write_text(json.dumps({"text": EVAL_TEXT}) + "\n")
    truth, _, _ = web_corpus.write_corpus(DOCS, folder / "web.jsonl", folder / "truth.json", seed=2,
                                          contaminate=[folder / "eval.jsonl"])
    found = {"raw": folder / "web.jsonl", "eval": folder / "eval.jsonl", "truth": truth}
    one = folder / "one"
    done = subprocess.run([sys.executable, "data/prepare_corpus.py", *flags(found, one)], cwd=ROOT, text=True,
                          capture_output=True, timeout=JOB_TIMEOUT_S, env={**os.environ, "TQDM_DISABLE": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return found | {"one": {name: (one / name).read_bytes() for name in COMPARED},
                    "stages": json.loads((one / "manifest.json").read_text())["stages"]}


def counts(stages: dict) -> dict:
    """The manifest's records without what differs between folders and runs (paths, times, the prefix)."""
    return {name: {k: v for k, v in r.items() if k not in ("inputs", "outputs", "seconds")}
            | {"settings": {k: v for k, v in r["settings"].items() if k != "output_prefix"}}
            for name, r in stages.items()}


def submit(node, argv: list[str], env: dict | None = None) -> tuple[int, str]:
    """A submission from `node` (a login node), waited for: (exit code, its output)."""
    job = node.popen(argv, cwd=ROOT, env={"TQDM_DISABLE": "1", **(env or {})})
    try:
        out, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        out, _ = job.communicate()
        pytest.fail(f"{' '.join(argv)} did not end within {JOB_TIMEOUT_S} s:\n{out[-3000:]}")
    return job.returncode, out


def assert_equals_one_machine(corpus: dict, out: Path, num_shards: int, two_passes: bool = False) -> None:
    """Second pass: decontaminated.jsonl is the tasks' parts, in shard order."""
    tasks = [out / "shards" / f"{k:05d}-of-{num_shards:05d}" for k in range(num_shards)]
    found = {name: (out / name).read_bytes() for name in COMPARED if not (two_passes and name == DECONTAMINATED)}
    if two_passes:
        found[DECONTAMINATED] = b"".join((t / DECONTAMINATED).read_bytes() for t in tasks)
    assert found == corpus["one"]
    assert counts(json.loads((out / "manifest.json").read_text())["stages"]) == counts(corpus["stages"])
    shard_of = {json.loads(line)["id"]: k for k in range(num_shards) for line in (tasks[k] / "clean.jsonl").open()}
    removed = set(shard_of) - {json.loads(line)["id"] for line in (out / "near.jsonl").open()}
    truth = corpus["truth"]
    originals = {i: of for kind in ("exact_duplicates", "near_duplicates")
                 for i, of in zip(truth[kind]["id"], truth[kind]["of"])}
    assert any(shard_of[i] > shard_of.get(originals[i], shard_of[i]) for i in removed & set(originals)), \
        "no duplicate's original is in an earlier shard: the corpus does not test the merge's choices"


def test_pbs_in_two_passes_arrays_of_four_subjobs_on_three_nodes_and_the_merge_equals_one_machine(cluster, corpus,
                                                                                               tmp_path):
    """--two-passes: array, merge (dedup), array (decontaminate, tokenize), merge (shuffle, .bin/.idx)."""
    c = cluster(3)
    out = tmp_path / "out"
    variables = "PREPARE_FLAGS=" + " ".join(flags(corpus, out, "--num-shards", "4", "--two-passes"))
    array, merge = (["qsub", "-W", "block=true", *extra, "-v", variables, "run/prepare_corpus_array.pbs"]
                    for extra in (["-J", "0-3"], []))
    code, log = submit(c.nodes[0], array)
    assert code == 0 and all(f"shard {k} of 4: first pass complete" in log for k in range(4)), log[-4000:]
    code, log = submit(c.nodes[1], merge)
    assert code == 0 and "next, the second pass" in log, log[-4000:]
    code, log = submit(c.nodes[2], array)
    assert code == 0 and all(f"shard {k} of 4: second pass complete" in log for k in range(4)), log[-4000:]
    code, log = submit(c.nodes[1], merge)
    assert code == 0, log[-4000:]
    assert_equals_one_machine(corpus, out, 4, two_passes=True)


def test_slurm_array_with_a_killed_task_reruns_it_alone_and_the_merge_equals_one_machine(cluster, corpus, tmp_path):
    c = cluster(2)
    out = tmp_path / "out"
    argv = ["run/prepare_corpus_array.sbatch", *flags(corpus, out, "--num-shards", "3")]
    # Task 1's interpreter: SIGKILLed at its fingerprint stage's save (tests/preprocess/prepare_killer.py).
    killer = tmp_path / "python_killing_task_1"
    killer.write_text(f'#!/bin/sh\nif [ "$SLURM_ARRAY_TASK_ID" = 1 ]; then shift; exec "{sys.executable}" '
                      f'tests/preprocess/prepare_killer.py fingerprint gpt2forge.preprocess.dedup.save_fingerprints '
                      f'1 -- "$@"; fi\nexec "{sys.executable}" "$@"\n')
    killer.chmod(0o755)
    code, log = submit(c.nodes[0], ["sbatch", "--wait", "--array=0-2", *argv], {"PYTHON": str(killer)})
    assert code != 0 and "shard 0 of 3: complete" in log and "shard 2 of 3: complete" in log, log[-4000:]
    assert "shard 1 of 3: complete" not in log, log[-4000:]
    tasks = [out / "shards" / f"{k:05d}-of-00003" for k in range(3)]
    assert list(json.loads((tasks[1] / "manifest.json").read_text())["stages"]) == ["clean"]

    code, log = submit(c.nodes[1], ["sbatch", "--wait", *argv])  # the merge, too early
    assert code == 2 and "shard task(s) 1 not complete" in log and "--array=1" in log, log[-4000:]

    def state() -> dict:  # every file but the lock, which names the last run's process
        return {p: (p.read_bytes(), p.stat().st_mtime_ns) for t in tasks for p in sorted(t.iterdir())
                if p.name != "manifest.lock"}

    before = state()
    code, log = submit(c.nodes[1], ["sbatch", "--wait", "--array=1", *argv])  # the killed task, alone
    assert code == 0, log[-4000:]
    assert log.count("clean: complete (clean.jsonl); skipping") == 1 and "shard 1 of 3: complete" in log
    assert "shard 0 of 3" not in log and "shard 2 of 3" not in log
    after = state()
    assert {p: v for p, v in after.items() if tasks[1] not in p.parents} == \
        {p: v for p, v in before.items() if tasks[1] not in p.parents}
    assert after[tasks[1] / "clean.jsonl"] == before[tasks[1] / "clean.jsonl"]  # not redone

    code, log = submit(c.nodes[0], ["sbatch", "--wait", "--array=0-2", *argv])  # the whole array again
    assert code == 0 and log.count("fingerprint: complete (fingerprints.npz); skipping") == 3, log[-4000:]
    assert state() == after  # nothing redone

    code, log = submit(c.nodes[1], ["sbatch", "--wait", *argv])  # the merge
    assert code == 0, log[-4000:]
    assert_equals_one_machine(corpus, out, 3)
