"""Deduplication: exact (hash of the normalized text) and near-duplicate (MinHash LSH, minhash.py).

Two passes over the input, memory bounded by the signatures, never by the texts:

1. `fingerprint_files` cuts the loose-JSON files into line-aligned ranges of SPAN_BYTES; worker
   processes read and parse a range each and turn its documents into signatures (`num_perm` x
   uint32) and exact hashes, returned in input order and appended in place (never joined from a
   list of chunks, which would hold them twice); no text passes between processes. Per document
   it keeps the signature, the exact hash, its key (`url`/`id`/`line:<n>`), its file, line and
   length: ~430 bytes plus the key (~60 bytes + its length), ~0.45 GB per million documents at the
   defaults. Saving streams them to the file (no second copy in memory).
2. `candidate_pairs` buckets the signatures by LSH band (vectorized sorts, one band at a time: ~40
   bytes per document); `verify_pairs` hands the candidate pairs to worker processes, which re-read
   their documents by seeking to their lines (an index of 8 bytes per line, made here) and compute
   their exact Jaccard similarity; pairs above the threshold are grouped with union-find.
   `near_duplicates` compares the strongest MinHash estimates first and skips a pair whose
   documents are already in one group, so a group of k near copies costs about k comparisons,
   however many candidate pairs join them (up to one a band for each copy at the default
   `heuristic_iter`, k^2 / 2 with -1), and decides a long pair on a 1-in-16 sample of its shingles
   when the sample puts it far from the threshold (`minhash.sample_decides`). A subset of the
   documents (`rows`: those exact dedup kept) is compared without copying its fingerprints.

Which document is kept: the first in input order (loaded fingerprints come before the inputs), so
a new shard is deduplicated against earlier ones and never the other way round.

Fingerprints are saved as one `.npz` of plain arrays (keys as UTF-8 bytes + offsets, settings and
sources as JSON bytes), written atomically and read with `allow_pickle=False`: never pickle.
"""

from __future__ import annotations

import array
import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from gpt2forge.core.atomic import atomic_file
from gpt2forge.core.errors import UsageError
from gpt2forge.core.json_lines import json_object
from gpt2forge.preprocess.engine import ordered_map
from gpt2forge.preprocess.jsonl import empty_file, line_starts, read_documents, unreadable
from gpt2forge.preprocess.minhash import (
    MinHasher,
    MinHashParams,
    jaccard,
    normalize_text,
    normalized_exact_hash,
    normalized_shingle_hashes,
    sample,
    sample_decides,
    unique_hashes,
)

FORMAT = "gpt2forge-minhash-fingerprints"
VERSION = 1
MEMORY_HELP = ("Memory: the fingerprints, ~0.45 GB per million documents at the defaults (a 100 x 4-byte "
               "signature, 8-byte hash, file/line/length each), plus the keys (~60 bytes + their length each), "
               "the LSH candidates, 8 bytes per line of each input while pairs are verified, and in each worker "
               "one document's candidates' texts at a time, never the whole text (measured per stage: "
               "docs/corpus.md, 'At scale')")


@dataclasses.dataclass
class Fingerprints:
    """Per-document fingerprints of one or more files, in input order (row i = document i)."""

    params: MinHashParams
    sources: list[dict]          # [{"path": str, "text_key": str}], indexed by `source`
    keys: list[str]              # document keys (url / id / line:<n>)
    signatures: np.ndarray       # (N, num_perm) uint32
    exact: np.ndarray            # (N,) uint64, exact_hash of the text
    source: np.ndarray           # (N,) int32, index into `sources`
    line: np.ndarray             # (N,) int64, 1-based line in its file
    chars: np.ndarray            # (N,) int64, text length in characters

    def __len__(self) -> int:
        return len(self.keys)


