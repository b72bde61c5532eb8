"""Cleaning loose-JSON corpora: ftfy, language ID, minimum length, optional Gopher-style quality rules.

`Cleaner(config).clean(text)` returns `(cleaned text, "")` or `(None, rule)` naming the rule that
removed the document. Rules run cheapest first: ftfy `fix_text`, `min_chars`, `javascript` (short
documents mentioning javascript), the quality rules (when `quality` is on), `min_tokens` (only texts
under 8 x min_tokens characters are tokenized: a GPT-2 token spans under 8 characters on real text,
as the seed's cleanup_dataset.py assumes), then `lang` (lid.176, gpt2forge.preprocess.langid; only
under `lang_under` characters when set); `collapse_whitespace` then rewrites what is kept.

`clean_file` streams one file through the cleaner on `workers` processes: the parent reads and
writes, workers clean chunks of texts (engine.ordered_map, the pool every tool shares), at most
`2 * workers + 2` chunks are in flight (memory is a few chunks of text, whatever the corpus size)
and the output keeps the input order.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from gpt2forge.core.errors import UsageError, collect
from gpt2forge.preprocess.engine import TokenizerSpec, ordered_map
from gpt2forge.preprocess.jsonl import already_complete, atomic_json, atomic_jsonl, read_documents
from gpt2forge.preprocess.langid import LanguageIdentifier
from gpt2forge.preprocess.unicode_repair import fix_text
from gpt2forge.text.tokenizer import worker_environment

ANY_LANGUAGE = "any"
BULLETS = ("•", "-", "*", "‣", "●", "▪", "◦", "–")
ELLIPSES = ("...", "…")
EXAMPLES_PER_RULE = 3
EXAMPLE_CHARS = 200
CHUNK_DOCS = 256
WHITESPACE_RUNS = re.compile(r"  +|\b\n+ |\b\n+")
"""The seed's general_cleaning: runs of spaces, and newlines after a word, become one space."""


@dataclasses.dataclass(frozen=True)
class CleanConfig:
    """What `Cleaner` keeps. The quality bounds are Gopher's (Rae et al. 2021, appendix A)."""

    fix_text: bool = True
    """Repair mojibake and broken Unicode with ftfy's fix_text."""
    lang: str = "en"
    """ISO 639 code of the language to keep (lid.176 labels), or "any" to keep every language."""
    lang_threshold: float = 0.0
    """Drop documents whose language probability is below this, in [0, 1]."""
    min_tokens: int = 128
    """Drop documents under this many tokens (0: off)."""
    tokenizer: str | None = None
    """Tokenizer for min_tokens (load_tokenizer path); None: GPT-2."""
    min_chars: int = 0
    """Drop documents under this many characters after ftfy (0: off)."""
    javascript_under: int = 0
    """Drop documents under this many characters that mention javascript (the seed's
    remove_256_javascript: 256; 0: off)."""
    lang_under: int = 0
    """Apply the language filter only to documents under this many characters (the seed's
    remove_512_non_english: 512; 0: to every document)."""
    collapse_whitespace: bool = False
    """Replace runs of spaces and newlines after a word with one space (the seed's general_cleaning)."""
    quality: bool = False
    """Apply the quality rules below."""
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_ratio: float = 0.1
    """Most `#` and ellipses per word."""
    max_bullet_lines: float = 0.9
    """Largest fraction of lines starting with a bullet."""
    max_ellipsis_lines: float = 0.3
    """Largest fraction of lines ending with an ellipsis."""
    max_duplicate_lines: float = 0.3
    """Largest fraction of non-empty lines repeating an earlier line."""

    def __post_init__(self):
        errors = []
        if not 0.0 <= self.lang_threshold <= 1.0:
            errors.append(f"--lang-threshold {self.lang_threshold}: must be in [0, 1]")
        if self.min_tokens < 0 or self.min_chars < 0:
            errors.append("--min-tokens and --min-chars must be >= 0")
        if self.javascript_under < 0 or self.lang_under < 0:
            errors.append("--javascript-under and --lang-under must be >= 0")
        collect(errors)


def quality_rule(text: str, cfg: CleanConfig) -> str:
    """The first Gopher rule `text` fails, or "" when it passes them all."""
    words = text.split()
    if not cfg.min_words <= len(words) <= cfg.max_words:
        return "word_count"
    mean = sum(map(len, words)) / len(words)
    if not cfg.min_mean_word_length <= mean <= cfg.max_mean_word_length:
        return "mean_word_length"
    symbols = text.count("#") + sum(text.count(e) for e in ELLIPSES)
    if symbols / len(words) > cfg.max_symbol_ratio:
        return "symbol_ratio"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if sum(ln.startswith(BULLETS) for ln in lines) > cfg.max_bullet_lines * len(lines):
        return "bullet_lines"
    if sum(ln.endswith(ELLIPSES) for ln in lines) > cfg.max_ellipsis_lines * len(lines):
        return "ellipsis_lines"
    if len(lines) - len(set(lines)) > cfg.max_duplicate_lines * len(lines):
        return "duplicate_lines"
    return ""


