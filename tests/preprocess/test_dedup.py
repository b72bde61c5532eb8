"""Deduplication (gpt2forge.preprocess.dedup, minhash, openwebtext_dedup) and the seed's three commands."""

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from gpt2forge.core.errors import UsageError
from gpt2forge.core.json_lines import json_object
from gpt2forge.ops import library as custom_ops
from gpt2forge.preprocess import dedup, minhash
from gpt2forge.preprocess.dedup import (
    candidate_pairs,
    exact_duplicates,
    fingerprint_files,
    group_duplicates,
    load_fingerprints,
    near_duplicates,
    save_fingerprints,
)
from gpt2forge.preprocess.minhash import MinHasher, MinHashParams, exact_hash, jaccard, normalize_text
from gpt2forge.preprocess.openwebtext_dedup import find_duplicates, find_duplicates_parser

REPO = Path(__file__).resolve().parents[2]
# The planted corpus is the benchmark's, so the figures here and there come from one generator.
_spec = importlib.util.spec_from_file_location("dedup_throughput", REPO / "benchmarks" / "dedup_throughput.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def run_tool(name: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "data" / name), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_normalization_and_exact_dedup(tmp_path):
    assert normalize_text("  Caf\u0065\u0301  Au\tLait\n\n") == "caf\u00e9 au lait"  # NFC, lower-case, spaces
    assert exact_hash("Hello   World") == exact_hash("hello world\n") != exact_hash("hello worlds")
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "A b c"}, {"text": "x y"}, {"text": "a  B c"},
                                              {"text": "x y"}, {"text": "a b c d"}])
    fp = fingerprint_files([(path, None)], workers=0, progress=False)
    assert exact_duplicates(fp).tolist() == [False, False, True, True, False]  # the first copy is kept
    assert fp.keys == ["line:1", "line:2", "line:3", "line:4", "line:5"]
    assert dedup.write_kept(fp, exact_duplicates(fp), tmp_path / "kept.jsonl") == (3, len("a  B c") + len("x y"))
    assert [json.loads(x)["text"] for x in (tmp_path / "kept.jsonl").read_text().splitlines()] == \
        ["A b c", "x y", "a b c d"]


def test_minhash_estimate_within_theoretical_bound():
    """On 40 random pairs the estimate is within 4 sigma, sigma = sqrt(J(1-J)/100), of the exact Jaccard."""
    rng = np.random.default_rng(0)
    hasher = MinHasher()
    z = []
    for _ in range(40):
        shared = rng.integers(0, 2**63, int(rng.integers(200, 1800)), dtype=np.uint64)
        a = np.unique(np.concatenate([shared, rng.integers(0, 2**63, 2000 - len(shared), dtype=np.uint64)]))
        b = np.unique(np.concatenate([shared, rng.integers(0, 2**63, 2000 - len(shared), dtype=np.uint64)]))
        exact = jaccard(a, b)
        estimate = np.mean(hasher.signature(a) == hasher.signature(b))
        z.append((estimate - exact) / np.sqrt(exact * (1 - exact) / 100))
    assert np.max(np.abs(z)) < 4, z
    assert abs(np.mean(z)) < 4 / np.sqrt(len(z)), "the estimate is biased"


