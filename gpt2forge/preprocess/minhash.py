"""MinHash signatures, LSH band keys and exact Jaccard, vectorized with numpy.

A document's text is normalized (`normalize_text`: NFC, lower-case, whitespace runs -> one space),
cut into shingles (character n-grams, or word n-grams), and each shingle is hashed once to 64 bits:
character n-grams by a rolling polynomial over the code points (numpy, no Python loop per shingle),
word n-grams by combining per-word hashes (xxhash when installed, else blake2b) the same way. The
set of shingle hashes (`np.unique`) is what Jaccard similarity is computed on.

The signature applies `num_perm` universal hash functions to every shingle hash at once, as one
`(num_perm, n_shingles)` array: h_i(x) = (a_i * x + b_i) mod 2^64, top 32 bits (multiply-add-shift,
a 2-universal family that needs no 128-bit product), and keeps the minimum of each row: `num_perm`
uint32 values, 4 bytes each. Two documents agree on a row with probability equal to their Jaccard
similarity J, so the fraction of equal rows estimates J with standard deviation sqrt(J(1-J)/num_perm).
`MinHasher.signatures` does a batch of documents with the custom op `gpt2forge::minhash_signatures`
(custom_ops/minhash.cpp) when the library is built: the same values, computed in registers instead
of in arrays.

LSH cuts the signature into `bands` bands of `num_perm / bands` rows and hashes each band to one
uint64 key: documents sharing a key in any band are candidates (probability 1 - (1 - J^r)^b).
"""

from __future__ import annotations

import dataclasses
import hashlib
import unicodedata

import numpy as np

from gpt2forge.core.errors import UsageError

try:  # a fast 64-bit hash for words; blake2b (stdlib) gives the same statistics, slower
    import xxhash

    def _word_hash(word: str) -> int:
        return xxhash.xxh3_64_intdigest(word.encode("utf-8", "surrogatepass"))
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

    def _word_hash(word: str) -> int:
        return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")

SHINGLES = ("chars", "words")
JACCARD_MODES = ("union", "min", "max")
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_POLY = np.uint64(0x100000001B3)     # odd multiplier of the rolling shingle hash (FNV prime)


@dataclasses.dataclass(frozen=True)
class MinHashParams:
    """How documents are fingerprinted; saved with the fingerprints, which must agree to combine."""

    shingle: str = "chars"
    """Shingle type: `chars` (character n-grams, the seed's) or `words` (word n-grams)."""
    ngram: int = 5
    """Shingle length in characters or words (the seed: 5 characters)."""
    num_perm: int = 100
    """Hash functions in a signature (the seed's 100 seeds); 4 bytes each per document."""
    bands: int = 10
    """LSH bands (the seed's 10); must divide num_perm."""
    seed: int = 1234
    """Seed of the hash functions (the seed's --seed default)."""

    def __post_init__(self):
        problems = []
        if self.shingle not in SHINGLES:
            problems.append(f"--shingle {self.shingle!r}: choose one of {', '.join(SHINGLES)}")
        if self.ngram < 1:
            problems.append(f"--ngram {self.ngram}: must be at least 1")
        if self.num_perm < 1 or self.bands < 1 or self.num_perm % self.bands:
            problems.append(f"--num-seeds {self.num_perm} and --num-bands {self.bands}: the bands must divide "
                            "the permutations (e.g. 100 and 10)")
        if problems:
            raise UsageError("; ".join(problems))

    @property
    def rows(self) -> int:
        """Signature rows per band."""
        return self.num_perm // self.bands


