"""Near-duplicate removal: throughput (documents/s per core), peak memory, recall and precision.

    .venv/bin/python benchmarks/dedup_throughput.py              # 200 MB corpus
    .venv/bin/python benchmarks/dedup_throughput.py --mb 2       # quick variant

Same run, same generated corpus (`planted_corpus`: distinct documents, plus near-duplicate copies
with 1-3% of their words replaced, paragraphs reordered, or boilerplate added), each tool in its own
process on one core (a per-core rate: documents per CPU second of the tool's process and the processes
it waited for, so other load on the machine does not change it; each tool's peak RSS from its own
process):
- ours: gpt2forge.preprocess.dedup (character 5-grams, 100 hashes, 10 bands, exact Jaccard > 0.5), and
  `ours-20x5`, the same with prepare_corpus.py's 20 bands of 5 rows;
- HF datatrove's MinhashDedupSignature/Buckets/Cluster/Filter, 10 buckets x 10 hashes (datatrove
  only shingles words: word 5-grams), through its LocalPipelineExecutor with one worker;
- datasketch MinHashLSH (character 5-grams, 100 permutations, bands/rows 10 x 10), query-then-insert.
Recall and precision are against the plant: for a planted group of k documents the right answer
removes k - 1 of them. Our streaming stage (fingerprinting) is also measured at half the corpus
size: its memory is the signatures, so it grows by 400 bytes per document, not with the text.
Tools that are not installed are skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from web_corpus import replace_words, with_header_footer  # noqa: E402  (the copies web_corpus.py plants too)


def planted_corpus(n_distinct: int, dup_fraction: float = 0.3, seed: int = 0) -> tuple[list[dict], list[list[str]]]:
    """(documents {"id", "text"} in shuffled order, planted groups of ids that are near-duplicates).

    Distinct documents are 4-8 paragraphs of 30-70 words from a Zipf-distributed made-up vocabulary
    (~2.5 KB). A `dup_fraction` of them get 1-2 copies, each made one of three ways: 1-3% of words
    replaced, paragraphs reordered (and 1% replaced), or a boilerplate header/footer added.
    """
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(20000)]
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    weights /= weights.sum()

    def words(k: int) -> list[str]:
        return [vocab[i] for i in rng.choice(len(vocab), k, p=weights)]

    def edit(paragraphs: list[list[str]], fraction: float) -> list[list[str]]:
        return replace_words(rng, paragraphs, fraction, vocab)

    docs, groups = [], []
    for d in range(n_distinct):
        paragraphs = [words(int(rng.integers(30, 70))) for _ in range(int(rng.integers(4, 9)))]
        group = [f"doc{d}"]
        docs.append((group[0], paragraphs))
        if rng.random() < dup_fraction:
            for c in range(int(rng.integers(1, 3))):
                kind = rng.integers(3)
                if kind == 0:
                    copy = edit(paragraphs, rng.uniform(0.01, 0.03))
                elif kind == 1:
                    copy = edit([paragraphs[i] for i in rng.permutation(len(paragraphs))], 0.01)
                else:
                    copy = with_header_footer(paragraphs)
                group.append(f"doc{d}-copy{c}")
                docs.append((group[-1], copy))
            groups.append(group)
    order = rng.permutation(len(docs))
    return ([{"id": docs[i][0], "text": "\n\n".join(" ".join(p) for p in docs[i][1])} for i in order], groups)


def score(removed: set[str], groups: list[list[str]], n_docs: int) -> tuple[float, float]:
    """(recall, precision) of a removed-id set against the planted groups."""
    group_of = {doc: g for g, members in enumerate(groups) for doc in members}
    per_group = np.zeros(len(groups), dtype=np.int64)
    for doc in removed:
        if doc in group_of:
            per_group[group_of[doc]] += 1
    sizes = np.array([len(g) for g in groups])
    right = int(np.minimum(per_group, sizes - 1).sum())  # removing a whole group is one too many
    return right / max(1, int((sizes - 1).sum())), right / max(1, len(removed))


def run_ours(path: str, out: str, bands: int = 10) -> dict:
    from gpt2forge.preprocess.dedup import fingerprint_files, near_duplicates
    from gpt2forge.preprocess.minhash import MinHashParams
    fp = fingerprint_files([(path, "id")], MinHashParams(bands=bands), workers=0, progress=False)
    removed = near_duplicates(fp, workers=0, progress=False).removed
    return {"removed": [k for k, r in zip(fp.keys, removed) if r]}


def run_ours_prepare(path: str, out: str) -> dict:
    """prepare_corpus.py's near-duplicate settings: 20 bands of 5 rows."""
    return run_ours(path, out, bands=20)


def run_fingerprint_only(path: str, out: str) -> dict:
    from gpt2forge.preprocess.dedup import fingerprint_files
    fingerprint_files([(path, "id")], workers=0, progress=False)
    return {"removed": []}


