"""The evaluation protocols as data: which tokens are scored, with which context, and how the sums
become perplexities and accuracies. Nothing here runs a model (that is `scoring.py`).

Perplexity over a token stream (WikiText, large corpora), Megatron-LM's `_LMDataset` protocol:
targets are tokens 1..N-1 of the stream (token t is predicted from the tokens before it). With
window length L (`--seq-length`) and stride S (`--overlapping-eval`), window 0 reads tokens
[0, L) and scores all its L targets; window i > 0 reads [i*S, i*S + L) and scores only its last S
targets. Every target is scored exactly once, and every target after the first window has at least
L - S tokens of context. The last window is shorter when the stream ends; no window is dropped (the
reference's `drop_last=True` QUIRK lost the tail while still dividing by all tokens), and the
windows Megatron builds past the end (all padding, score nothing) are never built.

LAMBADA cloze, Megatron-LM's `_LambadaDataset`: non-strict scores the last BPE token of the text
given all earlier tokens; strict scores every token of the last word (`text.split()[-1]`, encoded
as `" " + word`) given the encoded text before it, and an example is correct only if all of them
are the greedy prediction. Examples longer than L + 1 tokens lose context tokens on the left (and
are counted); Megatron's strict mode dropped them from the denominator instead.

lm-evaluation-harness (`lambada_openai`, `wikitext`; lm-eval 0.4.13), `--lambada-target lm-eval`
and `--protocol lm-eval`: the LAMBADA target is everything after the last space (`" " +
text.split(" ")[-1]`, a newline included), the context the text before that space, and the target
ids are those of encode(context + target) after encode(context) (lm-eval's `_encode_pair`); the
whole target is scored (strict). WikiText is split into pages at its level-1 headings
(`lm_eval_pages`), each page is scored on its own after an end-of-text token with rolling windows
(`rolling_windows`: disjoint chunks of L targets, the last one with a full L of context), and the
sums are reported per word (whitespace-separated, as `re.split` on runs of whitespace), per byte and as bits per byte.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpt2forge.core.errors import UsageError


@dataclass(frozen=True)
class Window:
    """Model input `stream[start : start + length]`, targets `stream[start + 1 : start + length + 1]`;
    the last `scored` targets count."""

    start: int
    length: int
    scored: int


class WindowPlan:
    """The overlapping windows over a stream of `n_tokens` tokens (computed on demand, O(1) memory)."""

    def __init__(self, n_tokens: int, seq_len: int, stride: int):
        if seq_len < 1:
            raise UsageError(f"--seq-length {seq_len} must be >= 1")
        if not 1 <= stride <= seq_len:
            raise UsageError(f"--overlapping-eval {stride} must be between 1 and --seq-length ({seq_len}); "
                             "a stride above the window length would skip tokens")
        if n_tokens < 2:
            raise UsageError(f"the text has {n_tokens} token(s) after tokenization; at least 2 are needed "
                             "to score anything")
        self.n_tokens, self.seq_len, self.stride = n_tokens, seq_len, stride
        targets_after_first = max(n_tokens - 1 - seq_len, 0)
        self._len = 1 + math.ceil(targets_after_first / stride)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> Window:
        if not 0 <= i < self._len:
            raise IndexError(i)
        L, S, last_target = self.seq_len, self.stride, self.n_tokens - 1
        start = i * S
        length = min(L, last_target - start)
        if i == 0:
            return Window(0, length, length)
        first_scored = (i - 1) * S + L + 1  # the target after the previous window's last one
        return Window(start, length, last_target - first_scored + 1 if i == self._len - 1 else S)

    @property
    def scored_tokens(self) -> int:
        """Targets scored over all windows: always n_tokens - 1."""
        return self.n_tokens - 1


def count_original_tokens(text: str) -> int:
    """Word-level tokens of a (WikiText-style) file: whitespace-separated words plus one end-of-line per
    line, the count WikiText's own perplexities use (245,569 for the test split, raw or tokenized).

    Megatron counted `len(text.strip().split(" "))`, which depends on runs of spaces (245,566 on
    `wiki.test.tokens`); this count is the same for the raw and the tokenized file.
    """
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    return len(text.split()) + lines


@dataclass
class PerplexityResult:
    """Sums over all scored tokens and the numbers derived from them."""

    loss_sum: float  # nats, summed over scored tokens (fp32 per batch, fp64 across batches)
    scored_tokens: int  # = num_tokenized_tokens - 1
    num_tokenized_tokens: int
    num_original_tokens: int | None  # None: no word-level adjustment (e.g. a pre-tokenized corpus)
    correct: int = 0  # scored tokens whose argmax is the target
    windows: int = 0

    @property
    def loss(self) -> float:
        """Mean cross-entropy per BPE token (nats)."""
        return self.loss_sum / self.scored_tokens

    @property
    def ppl(self) -> float:
        return safe_exp(self.loss)

    @property
    def token_ratio(self) -> float | None:
        """(tokenized - 1) / (original - 1), Megatron's ratio (the first token of each count is unscored)."""
        if not self.num_original_tokens or self.num_original_tokens < 2:
            return None
        return (self.num_tokenized_tokens - 1) / (self.num_original_tokens - 1)

    @property
    def adjusted_ppl(self) -> float | None:
        """Word-level perplexity exp(loss * token_ratio) = exp(loss_sum / (num_original_tokens - 1))."""
        ratio = self.token_ratio
        return None if ratio is None else safe_exp(self.loss * ratio)

    def to_dict(self) -> dict:
        return {"loss": self.loss, "ppl": self.ppl, "adjusted_ppl": self.adjusted_ppl,
                "token_ratio": self.token_ratio, "loss_sum": self.loss_sum, "scored_tokens": self.scored_tokens,
                "num_tokenized_tokens": self.num_tokenized_tokens, "num_original_tokens": self.num_original_tokens,
                "token_accuracy": self.correct / self.scored_tokens, "windows": self.windows}