def concat(parts: list[Fingerprints]) -> Fingerprints:
    """One Fingerprints of `parts` in order; UsageError when their settings differ."""
    params = {p.params for p in parts}
    if len(params) > 1:
        raise UsageError(f"the fingerprints were made with different settings ({', '.join(map(str, params))}); "
                         "re-create them with the same --num-seeds/--num-bands/--shingle/--ngram/--seed")
    offsets = np.cumsum([0] + [len(p.sources) for p in parts])
    return Fingerprints(
        parts[0].params, [s for p in parts for s in p.sources], [k for p in parts for k in p.keys],
        np.concatenate([p.signatures for p in parts]), np.concatenate([p.exact for p in parts]),
        np.concatenate([p.source + off for p, off in zip(parts, offsets)]).astype(np.int32),
        np.concatenate([p.line for p in parts]), np.concatenate([p.chars for p in parts]))


# Per-process hasher, set by _init in workers (and in the parent for workers=0).
_HASHER: MinHasher | None = None


def _init(params: MinHashParams) -> None:
    global _HASHER
    _HASHER = MinHasher(params)


def _fingerprint_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(signatures (k, num_perm) uint32, exact hashes (k,) uint64) of a chunk of texts (worker side);
    each text is normalized once for both."""
    norms = [normalize_text(t) for t in texts]
    p = _HASHER.params
    sigs = _HASHER.signatures([normalized_shingle_hashes(n, p.shingle, p.ngram) for n in norms])
    return sigs, np.array([normalized_exact_hash(n) for n in norms], dtype=np.uint64)


SPAN_BYTES = 1 << 23
"""Input bytes a fingerprinting task reads (8 MiB: about 2,000 documents of web text)."""


def _spans(path: str, size: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges tiling a file of `size` bytes, each about SPAN_BYTES and starting at
    a line's start, so that a range's lines are counted from its bytes alone."""
    cuts = [0]
    with open(path, "rb") as f:
        for target in range(SPAN_BYTES, size, SPAN_BYTES):
            f.seek(target - 1)
            f.readline()  # to the end of the line holding byte target - 1
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [size]))


class _Span(NamedTuple):
    """What a worker found in one range of a file (`_fingerprint_span`)."""

    sigs: np.ndarray
    exact: np.ndarray
    keys: list[str]
    lines: list[int]  # of each document, counted from the range's first line (1)
    chars: list[int]
    line_count: int  # lines in the range, blank and bad ones included
    bad_lines: int


def _fingerprint_span(task: tuple) -> _Span:
    """Fingerprint the documents of one line-aligned byte range of a file (worker side: the worker
    reads and parses the lines itself, so no text crosses between processes)."""
    path, (start, end), text_key, key_fields, skip_bad_lines = task
    bad: Counter = Counter()
    docs = list(read_documents(path, text_key, key_fields, skip_bad_lines, bad, span=(start, end)))
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    sigs, exact = _fingerprint_chunk([d.text for d in docs])
    return _Span(sigs, exact, [d.key for d in docs], [d.line for d in docs], [len(d.text) for d in docs],
                 data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0), bad["bad_lines"])


def fingerprint_files(inputs: list[tuple[str, str | None]], params: MinHashParams | None = None, *,
                      text_key: str = "text", workers: int = 1, skip_bad_lines: bool = False,
                      bad: Counter | None = None, progress: bool = True) -> Fingerprints:
    """Fingerprint loose-JSON files, streaming (module docstring, pass 1).

    Args:
        inputs: (file, key field) pairs, as the seed's `--inputs cc.json url news.json id`; a document
            without the key field is named `line:<n>`; key field None: `url`, else `id`, else the line.
        params: MinHash settings (None: the seed's defaults).
        text_key / skip_bad_lines / bad: as `read_documents` (bad lines raise UsageError naming file:line).
        workers: processes computing signatures (0: this process).
    """
    params = params or MinHashParams()
    keys: list[str] = []
    sigs, exact = _Rows((0, params.num_perm), np.uint32), _Rows((0,), np.uint64)
    source, line, chars = array.array("i"), array.array("q"), array.array("q")  # 4-8 bytes per document
    sources = [{"path": str(Path(p).resolve()), "text_key": text_key} for p, _ in inputs]
    files = []  # (path, key fields, its ranges)
    for path, key in inputs:
        try:
            size = Path(path).stat().st_size
        except OSError as exc:
            raise unreadable(path, exc) from None
        files.append((str(path), ("url", "id") if key is None else (key,), _spans(str(path), size)))
    tasks = ((path, span, text_key, fields, skip_bad_lines) for path, fields, spans in files for span in spans)
    results = ordered_map(_fingerprint_span, tasks, workers, _init, (params,))
    # a bar only on a terminal (None), not in a job's log; closed before an error prints
    with tqdm(desc="fingerprinting", unit="doc", disable=None if progress else True) as bar:
        for s, (path, _, spans) in enumerate(files):
            lines_before, seen = 0, False
            for _ in spans:
                r = next(results)
                keys.extend(r.keys)
                source.extend([s] * len(r.keys))
                line.extend([lines_before + n for n in r.lines])
                chars.extend(r.chars)
                sigs.append(r.sigs)
                exact.append(r.exact)
                lines_before += r.line_count
                seen = seen or bool(r.keys) or r.bad_lines > 0
                if bad is not None:
                    bad["bad_lines"] += r.bad_lines
                bar.update(len(r.keys))
            if not seen:
                raise empty_file(path)
    return Fingerprints(params, sources, keys, sigs.array(), exact.array(), np.frombuffer(source, np.int32),
                        np.frombuffer(line, np.int64), np.frombuffer(chars, np.int64))