class Cleaner:
    """The per-document cleaning function; loads its tokenizer and LID model once."""

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg
        self._tokenizer = TokenizerSpec(path=cfg.tokenizer).load() if cfg.min_tokens else None
        self._lid = LanguageIdentifier() if cfg.lang != ANY_LANGUAGE else None
        if self._lid is not None and cfg.lang not in self._lid.languages:
            raise UsageError(f"--lang {cfg.lang}: not a language lid.176 knows; use an ISO 639 code such as "
                             f"{', '.join(sorted(self._lid.languages)[:8])}, ... or '{ANY_LANGUAGE}'")

    def clean(self, text: str) -> tuple[str | None, str]:
        """(cleaned text, "") to keep it, or (None, name of the rule that removed it)."""
        cfg = self.cfg
        if cfg.fix_text:
            text = fix_text(text)
        if len(text) < cfg.min_chars:
            return None, "min_chars"
        if len(text) < cfg.javascript_under and "javascript" in text.lower():
            return None, "javascript"
        if cfg.quality and (rule := quality_rule(text, cfg)):
            return None, rule
        if cfg.min_tokens and len(text) < 8 * cfg.min_tokens:
            if len(self._tokenizer.encode(text)) < cfg.min_tokens:
                return None, "min_tokens"
        if self._lid is not None and (not cfg.lang_under or len(text) < cfg.lang_under):
            code, prob = self._lid.predict(text)
            if code != cfg.lang or prob < cfg.lang_threshold:
                return None, "lang"
        if cfg.collapse_whitespace:
            text = WHITESPACE_RUNS.sub(" ", text)
        return text, ""