@pytest.mark.parametrize("op", [True, False], ids=["custom op", "numpy"])
def test_fingerprints_of_a_batch_equal_each_documents_own(monkeypatch, op):
    """A chunk's signatures (each text normalized once, the custom op on shingles with repeats, or numpy
    without the library) and exact hashes equal `signature` of each text's unique shingles and `exact_hash`."""
    if op and not custom_ops.has_op("minhash_signatures"):
        pytest.skip("the custom ops library is not built (make custom_ops)")
    monkeypatch.setattr(custom_ops, "has_op", lambda name: op and name == "minhash_signatures")
    base = "The quick brown fox jumps over the lazy dog. " * 3
    texts = ["", "a", "abcd", "  Ab  \n", base, base.upper(), "Ça  été\tÉTÉ " * 40]
    texts += [d["text"] for d in bench.planted_corpus(20)[0]]
    for params in (MinHashParams(), MinHashParams(num_perm=7, bands=7), MinHashParams(shingle="words", ngram=3)):
        hasher = MinHasher(params)
        dedup._init(params)
        sigs, exact = dedup._fingerprint_chunk(texts)
        assert sigs.dtype == np.uint32 and exact.dtype == np.uint64
        assert np.array_equal(sigs, np.stack([hasher.signature(hasher.shingles(t)) for t in texts])), params
        assert exact.tolist() == [exact_hash(t) for t in texts]
    assert sigs[0].tolist() == [0xFFFFFFFF] * params.num_perm  # no shingles: all-ones, like no other document


def test_jaccard_modes():
    a, b = np.array([1, 2, 3, 4], np.uint64), np.array([3, 4, 5], np.uint64)
    assert (jaccard(a, b, "union"), jaccard(a, b, "min"), jaccard(a, b, "max")) == (2 / 5, 2 / 3, 2 / 4)
    assert jaccard(a, np.zeros(0, np.uint64)) == 0.0


def test_a_sample_decides_only_pairs_far_from_the_threshold_and_on_their_side():
    """`sample_decides` on 1-in-16 samples, 300 pairs from Jaccard 0.2 to 0.95 of 2,000-25,000
    shingles: every pair it decides is on the side of the threshold its exact Jaccard is; pairs far
    from it are decided, pairs within 0.01 of it never; fewer than SAMPLE_MIN shingles never."""
    rng = np.random.default_rng(7)

    def pair(size: int, j: float) -> tuple[np.ndarray, np.ndarray]:
        shared = int(round(2 * size * j / (1 + j)))  # |A&B| for |A| = |B| = size at Jaccard j
        pool = rng.integers(0, 2**64 - 1, 2 * size, dtype=np.uint64, endpoint=True)
        return np.unique(pool[:size]), np.unique(np.concatenate([pool[:shared], pool[size:2 * size - shared]]))

    decided = []
    for j in np.linspace(0.2, 0.95, 300):
        a, b = pair(int(rng.integers(2_000, 25_000)), float(j))
        sim = minhash.sample_decides(minhash.sample(a), minhash.sample(b), 0.5)
        if sim is not None:
            assert (sim > 0.5) == (jaccard(a, b) > 0.5), (j, sim)
            decided.append(j)
        if abs(j - 0.5) < 0.01:
            assert sim is None
    assert min(decided) < 0.3 and max(decided) > 0.9 and len(decided) > 150, len(decided)
    for j in (0.25, 0.9):
        a, b = pair(60_000, j)
        assert minhash.sample_decides(minhash.sample(a), minhash.sample(b), 0.5) == pytest.approx(j, abs=0.05)
    a, b = pair(2_000, 0.0)  # ~250 sampled: too few to decide
    assert minhash.sample_decides(minhash.sample(a), minhash.sample(b), 0.5) is None


def test_near_dedup_recall_and_precision_on_planted_corpus(tmp_path):
    """Default settings (char 5-grams, 100 hashes, 10 bands, Jaccard > 0.5) on 300 distinct documents
    and their planted copies (1-3% words edited / paragraphs reordered / boilerplate added).

    Measured: 444 documents, 144 planted copies; recall 0.90 (129 found), precision 1.00. 10 bands of
    10 rows find a pair of similarity J with probability 1 - (1 - J^10)^10: 0.94 at J = 0.87, the
    typical edited copy (the seed's defaults are tuned for J >= 0.8), so recall >= 0.85; exact
    verification leaves no false pair, so precision >= 0.99.
    """
    docs, groups = bench.planted_corpus(300, seed=3)
    path = write_jsonl(tmp_path / "planted.jsonl", docs)
    fp = fingerprint_files([(path, "id")], workers=0, progress=False)
    found = near_duplicates(fp, workers=0, progress=False)
    removed, pairs = found.removed, found.pairs
    recall, precision = bench.score({k for k, r in zip(fp.keys, removed) if r}, groups, len(docs))
    assert recall >= 0.85 and precision >= 0.99, (recall, precision)
    assert all(i < j and sim > 0.5 for i, j, sim in pairs)