class _Rows:
    """An array grown by appending rows, in place: `ndarray.resize` reallocates (mremap for large
    arrays), so the rows are never held twice, as joining a list of chunks would at the end."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self._a, self._n = np.zeros((1024, *shape[1:]), dtype), 0

    def append(self, rows: np.ndarray) -> None:
        if self._n + len(rows) > len(self._a):
            self._a.resize((max(2 * len(self._a), self._n + len(rows)), *self._a.shape[1:]), refcheck=False)
        self._a[self._n:self._n + len(rows)] = rows
        self._n += len(rows)

    def array(self) -> np.ndarray:
        self._a.resize((self._n, *self._a.shape[1:]), refcheck=False)
        return self._a


def save_fingerprints(fp: Fingerprints, path: str | Path) -> None:
    """Write `fp` to `path` as one `.npz` of plain arrays (no pickle), atomically."""
    encoded = [k.encode("utf-8", "surrogatepass") for k in fp.keys]
    meta = {"format": FORMAT, "version": VERSION, "params": dataclasses.asdict(fp.params), "sources": fp.sources}
    with atomic_file(path) as f:  # streamed: the signatures are not copied into one bytes object first
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                 key_bytes=np.frombuffer(b"".join(encoded), dtype=np.uint8),
                 key_offsets=np.cumsum([0] + [len(k) for k in encoded], dtype=np.int64),
                 signatures=fp.signatures, exact=fp.exact, source=fp.source, line=fp.line, chars=fp.chars)


def load_fingerprints(path: str | Path) -> Fingerprints:
    """Read fingerprints written by `save_fingerprints`; UsageError naming the file when it is not one."""
    path = Path(path)
    hint = "re-create it with find_duplicates.py --save-fingerprints (pickled fingerprints are refused)"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
        meta = json.loads(arrays["meta"].tobytes())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"format {meta.get('format')} version {meta.get('version')}")
        blob, offsets = arrays["key_bytes"].tobytes(), arrays["key_offsets"]
        keys = [blob[a:b].decode("utf-8", "surrogatepass") for a, b in zip(offsets[:-1], offsets[1:])]
        fp = Fingerprints(MinHashParams(**meta["params"]), meta["sources"], keys, arrays["signatures"],
                          arrays["exact"], arrays["source"], arrays["line"], arrays["chars"])
    except FileNotFoundError:
        raise UsageError(f"{path}: no such fingerprint file; check --load-fingerprints") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a gpt2forge fingerprint file ({exc}); {hint}") from None
    if not all(len(a) == len(keys) for a in (fp.signatures, fp.exact, fp.source, fp.line, fp.chars)):
        raise UsageError(f"{path}: its arrays disagree in length (a damaged file); {hint}")
    for s in fp.sources:  # the texts are re-read to verify pairs: also look next to the fingerprint file
        if not Path(s["path"]).exists() and (path.parent / Path(s["path"]).name).exists():
            s["path"] = str(path.parent / Path(s["path"]).name)
    return fp


def exact_duplicates(fp: Fingerprints) -> np.ndarray:
    """(N,) bool: True for a document whose normalized text equals an earlier document's."""
    _, first = np.unique(fp.exact, return_index=True)
    dup = np.ones(len(fp), dtype=bool)
    dup[first] = False  # np.unique's index is the first occurrence
    return dup