def safe_exp(x: float) -> float:
    """exp without Megatron's silent min(20, x) cap; inf when it overflows."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class ClozeExample:
    """Context ids, target ids (scored), and how many context ids were cut from the left to fit."""

    context: tuple[int, ...]
    target: tuple[int, ...]
    truncated: int = 0


def lambada_example(text: str, encode: Callable[[str], list[int]], strict: bool) -> ClozeExample:
    """One LAMBADA passage -> context and target ids (before any truncation)."""
    if strict:
        words = text.split()
        if not words:
            raise ValueError("empty passage")
        word = words[-1]
        context = encode(text[: text.rfind(word)].strip())
        target = encode(" " + word)
    else:
        ids = encode(text)
        if len(ids) < 2:
            raise ValueError("fewer than 2 tokens")
        context, target = ids[:-1], ids[-1:]
    return ClozeExample(tuple(context), tuple(target))


def lm_eval_lambada_example(text: str, encode: Callable[[str], list[int]]) -> ClozeExample:
    """lm-eval's `lambada_openai`: target `" " + text.split(" ")[-1]`, context the words before it joined
    by spaces; target ids = encode(context + target)[len(encode(context)):] (its `_encode_pair`)."""
    pieces = text.split(" ")
    context, target = " ".join(pieces[:-1]), " " + pieces[-1]
    spaces = len(context) - len(context.rstrip())  # _encode_pair moves trailing spaces to the target
    if spaces:
        context, target = context[:-spaces], context[-spaces:] + target
    if not context:
        raise ValueError("no context before the last space")
    whole, context_ids = encode(context + target), encode(context)
    return ClozeExample(tuple(context_ids), tuple(whole[len(context_ids):]))


def fit_example(ex: ClozeExample, seq_len: int) -> ClozeExample:
    """Cut context from the left so context + target has at most seq_len + 1 ids (the model reads
    all but the last). The target is never cut; one longer than seq_len is a UsageError."""
    if len(ex.target) > seq_len:
        raise UsageError(f"a target of {len(ex.target)} tokens does not fit --seq-length {seq_len}")
    if not ex.context:
        raise UsageError("a LAMBADA passage has no context before its last word; check the data file")
    excess = len(ex.context) + len(ex.target) - (seq_len + 1)
    if excess <= 0:
        return ex
    return ClozeExample(ex.context[excess:], ex.target, truncated=excess)


LAMBADA_TARGETS = ("megatron", "lm-eval")
"""`--lambada-target`: Megatron's last whitespace-separated word, or lm-eval's text after the last space."""


def build_cloze_examples(texts: Sequence[str], encode: Callable[[str], list[int]], strict: bool,
                         seq_len: int, target: str = "megatron") -> list[ClozeExample]:
    """Every passage as a fitted example; a passage that cannot be scored is a UsageError naming its line.

    target: "megatron" (`strict` picks the last token or the last word) or "lm-eval" (always the whole
    target after the last space)."""
    out = []
    for line, text in enumerate(texts, start=1):
        try:
            ex = lm_eval_lambada_example(text, encode) if target == "lm-eval" else lambada_example(text, encode, strict)
            out.append(fit_example(ex, seq_len))
        except ValueError as exc:
            raise UsageError(f"example {line}: {exc}; every line must hold a passage ending in its target word") \
                from None
    return out


@dataclass
class ClozeResult:
    """LAMBADA sums: correct examples, and the target log-likelihood for its perplexity."""

    correct: int
    examples: int
    loss_sum: float  # nats over all target tokens
    target_tokens: int
    truncated_examples: int
    strict: bool

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples

    @property
    def ppl(self) -> float:
        """Per-target perplexity exp(total target NLL / examples): per word in strict mode (the GPT-2
        paper's LAMBADA perplexity), per last BPE token otherwise."""
        return safe_exp(self.loss_sum / self.examples)

    @property
    def token_ppl(self) -> float:
        return safe_exp(self.loss_sum / self.target_tokens)

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "correct": self.correct, "examples": self.examples,
                "ppl": self.ppl, "token_ppl": self.token_ppl, "loss_sum": self.loss_sum,
                "target_tokens": self.target_tokens, "truncated_examples": self.truncated_examples,
                "strict": self.strict}