def test_a_group_of_k_copies_costs_about_k_comparisons_and_the_same_removals(tmp_path):
    """k near copies of one document: with every pair a candidate (--heuristic-iter -1) there are
    ~k^2 / 2 candidates, but pairs inside a group already made are not compared, so the comparisons
    grow as k; the documents removed are those of comparing every candidate."""
    rng = np.random.default_rng(5)
    vocab = [f"w{i}" for i in range(3000)]
    base = [vocab[i] for i in rng.integers(0, len(vocab), 500)]
    docs = [{"id": "other", "text": " ".join(vocab[i] for i in rng.integers(0, len(vocab), 500))}]
    for c in range(41):
        words = list(base)
        for at in rng.choice(len(words), 0 if c == 0 else 8, replace=False):
            words[at] = vocab[int(rng.integers(len(vocab)))]
        docs.append({"id": f"copy{c}", "text": " ".join(words)})
    fp = fingerprint_files([(write_jsonl(tmp_path / "c.jsonl", docs), "id")], workers=0, progress=False)
    compared = {}
    for k in (10, 40):
        rows = np.arange(k + 2)
        found = near_duplicates(fp, workers=0, progress=False, heuristic_iter=-1, rows=rows)
        every = dedup.verify_pairs(fp, candidate_pairs(fp, -1, rows=rows), workers=0, progress=False).pairs
        assert np.array_equal(found.removed[rows], group_duplicates(len(fp), every)[rows] != rows)
        assert found.removed[2:k + 2].all() and not found.removed[:2].any()
        assert found.candidates >= k * (k + 1) / 2 * 0.9, found.candidates  # nearly every pair
        compared[k] = found.compared
        parallel = near_duplicates(fp, workers=2, progress=False, heuristic_iter=-1, rows=rows)
        assert np.array_equal(parallel.removed, found.removed)  # workers hand out a few tasks ahead: more compared
        assert found.compared <= parallel.compared <= found.candidates * (1 if k == 10 else 0.5)
    assert compared[10] <= 12 and compared[40] <= 4 * compared[10], compared


def test_group_duplicates_keeps_the_first_member():
    labels = group_duplicates(6, [(1, 4, 0.9), (4, 5, 0.8), (0, 2, 0.7)])
    assert labels.tolist() == [0, 1, 0, 3, 1, 1]


def test_candidate_pairs_heuristic_iter():
    params = MinHashParams(num_perm=10, bands=10)
    sigs = np.zeros((4, 10), np.uint32)  # four identical signatures: one bucket per band
    fp = dedup.Fingerprints(params, [], ["a", "b", "c", "d"], sigs, *(np.zeros(4, t) for t in
                                                                     (np.uint64, np.int32, np.int64, np.int64)))
    assert candidate_pairs(fp, 1).tolist() == [[0, 1], [0, 2], [0, 3]]
    assert len(candidate_pairs(fp, -1)) == 6