def candidate_pairs(fp: Fingerprints, heuristic_iter: int = 1, keep: Callable[[np.ndarray], np.ndarray] | None = None,
                    rows: np.ndarray | None = None) -> np.ndarray:
    """(M, 2) int64 (main, other) document indices sharing an LSH band key, main < other, unique, sorted.

    In each bucket (members in input order) the first `heuristic_iter` members are each paired with
    every later member (the seed's --heuristic-iter: 1 compares all to one main; -1 all pairs).
    `keep` filters each band's pairs as they are made, so memory holds one band's candidates and the
    kept ones, not every band's. `rows` (sorted indices): only these documents take part, without
    copying their signatures.
    """
    hasher, total, found = MinHasher(fp.params), len(fp), []
    n = total if rows is None else len(rows)
    for b in range(fp.params.bands):  # one band at a time: 8 bytes per document, not 8 per signature row
        band = hasher.band_keys(fp.signatures, b, rows)
        order = np.argsort(band, kind="stable")  # equal keys keep input order
        sorted_keys = band[order]
        if rows is not None:
            order = rows[order]  # positions among `rows` to document indices
        start = np.ones(n, dtype=bool)
        start[1:] = sorted_keys[1:] != sorted_keys[:-1]
        run_start = np.maximum.accumulate(np.where(start, np.arange(n), 0))
        if heuristic_iter == 1:  # the common case, vectorized: pair each member with its bucket's first
            inner = ~start
            band_pairs = [np.stack([order[run_start[inner]], order[inner]], axis=1)]
        else:
            band_pairs = []
            sizes = np.diff(np.flatnonzero(np.append(start, True)))
            for s, size in zip(np.flatnonzero(start), sizes):
                if size < 2:
                    continue
                members = order[s:s + size]
                mains = size if heuristic_iter < 0 else min(heuristic_iter, size)
                band_pairs.extend(np.stack([np.full(size - m - 1, members[m]), members[m + 1:]], axis=1)
                                  for m in range(mains))
        if band_pairs:
            pairs = np.concatenate(band_pairs).astype(np.int64)
            found.append(keep(pairs) if keep is not None else pairs)
    if not found:
        return np.zeros((0, 2), dtype=np.int64)
    pairs = np.concatenate(found)
    codes = np.unique(pairs[:, 0] * total + pairs[:, 1])  # one code per pair: dedups across bands and sorts
    return np.stack([codes // total, codes % total], axis=1)


class TextReader:
    """Re-reads documents' texts from their files by seeking to their lines: one index of line
    offsets per file (8 bytes per line, made on first use), then one line read per document, so a
    batch costs its own documents, not a pass over the file. `locate` says where a document is, for
    a worker process to read it there (`read_at`)."""

    def __init__(self, fp: Fingerprints) -> None:
        self.fp, self._starts = fp, {}  # source -> (line starts, whether they are the whole file's)

    def _index(self, s: int, last_line: int) -> np.ndarray:
        """Source s's line starts, at least to `last_line` where the file has it: the first call
        indexes only that far (a stage's few examples are its first rows), a later one beyond it the
        whole file, once."""
        starts, whole = self._starts.get(s, (None, False))
        if starts is None or (len(starts) < last_line and not whole):
            path = self.fp.sources[s]["path"]
            if not Path(path).exists():
                raise UsageError(f"{path}: missing, and its documents are candidate duplicates; put the file back "
                                 "there or next to its fingerprint file")
            upto = last_line if starts is None else None
            starts = line_starts(path, upto=upto)
            self._starts[s] = starts, upto is None or len(starts) < upto
        return starts

    def locate(self, wanted: np.ndarray) -> dict[int, tuple[str, int, str, int]]:
        """{document index: (path, byte offset of its line, text key, characters)} for `wanted`."""
        fp, found = self.fp, {}
        for s in np.unique(fp.source[wanted]).tolist():
            src = fp.sources[s]
            rows = np.sort(wanted[fp.source[wanted] == s])  # rows of one file are in line order: reads go forward
            lines = fp.line[rows]
            starts = self._index(s, int(lines.max()) if len(lines) else 0)
            if len(lines) and int(lines.max()) > len(starts):
                raise _changed(src["path"])
            for i, at, chars in zip(rows.tolist(), starts[lines - 1].tolist(), fp.chars[rows].tolist()):
                found[i] = (src["path"], at, src["text_key"], chars)
        return found

    def read(self, wanted: np.ndarray) -> dict[int, str]:
        """{document index: text} for the `wanted` indices."""
        with _OpenFiles() as files:
            return {i: read_at(where, files) for i, where in self.locate(wanted).items()}


def _changed(path: str) -> UsageError:
    return UsageError(f"{path}: changed since it was fingerprinted; re-run find_duplicates.py on it with --overwrite")


class _OpenFiles(dict):
    """Files opened for reading as asked for (`files[path]`), closed together on exit."""

    def __missing__(self, path: str):
        f = self[path] = open(path, "rb")
        return f

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.values():
            f.close()


def read_at(where: tuple[str, int, str, int], files: _OpenFiles) -> str:
    """The text of the document `TextReader.locate` placed at `where`; UsageError if the file no
    longer holds it there."""
    path, at, text_key, chars = where
    f = files[path]
    f.seek(at)
    problem, obj = json_object(f.readline())
    text = None if problem else obj.get(text_key)
    if not isinstance(text, str) or len(text) != chars:
        raise _changed(path)
    return text


def read_texts(fp: Fingerprints, wanted: np.ndarray) -> dict[int, str]:
    """{document index: text} for the `wanted` indices, re-read from their files by line number."""
    return TextReader(fp).read(wanted)


def _verify_group(task: tuple) -> tuple[int, list[tuple[int, float]]]:
    """(main, [(other, similarity)]) for a main document against its candidates (worker side, which
    reads their texts): the exact Jaccard, or with `sampled` (union mode) the samples' Jaccard where
    it decides (`minhash.sample_decides`)."""
    main, main_at, others, mode, threshold, sampled = task
    with _OpenFiles() as files:
        hashes = _HASHER.all_shingles(read_at(main_at, files))
        main_sample = sample(hashes) if sampled and mode == "union" else None
        main_set, out = None, []
        for j, at in others:
            other = _HASHER.all_shingles(read_at(at, files))
            sim = None if main_sample is None else sample_decides(main_sample, sample(other), threshold)
            if sim is None:
                if main_set is None:
                    main_set = unique_hashes(hashes)
                sim = jaccard(main_set, unique_hashes(other), mode)
            out.append((j, sim))
    return main, out


def verify_pairs(fp: Fingerprints, pairs: np.ndarray, *, mode: str = "union", threshold: float = 0.5,
                 workers: int = 1, budget_chars: int = 1 << 26, progress: bool = True,
                 groups: Groups | None = None, sampled: bool = False) -> Verified:
    """(main, other, exact Jaccard) for the candidate `pairs` whose similarity is above `threshold`,
    sorted, and how many pairs were compared. `sampled` (union mode): a pair whose 1-in-16 shingle
    samples put it far from the threshold is decided on them, and its similarity is the samples'
    (`minhash.sample_decides`).

    Pairs are handed out in batches whose documents total at most `budget_chars` characters; the
    workers re-read the texts (`TextReader`), a main's with its candidates', so this process holds
    none and a worker one main's candidates at a time, however many candidates there are. With
    `groups`, each pair found joins its documents' groups, and a pair whose documents are already in
    one group when it is reached (when its batch is made, and again when its main's comparisons are
    handed to a worker) is not compared: it could not change any group. So the near copies of one
    document are not compared with each other once each has joined the original's group.
    """
    kept: list[tuple[int, int, float]] = []
    compared = 0
    reader = TextReader(fp)

    def tasks(bar: tqdm) -> Iterator[tuple]:  # made lazily: the results of the tasks before it have joined
        nonlocal compared
        for batch, looked_at in _batches(fp, pairs, budget_chars, groups):
            bar.update(looked_at)
            if not len(batch):
                continue
            batch = batch[np.lexsort((batch[:, 1], batch[:, 0]))]  # each main's candidates together
            where = reader.locate(np.unique(batch))
            mains, starts = np.unique(batch[:, 0], return_index=True)
            bounds = np.append(starts, len(batch))
            for m, lo, hi in zip(mains.tolist(), bounds[:-1].tolist(), bounds[1:].tolist()):
                others = batch[lo:hi, 1].tolist()
                if groups is not None:
                    others = [j for j in others if groups.apart(m, j)]
                compared += len(others)
                if others:
                    yield m, where[m], [(j, where[j]) for j in others], mode, threshold, sampled

    with tqdm(total=len(pairs), desc="verifying pairs", unit="pair", disable=None if progress else True) as bar:
        # One pool for every batch; with `groups`, results join in a fixed lag behind the tasks made.
        for m, result in ordered_map(_verify_group, tasks(bar), workers, _init, (fp.params,),
                                     steady=groups is not None):
            for j, sim in result:
                if sim > threshold:
                    kept.append((m, j, sim))
                    if groups is not None:
                        groups.join(m, j)
    return Verified(sorted(kept), compared)


class Verified(NamedTuple):
    """What `verify_pairs` found."""

    pairs: list[tuple[int, int, float]]
    """(main, other, Jaccard) of the pairs above the threshold, sorted."""
    compared: int
    """Pairs compared, whole or on samples (with `groups`, those already in one group are not)."""


def _batches(fp: Fingerprints, pairs: np.ndarray, budget_chars: int,
             groups: Groups | None = None) -> Iterator[tuple[np.ndarray, int]]:
    """(batch, pairs looked at) in order: each batch's documents total at most `budget_chars` (at
    least one pair each). With `groups`, pairs already in one group are left out of the batch when it
    is made (after the previous batch's pairs have joined), and a batch may be empty."""
    need = fp.chars[pairs[:, 0]] + fp.chars[pairs[:, 1]]  # counts a shared main twice: safe
    if groups is None:
        total = np.cumsum(need)
        lo = 0
        while lo < len(pairs):
            before = int(total[lo - 1]) if lo else 0
            hi = max(lo + 1, int(np.searchsorted(total, before + budget_chars, side="right")))
            yield pairs[lo:hi], hi - lo
            lo = hi
        return
    lo, sizes, listed = 0, need.tolist(), pairs.tolist()
    while lo < len(pairs):
        take, held, i = [], 0, lo
        while i < len(listed):  # a Python step per pair: small beside comparing one
            if take and held + sizes[i] > budget_chars:
                break
            if groups.apart(*listed[i]):
                take.append(i)
                held += sizes[i]
            i += 1
        yield pairs[take], i - lo
        lo = i


class Groups:
    """Union-find over n documents: each group is named by its first member (input order)."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def root(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i

    def apart(self, i: int, j: int) -> bool:
        return self.root(i) != self.root(j)

    def join(self, i: int, j: int) -> None:
        ri, rj = self.root(i), self.root(j)
        if ri != rj:
            self.parent[max(ri, rj)] = min(ri, rj)  # the earlier document names the group

    def labels(self) -> np.ndarray:
        """(n,) int64: each document's group name."""
        labels = np.array(self.parent, dtype=np.int64)
        while True:  # pointer jumping: every document's parent becomes its root
            up = labels[labels]
            if np.array_equal(up, labels):
                return labels
            labels = up


def group_duplicates(n: int, pairs: list[tuple[int, int, float]] | np.ndarray) -> np.ndarray:
    """(n,) int64 union-find labels: each document's group is named by its first member (input order)."""
    groups = Groups(n)
    for i, j, *_ in pairs:
        groups.join(int(i), int(j))
    return groups.labels()


ESTIMATE_MARGIN = 0.2
"""How far below the threshold a pair's MinHash estimate of its Jaccard may fall and still be verified."""


def estimated_jaccard(fp: Fingerprints, pairs: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """(M,) float32: the fraction of signature rows each pair shares, MinHash's unbiased estimate of
    its union Jaccard (standard deviation at most 0.5 / sqrt(num_perm): 0.05 at 100 rows)."""
    out = np.empty(len(pairs), dtype=np.float32)
    for lo in range(0, len(pairs), chunk):
        a, b = pairs[lo:lo + chunk, 0], pairs[lo:lo + chunk, 1]
        out[lo:lo + chunk] = (fp.signatures[a] == fp.signatures[b]).mean(axis=1)
    return out


def likely_pairs(fp: Fingerprints, pairs: np.ndarray, mode: str, threshold: float) -> np.ndarray:
    """The candidate `pairs` worth verifying: in union mode those whose MinHash estimate is within
    ESTIMATE_MARGIN of `threshold` (a pair of true Jaccard 0.5 estimated under 0.3 is 4 standard
    deviations off at 100 rows; at 0.8 and above, 10), so the LSH bands' false candidates cost a
    comparison of two signatures, not a re-read and a shingling of two texts each. The estimate is
    of the union Jaccard only: the min and max modes verify every candidate."""
    if mode != "union" or not len(pairs):
        return pairs
    return pairs[estimated_jaccard(fp, pairs) >= threshold - ESTIMATE_MARGIN]


@dataclasses.dataclass
class NearDuplicates:
    """What `near_duplicates` found."""

    removed: np.ndarray
    """(N,) bool: every document but the first of its group."""
    pairs: list[tuple[int, int, float]]
    """(main, other, Jaccard) of the pairs compared and found above the threshold, sorted: the exact
    Jaccard, or the shingle samples' where they decided (`minhash.sample_decides`)."""
    candidates: int
    """LSH candidate pairs worth comparing (MinHash estimate near the threshold or above)."""
    compared: int
    """Of them, those compared: the others were already in one group when reached (how many depends
    on `workers`, which sets how far ahead of the results comparisons are handed out)."""


def near_duplicates(fp: Fingerprints, *, mode: str = "union", threshold: float = 0.5, heuristic_iter: int = 1,
                    workers: int = 1, progress: bool = True, rows: np.ndarray | None = None) -> NearDuplicates:
    """Groups of near duplicates: LSH candidates, compared exactly, strongest estimate first, so that
    a group's members join it through their closest pairs and the pairs among them are not compared
    (the groups, and so the documents removed, are those of comparing every candidate: a pair inside
    one group cannot change them). `rows` (sorted indices): only these documents are compared (the
    others are never removed)."""
    candidates = candidate_pairs(fp, heuristic_iter, lambda pairs: likely_pairs(fp, pairs, mode, threshold), rows)
    candidates = candidates[np.argsort(-estimated_jaccard(fp, candidates), kind="stable")]
    groups = Groups(len(fp))
    found = verify_pairs(fp, candidates, mode=mode, threshold=threshold, workers=workers, progress=progress,
                         groups=groups, sampled=True)
    return NearDuplicates(groups.labels() != np.arange(len(fp)), found.pairs, len(candidates), found.compared)


def write_kept(fp: Fingerprints, removed: np.ndarray, output: str | Path) -> tuple[int, int]:
    """Stream the fingerprinted files into `output` (atomically) without the `removed` documents.

    Returns (documents written, characters removed). Each kept document's line is copied as it is,
    in input order, without parsing it (a line skipped as bad when fingerprinted has no row, so it
    is not copied; a last line without a newline gets one). The stages' inputs are this tool's own
    JSON lines, so this equals writing each parsed record back.
    """
    written = 0
    with atomic_file(output) as out:
        for s, src in enumerate(fp.sources):
            rows = np.flatnonzero(fp.source == s)  # in line order, as fingerprinted
            keep = fp.line[rows[~removed[rows]]].tolist()
            if not keep:
                continue
            k = 0
            with open(src["path"], "rb") as f:
                for n, raw in enumerate(f, start=1):
                    if n == keep[k]:
                        out.write(raw if raw.endswith(b"\n") else raw + b"\n")
                        k += 1
                        if k == len(keep):
                            break
            if k != len(keep):
                raise UsageError(f"{src['path']}: changed since it was fingerprinted (shorter); re-run on it")
            written += k
    return written, int(fp.chars[removed].sum())