def normalize_text(text: str) -> str:
    """NFC, lower-case, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(unicodedata.normalize("NFC", text).lower().split())


def exact_hash(text: str) -> int:
    """A 64-bit hash of `normalize_text(text)` (exact dedup: equal hashes = same normalized text)."""
    return normalized_exact_hash(normalize_text(text))


def normalized_exact_hash(norm: str) -> int:
    """`exact_hash` of a text already through `normalize_text`."""
    return int.from_bytes(hashlib.blake2b(norm.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, in place: spreads the polynomial hash over all 64 bits."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _rolling(units: np.ndarray, n: int) -> np.ndarray:
    """The polynomial hash of every window of `n` consecutive units (uint64, wrapping)."""
    if len(units) < n:  # a text shorter than one shingle is one shingle
        n = len(units)
    count = len(units) - n + 1
    h = np.zeros(count, dtype=np.uint64)
    for k in range(n):  # n (5) vectorized passes, not one Python step per shingle
        h *= _POLY
        h += units[k:k + count]
    return h


def shingle_hashes(text: str, shingle: str = "chars", ngram: int = 5) -> np.ndarray:
    """The sorted unique 64-bit hashes of the shingles of `normalize_text(text)` (may be empty)."""
    return unique_hashes(all_shingle_hashes(text, shingle, ngram))


def all_shingle_hashes(text: str, shingle: str = "chars", ngram: int = 5) -> np.ndarray:
    """The 64-bit hash of each shingle of `normalize_text(text)`, in text order, repeats included."""
    return normalized_shingle_hashes(normalize_text(text), shingle, ngram)


def normalized_shingle_hashes(norm: str, shingle: str = "chars", ngram: int = 5) -> np.ndarray:
    """`all_shingle_hashes` of a text already through `normalize_text`."""
    if not norm:
        return np.zeros(0, dtype=np.uint64)
    if shingle == "chars":
        units = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    else:
        units = np.fromiter((_word_hash(w) for w in norm.split(" ")), dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _mix(_rolling(units, ngram))


def unique_hashes(hashes: np.ndarray) -> np.ndarray:
    """Sorted unique values of `hashes` (a new array)."""
    if hashes.size == 0:
        return hashes.copy()
    hashes = np.sort(hashes)
    keep = np.empty(hashes.size, dtype=bool)  # sort + neighbour test: several times faster than np.unique
    keep[0] = True
    np.not_equal(hashes[1:], hashes[:-1], out=keep[1:])
    return hashes[keep]


SAMPLE_MASK = np.uint64(15)
"""A shingle hash is in a document's sample when its low 4 bits are 0: 1 shingle in 16, the same
shingles in every document (the hashes are mixed, so any bits are as good)."""
SAMPLE_MIN = 400
"""Fewest sampled shingles (the union of two samples) on which `sample_decides` decides."""
SAMPLE_SIGMAS = 6.0
"""How many standard deviations from the threshold a sample's Jaccard must be to decide."""


def sample(hashes: np.ndarray) -> np.ndarray:
    """The sorted unique shingle hashes of `hashes` (any order, repeats allowed) in the sample."""
    return unique_hashes(hashes[(hashes & SAMPLE_MASK) == 0])


def sample_decides(sample_a: np.ndarray, sample_b: np.ndarray, threshold: float) -> float | None:
    """The Jaccard of two documents' samples when it shows on which side of `threshold` their union
    Jaccard lies, else None (compare them whole).

    The shared shingles in the sample are a binomial draw from those of the two documents: on n
    sampled shingles the sample's Jaccard has standard deviation sqrt(J(1-J)/n) <= 0.5 / sqrt(n).
    It decides only on at least SAMPLE_MIN shingles (two documents of about 3,000 characters) and
    SAMPLE_SIGMAS from the threshold (a pair is put on the wrong side with probability under 1e-9):
    long documents cost a sixteenth of a sort each, not a whole one, unless they are near the
    threshold."""
    inter = jaccard_counts(sample_a, sample_b)
    n = sample_a.size + sample_b.size - inter
    if n < SAMPLE_MIN:
        return None
    estimate = inter / n
    return estimate if abs(estimate - threshold) > SAMPLE_SIGMAS * 0.5 / np.sqrt(n) else None