def test_fingerprints_round_trip_and_incremental(tmp_path):
    docs, groups = bench.planted_corpus(60, dup_fraction=0.5, seed=5)
    first, second = docs[:len(docs) // 2], docs[len(docs) // 2:]
    shard1 = write_jsonl(tmp_path / "shard1.jsonl", first)
    shard2 = write_jsonl(tmp_path / "shard2.jsonl", second)
    fp1 = fingerprint_files([(shard1, "id")], workers=0, progress=False)
    save_fingerprints(fp1, tmp_path / "shard1.npz")
    loaded = load_fingerprints(tmp_path / "shard1.npz")
    assert loaded.keys == fp1.keys and loaded.params == fp1.params
    assert np.array_equal(loaded.signatures, fp1.signatures) and np.array_equal(loaded.line, fp1.line)
    with np.load(tmp_path / "shard1.npz", allow_pickle=False) as z:  # plain arrays, no object dtype
        assert all(z[name].dtype != object for name in z.files)

    args = find_duplicates_parser().parse_args(["--load-fingerprints", str(tmp_path / "shard1.npz"), "--inputs",
                                                str(shard2), "id", "--output", str(tmp_path / "pairs.json"),
                                                "--workers", "0"])
    find_duplicates(args)
    lines = [json.loads(line) for line in (tmp_path / "pairs.json").read_text().splitlines()]
    in_first = {d["id"] for d in first}
    expected = {frozenset((a, b)) for g in groups for a in g for b in g if a in in_first and b not in in_first}
    found = {frozenset((main, other)) for line in lines for main, others in line.items() for o in others
             for other in o}
    cross = {p for p in found if len(p & in_first) == 1}
    assert cross and len(cross & expected) >= 0.8 * len(expected) and cross <= expected
    for line in lines:  # shard 1's documents come first, so a cross pair's main is from shard 1
        for main, others in line.items():
            assert main in in_first or not any(o in in_first for other in others for o in other)


def test_pickle_fingerprints_are_refused(tmp_path):
    import pickle
    (tmp_path / "old.pkl").write_bytes(pickle.dumps({"lshcache": 1}))
    with pytest.raises(UsageError, match="not a gpt2forge fingerprint file"):
        load_fingerprints(tmp_path / "old.pkl")


@pytest.mark.slow
def test_seed_commands_end_to_end(tmp_path):
    """The seed's three steps as written: find_duplicates -> group_duplicate_url -> remove_group_duplicates."""
    docs = [{"url": f"u{i}", **d} for i, d in enumerate(bench.planted_corpus(40, dup_fraction=0.5, seed=7)[0])]
    write_jsonl(tmp_path / "clean.json", docs)
    r = run_tool("find_duplicates.py", "--inputs", "clean.json", "url", "--output", "pairs.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    pairs = [json.loads(line) for line in (tmp_path / "pairs.json").read_text().splitlines()]
    assert pairs and all(isinstance(v, list) and all(len(o) == 1 for o in v) for p in pairs for v in p.values())
    assert run_tool("group_duplicate_url.py", "pairs.json", "groups.json", cwd=tmp_path).returncode == 0
    groups = [json.loads(line) for line in (tmp_path / "groups.json").read_text().splitlines()]
    assert [list(g) for g in groups] == [[str(i)] for i in range(len(groups))]
    r = run_tool("remove_group_duplicates.py", "groups.json", "clean.json", "dedup.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    kept = [json.loads(line)["url"] for line in (tmp_path / "dedup.json").read_text().splitlines()]
    removed = {u for g in groups for urls in g.values() for u in urls[1:]}
    assert kept == [d["url"] for d in docs if d["url"] not in removed] and removed
    order = {d["url"]: i for i, d in enumerate(docs)}
    assert all(min(urls, key=order.get) == urls[0] for g in groups for urls in g.values())  # earliest kept
    again = run_tool("remove_group_duplicates.py", "groups.json", "clean.json", "dedup.json", cwd=tmp_path)
    assert "already complete" in again.stdout


def test_group_threshold(tmp_path):
    from gpt2forge.preprocess.openwebtext_dedup import group_pairs
    write_jsonl(tmp_path / "pairs.json", [{"a": [{"b": 0.9}, {"c": 0.6}]}, {"d": [{"e": 0.75}]}])
    group_pairs(tmp_path / "pairs.json", tmp_path / "groups.json", 0.7)
    assert (tmp_path / "groups.json").read_text().splitlines() == ['{"0": ["a", "b"]}', '{"1": ["d", "e"]}']


def test_bad_input_names_file_and_line(tmp_path):
    (tmp_path / "clean.json").write_text('{"text": "fine", "url": "a"}\n{"text": oops}\n')
    r = run_tool("find_duplicates.py", "--inputs", "clean.json", "url", "--output", "pairs.json", "--workers", "0",
                 cwd=tmp_path)
    assert r.returncode == 2 and "clean.json:2:" in r.stderr and "--skip-bad-lines" in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error:") and not (tmp_path / "pairs.json").exists()
    (tmp_path / "groups.json").write_text('{"0": ["a", "b"]}\n[1, 2]\n')
    r = run_tool("remove_group_duplicates.py", "groups.json", "clean.json", "out.json", cwd=tmp_path)
    assert r.returncode == 2 and "groups.json:2:" in r.stderr and not (tmp_path / "out.json").exists()


def test_fingerprints_of_many_ranges_equal_those_of_one(tmp_path, monkeypatch):
    """Workers read line-aligned ranges of the files: cut into ranges of a few hundred bytes, with blank
    and bad lines, a last line without a newline and a second file, every row (key, file, line, length,
    signature, exact hash) and the bad-line count equal reading each file whole; a bad line deep in a
    file is named by its own line, and a file of blank lines is refused as empty."""
    docs, _ = bench.planted_corpus(30, seed=29)
    lines = [json.dumps(d) for d in docs]
    lines[7:7] = ["", "not json", "   "]
    first = tmp_path / "a.jsonl"
    first.write_text("\n".join(lines))  # no newline after the last line
    second = write_jsonl(tmp_path / "b.jsonl", docs[:5])
    inputs = [(first, "id"), (second, None)]

    def fingerprints(span_bytes: int, workers: int, skip_bad_lines: bool = True):
        monkeypatch.setattr(dedup, "SPAN_BYTES", span_bytes)
        bad = Counter()
        return fingerprint_files(inputs, workers=workers, skip_bad_lines=skip_bad_lines, bad=bad, progress=False), bad

    (whole, bad), (cut, cut_bad) = fingerprints(1 << 30, 0), fingerprints(300, 2)
    assert len(dedup._spans(str(first), first.stat().st_size)) > 20
    assert cut.keys == whole.keys and bad == cut_bad == Counter(bad_lines=1)
    for name in ("signatures", "exact", "source", "line", "chars"):
        assert np.array_equal(getattr(cut, name), getattr(whole, name)), name
    assert whole.line[:9].tolist() == [1, 2, 3, 4, 5, 6, 7, 11, 12]  # the lines read_documents numbers

    lines[8], lines[20] = "", '{"text": oops}'  # the only bad line, in a later range
    first.write_text("\n".join(lines))
    with pytest.raises(UsageError, match=r"a\.jsonl:21: "):
        fingerprints(300, 2, skip_bad_lines=False)
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    for empty in ("blank.jsonl", "none.jsonl"):
        (tmp_path / "none.jsonl").write_text("")
        inputs = [(second, None), (tmp_path / empty, None)]
        with pytest.raises(UsageError, match=rf"{empty}: the file is empty"):
            fingerprints(300, 0)


def test_skip_bad_lines_counts(tmp_path, capsys):
    path = tmp_path / "clean.json"
    path.write_text('{"text": "one two three", "url": "a"}\nnot json\n{"url": "b"}\n{"text": "x", "url": "c"}\n')
    args = find_duplicates_parser().parse_args(["--inputs", str(path), "url", "--output", str(tmp_path / "p.json"),
                                                "--workers", "0", "--skip-bad-lines"])
    find_duplicates(args)
    assert "bad lines skipped: 2" in capsys.readouterr().out


def test_interrupted_write_leaves_no_output(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "clean.json", [{"text": "same text here", "url": "a"},
                                                 {"text": "same text here", "url": "b"}])

    def interrupted(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(dedup.np, "savez", interrupted)  # the fingerprint file dies mid-write
    args = find_duplicates_parser().parse_args(["--inputs", str(path), "url", "--save-fingerprints",
                                                str(tmp_path / "fp.npz"), "--output", str(tmp_path / "pairs.json"),
                                                "--workers", "0"])
    with pytest.raises(KeyboardInterrupt):
        find_duplicates(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean.json"]


def test_params_are_validated():
    with pytest.raises(UsageError, match="bands must divide"):
        MinHashParams(num_perm=100, bands=7)
    with pytest.raises(UsageError, match="--shingle"):
        MinHashParams(shingle="bytes")


def test_workers_and_verification_batches_do_not_change_the_result(tmp_path):
    docs, _ = bench.planted_corpus(40, dup_fraction=0.5, seed=11)
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    fp = fingerprint_files([(path, "id")], workers=0, progress=False)
    parallel = fingerprint_files([(path, "id")], workers=2, progress=False)
    assert np.array_equal(fp.signatures, parallel.signatures) and fp.keys == parallel.keys
    pairs = candidate_pairs(fp)
    one_pass = dedup.verify_pairs(fp, pairs, workers=0, progress=False)
    assert one_pass.pairs and one_pass.compared == len(pairs)  # without groups every candidate is compared
    assert dedup.verify_pairs(fp, pairs, workers=2, budget_chars=1, progress=False) == one_pass


def test_word_shingles(tmp_path):
    params = MinHashParams(shingle="words", ngram=3)
    hasher = MinHasher(params)
    a = hasher.shingles("the quick brown fox jumps over the lazy dog")
    b = hasher.shingles("The quick  brown fox jumps over the lazy cat")
    assert a.size == 7 and jaccard(a, b) == 6 / 8
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "one two three four five six " * 20, "url": "a"},
                                              {"text": "one two three four five six " * 20 + "seven", "url": "b"}])
    fp = fingerprint_files([(path, "url")], params, workers=0, progress=False)
    found = near_duplicates(fp, workers=0, progress=False)
    removed, pairs = found.removed, found.pairs
    assert removed.tolist() == [False, True] and pairs[0][:2] == (0, 1)


def test_two_pass_recipe_matches_one_run(tmp_path):
    """Shards fingerprinted separately (machine 1, machine 2), then combined: the same pairs as one run."""
    docs, _ = bench.planted_corpus(40, dup_fraction=0.5, seed=13)
    shard1 = write_jsonl(tmp_path / "s1.jsonl", docs[:30])
    shard2 = write_jsonl(tmp_path / "s2.jsonl", docs[30:])
    for shard in (shard1, shard2):
        find_duplicates(find_duplicates_parser().parse_args(
            ["--inputs", str(shard), "id", "--save-fingerprints", str(shard.with_suffix(".npz")), "--workers", "0"]))
    find_duplicates(find_duplicates_parser().parse_args(
        ["--load-fingerprints", str(shard1.with_suffix(".npz")), str(shard2.with_suffix(".npz")),
         "--output", str(tmp_path / "combined.json"), "--workers", "0"]))
    find_duplicates(find_duplicates_parser().parse_args(
        ["--inputs", str(shard1), "id", str(shard2), "id", "--output", str(tmp_path / "one.json"), "--workers", "0"]))
    combined = (tmp_path / "combined.json").read_text()
    assert combined and combined == (tmp_path / "one.json").read_text()


def test_verification_reads_only_the_compared_lines_a_batch_at_a_time(tmp_path, monkeypatch):
    """Texts are re-read by seeking to their lines, where they are compared: the lines parsed are
    each comparison's documents (not a pass over the file per batch), batches hold at most their
    budget of text, and this process reads none of it."""
    docs, _ = bench.planted_corpus(80, dup_fraction=0.5, seed=17)
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    fp = fingerprint_files([(path, "id")], workers=0, progress=False)
    pairs = candidate_pairs(fp)
    whole = dedup.verify_pairs(fp, pairs, workers=0, progress=False)
    parsed, held, tasks = [], [], []
    real_locate, real_verify = dedup.TextReader.locate, dedup._verify_group

    def locate(self, wanted):
        where = real_locate(self, wanted)
        held.append(sum(chars for *_, chars in where.values()))
        return where

    monkeypatch.setattr(dedup, "json_object", lambda raw: (parsed.append(raw), json_object(raw))[1])
    monkeypatch.setattr(dedup.TextReader, "locate", locate)
    monkeypatch.setattr(dedup, "_verify_group", lambda task: (tasks.append(task), real_verify(task))[1])
    monkeypatch.setattr(dedup.TextReader, "read", None)  # nothing is read here
    budget = 2 * int(fp.chars.max())
    assert dedup.verify_pairs(fp, pairs, workers=0, budget_chars=budget, progress=False) == whole
    assert len(held) > 2 and max(held) <= budget
    assert len(parsed) == sum(1 + len(others) for _, _, others, *_ in tasks) == len(tasks) + len(pairs)


def test_a_few_early_texts_are_read_without_indexing_the_whole_file(tmp_path):
    """A stage's examples (its first removed rows) index the lines only that far; a later read past
    them indexes the whole file, and every text read equals the file's."""
    docs, _ = bench.planted_corpus(60, seed=23)
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    fp = fingerprint_files([(path, "id")], workers=0, progress=False)
    reader = dedup.TextReader(fp)
    assert reader.read(np.array([2, 0])) == {0: docs[0]["text"], 2: docs[2]["text"]}
    starts, whole = reader._starts[0]
    assert len(starts) == 3 and not whole
    last = len(fp) - 1
    assert reader.read(np.array([1, last])) == {1: docs[1]["text"], last: docs[last]["text"]}
    starts, whole = reader._starts[0]
    assert whole and len(starts) == len(docs)


def test_verification_refuses_a_file_changed_since_fingerprinting(tmp_path):
    docs, _ = bench.planted_corpus(40, dup_fraction=0.5, seed=19)
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    fp = fingerprint_files([(path, "id")], workers=0, progress=False)
    pairs = candidate_pairs(fp)
    write_jsonl(path, [d | {"text": d["text"] + " edited"} for d in docs])
    with pytest.raises(UsageError, match=r"c\.jsonl: changed since it was fingerprinted"):
        dedup.verify_pairs(fp, pairs, workers=0, progress=False)


def test_near_duplicates_of_some_rows_equal_those_of_a_copy_of_them(tmp_path):
    """`rows` compares only those documents, as a copy of their fingerprints would, without the copy."""
    docs, _ = bench.planted_corpus(120, dup_fraction=0.5, seed=23)
    fp = fingerprint_files([(write_jsonl(tmp_path / "c.jsonl", docs), "id")], workers=0, progress=False)
    rows = np.flatnonzero(np.arange(len(fp)) % 3 != 1)
    copy = dedup.Fingerprints(fp.params, fp.sources, [fp.keys[i] for i in rows], fp.signatures[rows],
                              fp.exact[rows], fp.source[rows], fp.line[rows], fp.chars[rows])
    found, found_copy = near_duplicates(fp, workers=0, progress=False, rows=rows), near_duplicates(
        copy, workers=0, progress=False)
    removed, pairs, removed_copy, pairs_copy = found.removed, found.pairs, found_copy.removed, found_copy.pairs
    assert pairs and [(rows[i], rows[j], s) for i, j, s in pairs_copy] == pairs
    assert np.array_equal(np.flatnonzero(removed), rows[removed_copy]) and not removed[np.arange(1, len(fp), 3)].any()