def lm_eval_pages(text: str) -> list[str]:
    """WikiText split into pages as lm-eval's `wikitext` task gets them (EleutherAI/wikitext_document_level):
    a new page starts at each level-1 heading line (` = Title = `); pages are joined lines, blank ones dropped."""
    pages, lines = [], []
    for line in text.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            page = "\n".join(lines)
            if page.strip():
                pages.append(page)
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


def lm_eval_words(page: str) -> int:
    """lm-eval's word count of a page (before detokenization): `len(re.split(r"\\s+", page))`."""
    return len(re.split(r"\s+", page))


def rolling_windows(n_tokens: int, seq_len: int) -> list[Window]:
    """lm-eval's `loglikelihood_rolling` over a stream of `n_tokens` (an end-of-text token, then the text):
    targets 1..n-1 in disjoint chunks of `seq_len`, each read with the `seq_len` tokens before its end
    (the last chunk's window reaches back to a full `seq_len` of context)."""
    if seq_len < 1:
        raise UsageError(f"--seq-length {seq_len} must be >= 1")
    windows = []
    for first in range(1, n_tokens, seq_len):
        end = min(first + seq_len, n_tokens)  # targets [first, end)
        start = max(0, end - 1 - seq_len)
        windows.append(Window(start, end - 1 - start, end - first))
    return windows


@dataclass
class PageResult:
    """lm-eval's wikitext sums: target NLL over every page, words and UTF-8 bytes of the pages."""

    loss_sum: float
    scored_tokens: int
    words: int
    bytes: int
    pages: int

    @property
    def word_perplexity(self) -> float:
        return safe_exp(self.loss_sum / self.words)

    @property
    def byte_perplexity(self) -> float:
        return safe_exp(self.loss_sum / self.bytes)

    @property
    def bits_per_byte(self) -> float:
        return self.loss_sum / self.bytes / math.log(2)

    def to_dict(self) -> dict:
        return {"word_perplexity": self.word_perplexity, "byte_perplexity": self.byte_perplexity,
                "bits_per_byte": self.bits_per_byte, "loss_sum": self.loss_sum, "scored_tokens": self.scored_tokens,
                "token_ppl": safe_exp(self.loss_sum / max(self.scored_tokens, 1)), "words": self.words,
                "bytes": self.bytes, "pages": self.pages}
