"""A web-like corpus of any size with planted removals, and the truth of what each stage must drop.

    .venv/bin/python benchmarks/web_corpus.py --docs 1000000 --output web.jsonl --truth web.truth.json \
        --seed 0 [--contaminate lambada_test.jsonl wiki.test.raw]

Text that ships with the installation, nothing downloaded: English sentences of the Python standard
library's documentation (gpt2forge.text.corpus.build_documents, `make train`'s corpus; so the bytes
depend on the seed and the Python version), the Turkish, German, French and Spanish sentences of
benchmarks/langid_speed.py, and passages of the files given with `--contaminate`. Each line is
`{"id": i, "url": ..., "text": ...}`, written as it is made: memory is the sentence pool, a reservoir
of RESERVOIR earlier documents to copy and the truth's integers, whatever `--docs`. Each document is
one kind, drawn with the probabilities of MIX (the rest are distinct):

- distinct: pool sentences in paragraphs, log-normal length (median 2.5 kB) from 1.1 kB to ~100 kB;
  30% join their sentences with em dashes. Never dropped.
- short: one or two sentences, under 300 characters. clean: min_tokens (with --quality: word_count).
- other_language: tr, de, fr or es sentences, 1.1 kB or more. clean: lang.
- boilerplate: a page whose ten menu lines repeat at its foot. Kept; with --quality, clean:
  duplicate_lines.
- exact_duplicate: an earlier distinct document: the same bytes, lower-cased with its spaces
  doubled, or its mojibake (UTF-8 read as Windows-1252, which ftfy repairs in clean). exact_dedup.
- near_duplicate: an earlier distinct document with words replaced to a Jaccard in NEAR_TARGETS,
  its paragraphs reordered, or a header and footer added. near_dedup (LSH finds a pair with a
  probability that rises with its Jaccard).
- contaminated: a distinct document holding a 30-50-word passage of a --contaminate file.
  decontaminate (drop mode).

Copies always follow their original, so the earliest-kept rule drops the copy. The truth (JSON,
`TRUTH_FORMAT`) lists the ids of each kind, each duplicate's original and how it was made, and each
near duplicate's Jaccard (character 5-grams of the normalized text, union: prepare_corpus.py's
defaults). `expected_removals` turns it into each stage's drops; `account` scores a run's drops
(`stage_removals`) against them.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import resource
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from langid_speed import SAMPLE  # noqa: E402

from gpt2forge.preprocess.jsonl import atomic_json, atomic_jsonl  # noqa: E402
from gpt2forge.preprocess.minhash import exact_hash, jaccard, shingle_hashes  # noqa: E402

TRUTH_FORMAT = "gpt2forge-web-corpus-truth"
MIX = {"short": 0.04, "other_language": 0.05, "boilerplate": 0.02, "exact_duplicate": 0.05,
       "near_duplicate": 0.15, "contaminated": 0.01}
"""Probability of each planted kind per document; `contaminated` only with --contaminate."""
KINDS = ("distinct", *MIX)
NEAR_TARGETS = (0.55, 0.65, 0.75, 0.85, 0.95)
"""Jaccard levels of the word-replaced near duplicates: most land within 0.02, short documents
further off (the truth has each one's exact Jaccard)."""
MEDIAN_CHARS, SIGMA, MIN_CHARS, MAX_CHARS = 2500, 1.0, 1100, 100_000
"""Log-normal document length: 1.1 kB keeps every kept document over 128 GPT-2 tokens."""
RESERVOIR = 1000
MENU = ("Home", "News", "Sport", "Business", "Opinion", "Culture", "Contact us", "Privacy policy",
        "Terms of use")
BOILERPLATE = ("Subscribe to our newsletter for the latest stories. Share this article with your friends. "
               "All rights reserved. Read more about our privacy policy and terms of use.")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def replace_words(rng: np.random.Generator, paragraphs: list[list[str]], fraction: float,
                  vocab: list[str]) -> list[list[str]]:
    """A copy of `paragraphs` (lists of words) with each word replaced by a random `vocab` word with
    probability `fraction` (dedup_throughput.py's planted copies use it too)."""
    out = [list(p) for p in paragraphs]
    for p in out:
        for i in np.flatnonzero(rng.random(len(p)) < fraction):
            p[i] = vocab[rng.integers(len(vocab))]
    return out


def with_header_footer(paragraphs: list[list[str]]) -> list[list[str]]:
    """`paragraphs` with BOILERPLATE above and its first 12 words below."""
    return [BOILERPLATE.split()] + paragraphs + [BOILERPLATE.split()[:12]]


@functools.lru_cache(maxsize=1)
def english_sentences() -> list[str]:
    """Unique sentences of 4-60 words of the stdlib's documentation prose, in a fixed order; none with
    '#' or an ellipsis (Gopher's symbol rules) or starting with a bullet."""
    from gpt2forge.text.corpus import build_documents
    seen: dict[str, None] = {}
    for doc in build_documents():
        for para in doc.split("\n\n"):
            for s in _SENTENCE_END.split(" ".join(para.split())):
                if (4 <= len(s.split()) <= 60 and s[0].isupper() and s[-1] in ".!?" and "#" not in s
                        and "..." not in s and "\u2026" not in s):
                    seen[s] = None
    return list(seen)


def eval_passages(paths: list[str | Path], text_key: str = "text") -> list[list[str]]:
    """Word lists of the lines of the evaluation files (read as the decontamination stage reads them)
    that have at least 30 words."""
    from gpt2forge.preprocess.decontaminate import _eval_texts
    out = []
    for path in paths:
        for text in _eval_texts(Path(path), text_key):
            out += [ws for line in text.splitlines() if len(ws := line.split()) >= 30]
    return out


class Truth:
    """What was planted, as columns of ints and strings (small next to the corpus)."""

    def __init__(self):
        self.planted: dict[str, list[int]] = {k: [] for k in KINDS}
        self.exact: dict[str, list] = {"id": [], "of": [], "how": []}
        self.near: dict[str, list] = {"id": [], "of": [], "how": [], "target": [], "jaccard": []}
        self.languages: list[str] = []


class Reservoir:
    """A uniform sample of at most RESERVOIR of the documents offered so far (algorithm R), as
    entries [id, text, exact hashes of it and of its near copies made so far]."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.entries, self.offered = rng, [], 0

    def offer(self, i: int, text: str) -> None:
        self.offered += 1
        if len(self.entries) < RESERVOIR:
            self.entries.append([i, text, set()])
        elif (j := int(self.rng.integers(self.offered))) < RESERVOIR:
            self.entries[j] = [i, text, set()]

    def pick(self) -> list:
        return self.entries[int(self.rng.integers(len(self.entries)))]


class WebCorpus:
    """Draws documents one at a time (`document(i)`), recording each in `truth`."""

    def __init__(self, seed: int, passages: list[list[str]] | None = None):
        self.rng = np.random.default_rng(seed)
        self.sentences = english_sentences()
        self.lengths = np.array([len(s) + 1 for s in self.sentences])
        self.vocab = sorted({w for s in self.sentences for w in s.split() if w.isalpha() and w.islower()})
        self.passages = passages or []
        mix = {k: p for k, p in MIX.items() if k != "contaminated" or self.passages}
        self.kinds = ["distinct", *mix]
        self.probs = np.array([1 - sum(mix.values()), *mix.values()])
        self.reservoir = Reservoir(self.rng)  # distinct documents, to copy
        self.dashed = Reservoir(self.rng)     # those of them holding an em dash, for mojibake
        self.truth = Truth()

    def length(self, low: int = MIN_CHARS, high: int = MAX_CHARS) -> int:
        return int(np.clip(self.rng.lognormal(np.log(MEDIAN_CHARS), SIGMA), low, high))

    def prose(self, chars: int, dashed: bool = False) -> list[str]:
        """Paragraphs of 2-8 pool sentences, `chars` characters or a sentence more."""
        rng, picked, total = self.rng, [], 0
        while total < chars:
            idx = rng.integers(0, len(self.sentences), max(8, chars // 80))
            cum = total + np.cumsum(self.lengths[idx])
            k = int(np.searchsorted(cum, chars)) + 1
            picked += idx[:k].tolist()
            total = int(cum[min(k, len(cum)) - 1])
        paragraphs, start = [], 0
        while start < len(picked):
            n = int(rng.integers(2, 9))
            joint = " \u2014 " if dashed else " "
            paragraphs.append(joint.join(self.sentences[i] for i in picked[start:start + n]))
            start += n
        return paragraphs

    def document(self, i: int) -> dict:
        kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.probs))]
        if kind in ("exact_duplicate", "near_duplicate") and not self.reservoir.entries:
            kind = "distinct"
        text = getattr(self, kind)(i)
        self.truth.planted[kind].append(i)
        return {"id": i, "url": f"https://site{int(self.rng.integers(100_000))}.example/{i}", "text": text}

    def distinct(self, i: int) -> str:
        dashed = self.rng.random() < 0.3
        text = "\n\n".join(self.prose(self.length(), dashed))
        self.reservoir.offer(i, text)
        if dashed:
            self.dashed.offer(i, text)
        return text

    def unique(self, entry: list, copy: str) -> str:
        """`copy` with a word appended until it differs, after normalizing, from its original and the
        original's other near copies (two header-and-footer copies of one document would be exact
        duplicates of each other)."""
        seen = entry[2] or {exact_hash(entry[1])}
        while (h := exact_hash(copy)) in seen:
            copy += " " + self.vocab[int(self.rng.integers(len(self.vocab)))]
        seen.add(h)
        entry[2] = seen
        return copy

    def short(self, i: int) -> str:
        while True:
            s = self.sentences[int(self.rng.integers(len(self.sentences)))]
            if 40 <= len(s) < 300 and len(s.split()) < 50:
                return s

    def other_language(self, i: int) -> str:
        lang = ("tr", "de", "fr", "es")[int(self.rng.integers(4))]
        self.truth.languages.append(lang)
        paragraphs: dict[str, None] = {}  # no repeated paragraph: only the language rule may drop it
        target = self.length(high=20_000)
        while sum(len(p) + 2 for p in paragraphs) < target:
            sentences = SAMPLE[lang]
            paragraphs[" ".join(sentences[k] for k in self.rng.integers(0, 4, int(self.rng.integers(3, 7))))] = None
        return "\n\n".join(paragraphs)

    def boilerplate(self, i: int) -> str:
        site = " ".join(w.capitalize() for w in self.rng.choice(self.vocab, 2))
        menu = [f"{site} {item}" for item in MENU] + [f"Copyright {site}"]
        body = self.prose(self.length(high=4000))[:10]  # 10 repeated of at most 40 lines: over 30%
        while len("\n\n".join(body)) < MIN_CHARS:
            body[-1] += " " + self.sentences[int(self.rng.integers(len(self.sentences)))]
        return "\n".join(menu) + "\n\n" + "\n\n".join(body) + "\n\n" + "\n".join(menu)

    def exact_duplicate(self, i: int) -> str:
        how = ("identical", "case_space", "mojibake")[int(self.rng.integers(3))]
        mojibake = how == "mojibake" and self.dashed.entries  # needs a non-ASCII character to mangle
        of, text, _ = (self.dashed if mojibake else self.reservoir).pick()
        copy = text
        if mojibake:
            import ftfy
            import ftfy.bad_codecs  # noqa: F401  (registers sloppy-windows-1252)
            copy = text.encode("utf-8").decode("sloppy-windows-1252")
            if exact_hash(ftfy.fix_text(copy)) != exact_hash(ftfy.fix_text(text)):
                copy = text
        elif how == "case_space":
            copy = text.lower().replace(". ", ".  ").replace("\n\n", "\n \n")
            if exact_hash(copy) != exact_hash(text):
                copy = text
        self.truth.exact["id"].append(i)
        self.truth.exact["of"].append(of)
        self.truth.exact["how"].append(how if copy != text else "identical")
        return copy

    def near_duplicate(self, i: int) -> str:
        how = ("words", "words", "words", "reorder", "header_footer")[int(self.rng.integers(5))]
        entry = self.reservoir.pick()
        of, text, _ = entry
        paragraphs = [p.split(" ") for p in text.split("\n\n")]
        base = shingle_hashes(text)
        target = NEAR_TARGETS[int(self.rng.integers(len(NEAR_TARGETS)))] if how == "words" else None
        if how == "words":
            copy, j = self.to_jaccard(paragraphs, base, target)
        else:
            if how == "reorder":
                paragraphs = replace_words(self.rng, [paragraphs[k] for k in self.rng.permutation(len(paragraphs))],
                                           0.01, self.vocab)
            else:
                paragraphs = with_header_footer(paragraphs)
            copy = "\n\n".join(" ".join(p) for p in paragraphs)
        if (unique := self.unique(entry, copy)) != copy or how != "words":
            copy, j = unique, jaccard(base, shingle_hashes(unique))
        for key, value in (("id", i), ("of", of), ("how", how), ("target", target), ("jaccard", round(j, 4))):
            self.truth.near[key].append(value)
        return copy

    def to_jaccard(self, paragraphs: list[list[str]], base: np.ndarray, target: float) -> tuple[str, float]:
        """Words replaced until the character 5-gram Jaccard with the original is within 0.02 of
        `target` (at most 5 tries: the closest is kept). A replaced fraction f changes about 1.6 f of
        the shingles, a: J = (1 - a) / (1 + a)."""
        def changed(j: float) -> float:
            return (1 - j) / (1 + j)
        fraction, best = changed(target) / 1.6, ("", -1.0)
        for _ in range(5):
            copy = "\n\n".join(" ".join(p) for p in replace_words(self.rng, paragraphs, fraction, self.vocab))
            j = jaccard(base, shingle_hashes(copy))
            if j < 1.0 and abs(j - target) < abs(best[1] - target):
                best = (copy, j)
            if abs(j - target) <= 0.02:
                break
            fraction = min(0.9, fraction * (changed(target) / changed(j) if j < 1.0 else 2.0))
        return best

    def contaminated(self, i: int) -> str:
        paragraphs = self.prose(self.length())
        words = self.passages[int(self.rng.integers(len(self.passages)))]
        n = int(self.rng.integers(30, 51))
        start = int(self.rng.integers(0, max(1, len(words) - n + 1)))
        paragraphs.insert(int(self.rng.integers(len(paragraphs) + 1)), " ".join(words[start:start + n]))
        return "\n\n".join(paragraphs)


def write_corpus(docs: int, output: str | Path, truth_path: str | Path, seed: int = 0,
                 contaminate: list[str | Path] | None = None,
                 eval_text_key: str = "text") -> tuple[dict, float, float]:
    """Write `docs` documents to `output` and their truth to `truth_path` (both atomically); returns
    the truth and the wall and CPU seconds spent writing documents (not building the sentence pool).
    `contaminate`: evaluation files whose passages are planted (`eval_text_key`: the text field of
    the .json/.jsonl ones)."""
    corpus = WebCorpus(seed, eval_passages(contaminate or [], eval_text_key))
    start, cpu = time.perf_counter(), time.process_time()
    with atomic_jsonl(output) as out:
        for i in range(docs):
            out.write(corpus.document(i))
    t = corpus.truth
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    truth = {"format": TRUTH_FORMAT, "version": 1, "seed": seed, "docs": docs, "id_key": "id", "text_key": "text",
             "contaminate": [Path(p).name for p in contaminate or []],
             "counts": {k: len(v) for k, v in t.planted.items()}, "planted": t.planted,
             "other_language": t.languages, "exact_duplicates": t.exact, "near_duplicates": t.near}
    atomic_json(truth_path, truth)
    return truth, seconds, cpu


def expected_removals(truth: dict, quality: bool = False, threshold: float = 0.5) -> dict[str, dict[str, set]]:
    """{stage: {rule: ids}} prepare_corpus.py must drop with its defaults (`quality`: with --quality).
    Near duplicates: those whose Jaccard with their original is above `threshold`."""
    planted, near = truth["planted"], truth["near_duplicates"]
    clean = {"word_count" if quality else "min_tokens": set(planted["short"]), "lang": set(planted["other_language"])}
    if quality:
        clean["duplicate_lines"] = set(planted["boilerplate"])
    return {"clean": clean, "exact_dedup": {"exact_duplicate": set(truth["exact_duplicates"]["id"])},
            "near_dedup": {"near_duplicate": {i for i, j in zip(near["id"], near["jaccard"]) if j > threshold}},
            "decontaminate": {"contaminated": set(planted["contaminated"])}}


STAGE_FILES = (("clean", "clean.jsonl"), ("exact_dedup", "exact.jsonl"), ("near_dedup", "near.jsonl"),
               ("decontaminate", "decontaminated.jsonl"))


def ids(path: str | Path, id_key: str = "id") -> set:
    with open(path, "rb") as f:
        return {json.loads(line)[id_key] for line in f if line.strip()}


def stage_removals(corpus: str | Path, out_dir: str | Path) -> dict[str, set]:
    """{stage: ids it dropped} of a prepare_corpus.py run on `corpus` into `out_dir`."""
    before, removed = ids(corpus), {}
    for stage, name in STAGE_FILES:
        after = ids(Path(out_dir) / name)
        removed[stage], before = before - after, after
    return removed


def account(truth: dict, removed: dict[str, set], quality: bool = False) -> dict:
    """Per stage: expected, removed, right, recall, precision; near_dedup also recall per 0.1 of Jaccard."""
    out = {}
    for stage, rules in expected_removals(truth, quality).items():
        want, got = set().union(*rules.values()), removed.get(stage, set())
        right = len(want & got)
        out[stage] = {"expected": len(want), "removed": len(got), "right": right,
                      "recall": right / len(want) if want else 1.0, "precision": right / len(got) if got else 1.0}
    near, found = truth["near_duplicates"], removed.get("near_dedup", set())
    by_level: dict[str, list[int]] = {}
    for i, j in zip(near["id"], near["jaccard"]):
        level = by_level.setdefault(f"{min(int(j * 10), 9) / 10:.1f}", [0, 0])
        level[0] += i in found
        level[1] += 1
    out["near_dedup"]["recall_by_jaccard"] = {k: v[0] / v[1] for k, v in sorted(by_level.items())}
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, required=True, help="documents to write")
    p.add_argument("--output", required=True, help="the corpus, loose JSON (one object per line)")
    p.add_argument("--truth", required=True, help="the truth JSON: planted ids per kind, originals, Jaccards")
    p.add_argument("--seed", type=int, default=0, help="seed of every draw (same seed, same bytes)")
    p.add_argument("--contaminate", nargs="*", default=[],
                   help="evaluation files (.json/.jsonl with a text field, or plain text) to plant passages of")
    p.add_argument("--contaminate-text-key", default="text", help="text field of .json/.jsonl --contaminate files")
    args = p.parse_args(argv)
    if args.docs < 1:
        p.error(f"--docs {args.docs}: must be at least 1")
    missing = [f for f in args.contaminate if not Path(f).is_file()]
    if missing:
        p.error(f"--contaminate: no such file: {', '.join(missing)}")
    start = time.perf_counter()
    truth, generate, cpu = write_corpus(args.docs, args.output, args.truth, args.seed, args.contaminate,
                                        args.contaminate_text_key)
    seconds = time.perf_counter() - start
    print(f"wrote {args.output}: {args.docs} documents, {Path(args.output).stat().st_size / 1e6:.1f} MB in "
          f"{generate:.1f} s, {args.docs / generate:,.0f} documents/s ({args.docs / max(cpu, 1e-9):,.0f} per CPU "
          f"second; {seconds - generate:.1f} s more to build the sentence pool), peak RSS {peak_rss_mb():.0f} MB")
    print("planted: " + ", ".join(f"{k} {v}" for k, v in truth["counts"].items()) + f"; truth: {args.truth}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