@dataclasses.dataclass
class CleanSummary:
    """Counts for the manifest: documents and characters in and out, removals by rule."""

    docs_in: int = 0
    docs_out: int = 0
    chars_in: int = 0
    chars_out: int = 0
    removed: Counter = dataclasses.field(default_factory=Counter)
    examples: dict = dataclasses.field(default_factory=dict)
    bad_lines: int = 0

    def add(self, text_in: str, text_out: str | None, rule: str) -> None:
        self.docs_in += 1
        self.chars_in += len(text_in)
        if text_out is not None:
            self.docs_out += 1
            self.chars_out += len(text_out)
            return
        self.removed[rule] += 1
        kept = self.examples.setdefault(rule, [])
        if len(kept) < EXAMPLES_PER_RULE:
            kept.append(text_in[:EXAMPLE_CHARS])

    def line(self, name: str) -> str:
        rules = ", ".join(f"{r} {n}" for r, n in sorted(self.removed.items())) or "none"
        return (f"{name}: kept {self.docs_out} of {self.docs_in} documents ({self.chars_out} of "
                f"{self.chars_in} characters); removed by rule: {rules}; bad lines skipped: {self.bad_lines}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"removed": dict(self.removed)}


_CLEANER: Cleaner | None = None
"""The cleaner forked workers inherit: built once in the parent, so a bad flag or a missing model
fails there with its one-line error (a failing Pool initializer would be retried forever)."""


def _clean(text: str) -> tuple[str | None, str, bool]:
    """Cleaner.clean's (text, rule) and whether the text changed; an unchanged text comes back as
    None, so the worker does not send the corpus back to the parent (it has it)."""
    out, rule = _CLEANER.clean(text)
    changed = out is not None and out != text
    return (out if changed else None), rule, changed


def _apply(task: tuple) -> list:
    fn, texts = task
    return [fn(t) for t in texts]


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    buf = []
    for item in items:
        buf.append(item)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def map_texts(fn, docs: Iterable, workers: int) -> Iterator[tuple[object, object]]:
    """(document, fn(document.text)) for each of `docs`, in order, on `workers` forked processes
    (0: in this one), in chunks of CHUNK_DOCS through engine.ordered_map (at most 2 * workers + 2
    chunks in flight). `fn` is a module-level function; state it needs is set in module globals
    before the call, so forked workers inherit it."""
    if workers > 0:
        worker_environment()
    sent: deque = deque()  # the documents of each chunk handed out, until its results come back

    def tasks():
        for chunk in _chunks(docs, CHUNK_DOCS):
            sent.append(chunk)
            yield fn, [d.text for d in chunk]

    for results in ordered_map(_apply, tasks(), workers):
        yield from zip(sent.popleft(), results)


def clean_documents(docs: Iterable, cfg: CleanConfig, workers: int) -> Iterator[tuple[object, str | None, str]]:
    """(document, cleaned text or None, rule) for each of `docs` (objects with `.text`), in order."""
    global _CLEANER
    _CLEANER = Cleaner(cfg)
    for doc, (text, rule, changed) in map_texts(_clean, docs, workers):
        yield doc, (text if changed else None if rule else doc.text), rule


def clean_file(input_path: str | Path, output_path: str | Path, cfg: CleanConfig, *, workers: int = 1,
               text_key: str = "text", skip_bad_lines: bool = False,
               filtered_path: str | Path | None = None) -> CleanSummary:
    """Clean `input_path` into `output_path` (written atomically; other fields of each record kept);
    the removed records go to `filtered_path` when given (as read).

    Raises UsageError on bad input (file:line) unless `skip_bad_lines`."""
    summary = CleanSummary()
    bad: Counter = Counter()
    docs = read_documents(input_path, text_key=text_key, skip_bad_lines=skip_bad_lines, bad=bad)
    with atomic_jsonl(output_path) as out, \
            (atomic_jsonl(filtered_path) if filtered_path else contextlib.nullcontext()) as removed:
        bar = tqdm(clean_documents(docs, cfg, workers), unit=" docs", desc=Path(input_path).name,
                   disable=None)
        for doc, text, rule in bar:
            summary.add(doc.text, text, rule)
            if text is not None:
                out.write(doc.record | {text_key: text})
            elif removed is not None:
                removed.write(doc.record)
    summary.bad_lines = bad["bad_lines"]
    return summary


def add_arguments(parser: argparse.ArgumentParser, min_tokens: int = 128) -> None:
    """The cleaning flags shared by data/cleanup_dataset.py and data/cleanup_fix_dataset.py."""
    d = CleanConfig()
    g = parser.add_argument_group("cleaning")
    g.add_argument("--lang", default=d.lang,
                   help=f"ISO 639 code of the language to keep, e.g. en, tr (lid.176); '{ANY_LANGUAGE}' keeps all")
    g.add_argument("--lang-threshold", type=float, default=d.lang_threshold,
                   help="drop documents whose language probability is below this (0-1)")
    g.add_argument("--min-tokens", type=int, default=min_tokens, help="drop documents under N tokens (0: off)")
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="tokenizer for --min-tokens (a tokenizer folder or file); default GPT-2 BPE")
    g.add_argument("--min-chars", type=int, default=d.min_chars, help="drop documents under N characters (0: off)")
    g.add_argument("--no-fix-text", action="store_true", help="skip ftfy's fix_text")
    g.add_argument("--javascript-under", type=int, default=d.javascript_under,
                   help="drop documents under N characters that mention javascript (0: off)")
    g.add_argument("--lang-under", type=int, default=d.lang_under,
                   help="apply --lang only to documents under N characters (0: to all)")
    g.add_argument("--collapse-whitespace", action="store_true",
                   help="turn runs of spaces, and newlines after a word, into one space")
    g.add_argument("--quality", action="store_true",
                   help="apply Gopher quality rules: 50-100000 words, mean word length 3-10, #/ellipsis per word "
                        "<= 0.1, bullet lines <= 90%%, ellipsis lines <= 30%%, duplicate lines <= 30%%")
    g.add_argument("--workers", type=int, default=1, help="worker processes (0: clean in the main process)")
    g.add_argument("--text-key", default="text", help="JSON field holding the text")
    g.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines instead of stopping")
    g.add_argument("--overwrite", action="store_true", help="redo the work even when the output exists")
    g.add_argument("--manifest", default=None, help="also write counts and removed examples to this JSON file")


def config_from_args(args: argparse.Namespace) -> CleanConfig:
    return CleanConfig(fix_text=not args.no_fix_text, lang=args.lang, lang_threshold=args.lang_threshold,
                       min_tokens=args.min_tokens, tokenizer=args.tokenizer_name_or_path,
                       min_chars=args.min_chars, quality=args.quality, javascript_under=args.javascript_under,
                       lang_under=args.lang_under, collapse_whitespace=args.collapse_whitespace)


def run_clean(input_path: str, output_path: str, args: argparse.Namespace,
              filtered_path: str | Path | None = None) -> CleanSummary | None:
    """Clean one file as the command line asks (removed records to `filtered_path` when given); None
    when the output exists and --overwrite is off."""
    if already_complete(output_path, args.overwrite):
        return None
    summary = clean_file(input_path, output_path, config_from_args(args), workers=args.workers,
                         text_key=args.text_key, skip_bad_lines=args.skip_bad_lines, filtered_path=filtered_path)
    if args.manifest:
        atomic_json(args.manifest, summary.to_dict())
    print(summary.line(str(output_path)))
    return summary
