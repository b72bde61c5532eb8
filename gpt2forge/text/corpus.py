"""The default training corpus, present on every machine with no download: English prose from the
documentation strings of the installed Python standard library.

Sources are read, never imported: each stdlib `.py` file (test suites, codec tables and
site-packages skipped) is parsed with `ast` and its module, class and function docstrings are
collected in source order. Each docstring is split into paragraphs; paragraphs that look like code,
doctests or tables are dropped, and the rest is kept if enough prose remains. The kept docstrings of
one module, joined by blank lines, form one document. The pages of `pydoc_data/topics.py` (the text
`help("TOPIC")` prints) follow, one document per topic, through the same filter.

The result depends only on the stdlib files of the running Python (same Python build, same
corpus); the walk is sorted and nothing is random. Tokenized form: a plain `list[list[int]]`, each
document followed by one `<|endoftext|>` id, the same pickle layout as the reference's
Wikipedia data, so the pickle reader serves both.
"""

from __future__ import annotations

import ast
import os
import pickle
import re
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from gpt2forge.core.atomic import write_atomic

# Folder names skipped anywhere below the stdlib root: test suites (test, tests, idle_test, and
# lib2to3/tests with its Python 2 fixtures), codec tables (encodings: boilerplate docstrings),
# third-party packages, and bytecode caches.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "encodings", "site-packages",
                       "dist-packages", "__pycache__"})

MIN_DOCSTRING_WORDS = 8
"""A docstring is kept only if its prose paragraphs hold at least this many words. Eight keeps
one-sentence docstrings ("Return a new transport that protocol should start using immediately.");
the stdlib holds only ~0.4M tokens of docstrings, so a stricter bar (20) costs 16% of them."""
MIN_PARAGRAPH_WORDS = 3
"""Shorter paragraphs ("Example::", "Parameters") are headings, not prose."""
MIN_LETTER_FRACTION = 0.7
"""Prose paragraphs: letters / non-space characters at least this (English prose is ~0.9)."""
MAX_SYMBOL_FRACTION = 0.05
"""Prose paragraphs: code symbols / non-space characters at most this. Parentheses, quotes, `*`
and `_` are not counted: prose mentions `f()`, *args* and names_with_underscores."""
_CODE_SYMBOLS = frozenset("[]{}=<>@#$%\\|;^~")
# A line that is only a rule (rst heading underline or table border).
_RULE_LINE = re.compile(r"^\s*([-=~^+*#_:|]{3,}\s*)+$")
# Two or more rule groups separated by spaces: the border of an rst simple table.
_TABLE_BORDER = re.compile(r"^\s*[-=]{2,}(\s+[-=]{2,})+\s*$")
# Text, a run of 3+ spaces, more text: an aligned column.
_COLUMN_GAP = re.compile(r"\S {3,}\S")
# A line of Python rather than English: compound-statement headers, imports, decorators, comments,
# a lone `...`, assignments / comparisons / signature arrows, or a bare call.
_CODE_LINE = re.compile(r"""^\s*(?:
      (?:async\s+)?def\s+\w+\s*\(.*
    | class\s+\w+\s*[(:].*
    | for\s+[\w, ()]+\s+in\s+.+:
    | (?:if|elif|while)\s+.+:
    | with\s+.+(?:\)|\s+as\s+\w+):
    | (?:try|else|finally):
    | except\b.*:
    | import\s+[\w.]+(?:\s+as\s+\w+)?
    | from\s+[\w.]+\s+import\s.+
    | [@\#].*
    | \.\.\.
    | .*(?:\s=\s|==|!=|\+=|->|\w=\w).*
    | [\w.]+\(.*\)[.;]?
    )\s*$""", re.VERBOSE)


def stdlib_root() -> Path:
    """Source folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_files(root: Path) -> Iterator[Path]:
    """Every `.py` file below `root` outside SKIP_DIRS (and no `test_*.py`), in sorted depth-first
    order: a folder's files, then its subfolders."""
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning and sorting in place makes os.walk skip those folders and visit in a fixed order.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            yield Path(dirpath) / name