class MinHasher:
    """Signatures and band keys for one `MinHashParams` (same params + seed -> same functions)."""

    def __init__(self, params: MinHashParams | None = None):
        self.params = params = params or MinHashParams()
        rng = np.random.default_rng(params.seed)
        full = np.iinfo(np.uint64).max
        self._a = (rng.integers(0, full, params.num_perm, dtype=np.uint64, endpoint=True) | np.uint64(1))[:, None]
        self._b = rng.integers(0, full, params.num_perm, dtype=np.uint64, endpoint=True)[:, None]
        # One odd multiplier per row of a band: the band key is sum_r sig[r] * c_r mod 2^64.
        self._band_mult = rng.integers(0, full, params.rows, dtype=np.uint64, endpoint=True) | np.uint64(1)

    def shingles(self, text: str) -> np.ndarray:
        return shingle_hashes(text, self.params.shingle, self.params.ngram)

    def all_shingles(self, text: str) -> np.ndarray:
        return all_shingle_hashes(text, self.params.shingle, self.params.ngram)

    def signature(self, hashes: np.ndarray) -> np.ndarray:
        """(num_perm,) uint32: the minimum of each hash function over the shingle hashes.

        An empty document gets all-ones (uint32 max), like no other document with shingles.
        """
        if hashes.size == 0:
            return np.full(self.params.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        sig = np.empty(self.params.num_perm, dtype=np.uint32)
        step = max(1, (1 << 16) // hashes.size)  # permutations per block: ~64k values, cache-sized
        with np.errstate(over="ignore"):
            for lo in range(0, self.params.num_perm, step):
                block = self._a[lo:lo + step] * hashes[None, :]  # (step, n_shingles)
                block += self._b[lo:lo + step]
                sig[lo:lo + step] = (block.min(axis=1) >> np.uint64(32)).astype(np.uint32)
        return sig

    def signatures(self, hashes: list[np.ndarray]) -> np.ndarray:
        """(len(hashes), num_perm) uint32: `signature` of each array of shingle hashes (repeats
        allowed: a minimum does not change with them). One call of the custom op for the batch when
        the library is built (custom_ops/minhash.cpp), else numpy on each document's unique hashes."""
        import torch  # why: torch (a second to import) loads only in a process that makes signatures

        from gpt2forge.ops.library import has_op  # why: as torch, which it imports
        if not has_op("minhash_signatures"):
            return np.stack([self.signature(unique_hashes(h)) for h in hashes]) if hashes else \
                np.zeros((0, self.params.num_perm), np.uint32)
        offsets = np.zeros(len(hashes) + 1, np.int64)
        np.cumsum([h.size for h in hashes], out=offsets[1:])
        flat = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        bits = [torch.from_numpy(v.view(np.int64)) for v in (flat, self._a[:, 0], self._b[:, 0])]  # uint64 as int64
        sigs = torch.ops.gpt2forge.minhash_signatures(bits[0], torch.from_numpy(offsets), bits[1], bits[2])
        return sigs.numpy().view(np.uint32)

    def band_keys(self, signatures: np.ndarray, band: int, subset: np.ndarray | None = None) -> np.ndarray:
        """(N,) uint64 keys of one band of (N, num_perm) signatures (of the `subset` rows only, when
        given); equal keys = equal bands (up to 2^-64)."""
        rows = signatures[:, band * self.params.rows:(band + 1) * self.params.rows]
        rows = (rows if subset is None else rows[subset]).astype(np.uint64)
        with np.errstate(over="ignore"):
            return _mix((rows * self._band_mult).sum(axis=1, dtype=np.uint64))


def jaccard(a: np.ndarray, b: np.ndarray, mode: str = "union") -> float:
    """Exact Jaccard of two sorted unique shingle-hash arrays: |A&B| over |A|B| (union), or over
    the smaller (min) or larger (max) set, as the seed's --jaccard. 0.0 if either is empty."""
    if a.size == 0 or b.size == 0:
        return 0.0
    inter = jaccard_counts(a, b)
    if mode == "min":
        return inter / min(a.size, b.size)
    if mode == "max":
        return inter / max(a.size, b.size)
    return inter / (a.size + b.size - inter)


def jaccard_counts(a: np.ndarray, b: np.ndarray) -> int:
    """|A&B| of two sorted unique arrays."""
    if a.size == 0 or b.size == 0:
        return 0
    small, large = (a, b) if a.size <= b.size else (b, a)
    at = np.searchsorted(large, small)  # where each of the smaller set would be: no sort, unlike intersect1d
    np.minimum(at, large.size - 1, out=at)
    return int(np.count_nonzero(large[at] == small))


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """The MinHash estimate of the Jaccard similarity: the fraction of equal signature rows."""
    return float(np.mean(sig_a == sig_b))