def run_datatrove(path: str, out: str) -> dict:
    import xxhash
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashes import xxhash as datatrove_xxhash
    from datatrove.utils.hashing import HashConfig
    # datatrove 0.10.1 hashes str, which xxhash >= 4 refuses: encode first, as xxhash 3 did inside.
    datatrove_xxhash.xxhash32 = lambda data: xxhash.xxh32_intdigest(data.encode() if isinstance(data, str) else data)
    config = MinhashConfig(n_grams=5, num_buckets=10, hashes_per_bucket=10, hash_config=HashConfig(precision=32))
    work, data = Path(out), str(Path(path).parent)

    def execute(pipeline, tasks, stage):
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1,
                              logging_dir=str(work / f"logs-{stage}")).run()

    glob = Path(path).name
    execute([JsonlReader(data, glob_pattern=glob), MinhashDedupSignature(str(work / "sigs"), config=config)], 1, 1)
    execute([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)], 10, 2)
    execute([MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config)], 1, 3)
    execute([JsonlReader(data, glob_pattern=glob),
             MinhashDedupFilter(str(work / "remove"), exclusion_writer=JsonlWriter(str(work / "removed"))),
             JsonlWriter(str(work / "kept"))], 1, 4)
    removed = []
    import gzip
    for f in sorted((work / "removed").glob("*")):
        with gzip.open(f, "rt") if f.suffix == ".gz" else open(f) as lines:
            removed.extend(json.loads(line)["id"] for line in lines)
    return {"removed": removed}


def run_datasketch(path: str, out: str) -> dict:
    from datasketch import MinHash, MinHashLSH

    from gpt2forge.preprocess.minhash import normalize_text
    lsh, removed = MinHashLSH(num_perm=100, params=(10, 10)), []
    with open(path) as f:
        for line in f:
            doc = json.loads(line)
            text = normalize_text(doc["text"])
            m = MinHash(num_perm=100)
            m.update_batch([text[i:i + 5].encode() for i in range(max(1, len(text) - 4))])
            if lsh.query(m):  # a candidate already kept: drop this one (datasketch has no exact verification)
                removed.append(doc["id"])
            else:
                lsh.insert(doc["id"], m)
    return {"removed": removed}


TOOLS = {"ours": (run_ours, None), "ours-20x5": (run_ours_prepare, None),
         "ours-fingerprint": (run_fingerprint_only, None), "datatrove": (run_datatrove, "datatrove"),
         "datasketch": (run_datasketch, "datasketch")}


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss would include the parent's peak from before exec)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(tool: str, path: str, out: str) -> None:
    """Run one tool here and print its JSON result line (seconds, peak RSS, removed ids)."""
    start = time.perf_counter()
    result = TOOLS[tool][0](path, out)
    result["seconds"] = time.perf_counter() - start
    result["peak_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(result))


def measure(tool: str, path: Path, work: Path) -> dict | str:
    """The tool's result from its own process, or why it was skipped."""
    module = TOOLS[tool][1]
    if module:
        try:
            __import__(module)
        except ImportError as exc:
            return f"skipped: {module} is not installed ({exc}); pip install {module}"
    out = work / tool
    out.mkdir()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, __file__, "--child", tool, str(path), str(out)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the tool's process and any it waited for
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(lines[-1][len("RESULT "):]) | {"cpu_seconds": cpu}


def write_corpus(path: Path, mb: float, seed: int = 0) -> tuple[int, list[list[str]]]:
    docs, groups = planted_corpus(max(10, int(mb * 1e6 / 2500 / 1.25)), seed=seed)
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    return len(docs), groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200, help="corpus size in MB (default 200)")
    parser.add_argument("--tools", nargs="*", default=["ours", "ours-20x5", "datatrove", "datasketch"],
                        choices=list(TOOLS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = work / "corpus" / "corpus.jsonl"
        path.parent.mkdir()
        n_docs, groups = write_corpus(path, args.mb)
        planted = sum(len(g) - 1 for g in groups)
        print(f"corpus: {path.stat().st_size / 1e6:.1f} MB, {n_docs} documents, {planted} planted duplicates "
              f"in {len(groups)} groups; one process (one core) per tool")
        rates = {}
        for tool in args.tools:
            r = measure(tool, path, work)
            if isinstance(r, str):
                print(f"{tool:<11} {r}")
                continue
            recall, precision = score(set(r["removed"]), groups, n_docs)
            rates[tool] = (n_docs / r["cpu_seconds"], recall, precision)
            print(f"{tool:<11} {n_docs / r['cpu_seconds']:9.0f} docs/s/core  peak {r['peak_mb']:7.0f} MB  "
                  f"recall {recall:.3f}  precision {precision:.3f}  ({r['cpu_seconds']:.1f} CPU s, "
                  f"{r['seconds']:.1f} s wall)")
        memory_at_two_sizes(work, args.mb)
        if "ours" in rates and "datatrove" in rates:
            ours, dt = rates["ours"], rates["datatrove"]
            print(f"targets: throughput {ours[0] / dt[0]:.1f}x datatrove's per core (target >= 3x): "
                  f"{'met' if ours[0] >= 3 * dt[0] else 'NOT met'}; recall {ours[1]:.3f} vs {dt[1]:.3f}, precision "
                  f"{ours[2]:.3f} vs {dt[2]:.3f} (target >=): "
                  f"{'met' if ours[1] >= dt[1] and ours[2] >= dt[2] else 'NOT met'}")


def memory_at_two_sizes(work: Path, mb: float) -> None:
    """Peak RSS of our streaming stage (fingerprinting) at mb/2 and mb: grows by the signatures only."""
    for size in (mb / 2, mb):
        path = work / f"mem-{size}" / "corpus.jsonl"
        path.parent.mkdir()
        n_docs, _ = write_corpus(path, size, seed=1)
        r = measure("ours-fingerprint", path, work / f"mem-{size}")
        if isinstance(r, dict):
            print(f"streaming stage at {path.stat().st_size / 1e6:7.1f} MB ({n_docs} docs): peak {r['peak_mb']:.0f} MB "
                  f"(signatures: {n_docs * 400 / 1e6:.1f} MB)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