def docstrings(tree: ast.AST) -> Iterator[str]:
    """Cleaned docstrings (inspect.cleandoc) of a module and its classes and functions, depth
    first in source order (ast.walk is breadth first, which would scatter a class's methods)."""
    if isinstance(tree, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(tree, clean=True)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(tree):
        # Docstrings live only in statement bodies; not descending into expressions makes the
        # walk several times cheaper.
        if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from docstrings(child)


def is_prose(paragraph: str) -> bool:
    """True if a docstring paragraph (no blank lines inside) reads as English prose, False if it
    looks like a doctest, a code block, a signature or an aligned table."""
    lines = [ln for ln in paragraph.splitlines() if ln.strip()]
    if len(paragraph.split()) < MIN_PARAGRAPH_WORDS:
        return False
    if any(ln.lstrip().startswith(">>>") or _TABLE_BORDER.match(ln) for ln in lines):
        return False
    # More than a third of the lines being code or aligned columns makes it a block, not prose.
    if sum(bool(_CODE_LINE.match(ln)) for ln in lines) * 3 > len(lines):
        return False
    if len(lines) >= 2 and sum(bool(_COLUMN_GAP.search(ln.strip())) for ln in lines) * 2 >= len(lines):
        return False
    chars = [c for c in paragraph if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    symbols = sum(c in _CODE_SYMBOLS for c in chars)
    return letters >= MIN_LETTER_FRACTION * len(chars) and symbols <= MAX_SYMBOL_FRACTION * len(chars)


def prose_of(docstring: str) -> str:
    """The prose paragraphs of a cleaned docstring, each reflowed onto one line, joined by blank
    lines, or "" if they hold fewer
    than MIN_DOCSTRING_WORDS words. Rule-only lines (heading underlines) are removed first."""
    kept = []
    for paragraph in re.split(r"\n\s*\n", docstring):
        paragraph = "\n".join(ln for ln in paragraph.splitlines() if not _RULE_LINE.match(ln))
        if is_prose(paragraph):
            # Reflow: hard line wraps and indentation are layout, not language; keeping them
            # would make a tenth of the tokens newlines and runs of spaces.
            kept.append(" ".join(paragraph.split()))
    text = "\n\n".join(kept)
    return text if len(text.split()) >= MIN_DOCSTRING_WORDS else ""


def _parse(path: Path) -> ast.Module | None:
    """The module's syntax tree, or None if this Python cannot parse it (e.g. Python 2 fixtures)."""
    with warnings.catch_warnings():
        # Invalid escape sequences in old sources warn at parse time; they are not our concern.
        warnings.simplefilter("ignore")
        try:
            return ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            return None


def pydoc_topics(root: Path) -> list[str]:
    """Texts of `pydoc_data/topics.py` (the language-reference pages `help("TOPIC")` shows), in
    sorted topic order; [] if the file is absent or not the expected `topics = {...}` literal."""
    path = root / "pydoc_data" / "topics.py"
    tree = _parse(path) if path.is_file() else None
    for node in tree.body if tree is not None else []:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "topics"):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [text for _, text in sorted(topics.items()) if isinstance(text, str)]
    return []


def build_documents(root: Path | None = None) -> list[str]:
    """Prose documents from the stdlib at `root` (default: stdlib_root()), in a fixed order:
    one per module (sorted path order), then one per pydoc topic (sorted topic name).

    The pydoc topics are the stdlib's largest block of documentation text that is not a
    docstring (~+25% tokens); they go through the same paragraph filter. A docstring already kept
    earlier in the walk is not repeated (tkinter and friends share many one-line docstrings), so
    boilerplate is not overweighted. Modules with no kept docstring give no document.
    """
    root = Path(root) if root is not None else stdlib_root()
    seen: set[str] = set()
    documents = []
    for path in module_files(root):
        tree = _parse(path)
        if tree is None:
            continue
        kept = []
        for doc in docstrings(tree):
            text = prose_of(doc)
            if text and text not in seen:
                seen.add(text)
                kept.append(text)
        if kept:
            documents.append("\n\n".join(kept))
    documents.extend(text for text in map(prose_of, pydoc_topics(root)) if text)
    return documents


def build_corpus(tokenizer, min_tokens: int = 64, documents: list[str] | None = None) -> list[list[int]]:
    """Tokenize `documents` (default: build_documents()) with `tokenizer.encode_batch`, end each
    with exactly one `tokenizer.eot_id`, and drop those shorter than `min_tokens` (EOT included).

    Returns a plain list of lists of ints, in document order.
    """
    if documents is None:
        documents = build_documents()
    eot = tokenizer.eot_id
    corpus = []
    for ids in tokenizer.encode_batch(documents, num_threads=os.cpu_count() or 1):
        if len(ids) + 1 >= min_tokens:
            corpus.append(list(ids) + [eot])
    return corpus


def save_corpus(corpus: list[list[int]], path: Path) -> None:
    """Pickle `corpus` to `path` atomically (temporary file in the same folder, then os.replace),
    creating the folder if needed, so an interrupted build never leaves a truncated pickle."""
    write_atomic(path, pickle.dumps(corpus, protocol=pickle.DEFAULT_PROTOCOL))
