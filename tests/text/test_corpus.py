"""The embedded default corpus (gpt2forge.text.corpus) and its build script."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest

from gpt2forge.text import corpus, vocab
from gpt2forge.text.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
needs_vocab = pytest.mark.skipif(
    not vocab.verify(vocab.asset_dir() / vocab.TIKTOKEN_FILE),
    reason="GPT-2 vocabulary not fetched; run `python -m gpt2forge.text.vocab` (or `make`)",
)

PROSE = ("Return the number of items in the queue, counting only those that were added "
         "before the call and have not yet been removed by a consumer.")
DOCTEST = ">>> q = Queue()\n>>> q.put(1)\n>>> q.qsize()\n1"
CODE_BLOCK = ("    with open(path) as f:\n        for line in f:\n"
              "            total = total + len(line)\n    print(total)")
TABLE = ("=========  ==========================\nName       Meaning\n=========  ==========================\n"
         "'r'        open for reading (default)\n'w'        open for writing\n=========  ==========================")
COLUMNS = ("match     Match a pattern at the start of a string.\n"
           "search    Search a string for the presence of a pattern.\n"
           "sub       Substitute occurrences of a pattern found in a string.")
SIGNATURE = "od.popitem(last=True) -> (k, v), return and remove a (key, value) pair."


def _sentence(marker: str) -> str:
    return f"The {marker} module explains how ordinary English sentences survive the prose filter here."


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return corpus.build_documents()


def test_is_prose_keeps_prose_and_drops_code_like_text():
    assert corpus.is_prose(PROSE)
    for text in (DOCTEST, CODE_BLOCK, TABLE, COLUMNS, SIGNATURE, "Example::", "x = f(a, b)",
                 "import os", "{'a': [1, 2], 'b': {3: 4}}"):
        assert not corpus.is_prose(text), text


def test_prose_of_keeps_only_prose_paragraphs():
    doc = "\n\n".join([PROSE, DOCTEST, "Examples\n--------", CODE_BLOCK, TABLE, PROSE.upper()])
    assert corpus.prose_of(doc) == PROSE + "\n\n" + PROSE.upper()
    assert corpus.prose_of("Return the value.") == ""  # too few words to be worth keeping
    assert corpus.prose_of(DOCTEST + "\n\n" + CODE_BLOCK) == ""


@pytest.mark.slow
def test_build_documents_nonempty_prose(documents):
    assert len(documents) > 50
    assert sum(len(d.split()) for d in documents) > 50_000
    assert all(d.strip() for d in documents)
    assert not any(line.lstrip().startswith(">>>") for d in documents for line in d.splitlines())


@pytest.mark.slow
def test_build_documents_deterministic(documents):
    # Two full builds cost ~4 s more; a real stdlib package (with subpackages) twice shows the
    # same, and test_fake_stdlib_order_and_skips covers file-creation order.
    email = corpus.stdlib_root() / "email"
    first = corpus.build_documents(email)
    assert len(first) > 5 and first == corpus.build_documents(email)


def _walk_order(rel: Path) -> tuple:
    """Sorted depth-first order, a folder's files before its subfolders (os.walk, top-down)."""
    return tuple((1, d) for d in rel.parts[:-1]) + ((0, rel.name),)


def test_real_stdlib_walk_is_sorted_and_skips_test_suites():
    root = corpus.stdlib_root()
    rels = [p.relative_to(root) for p in corpus.module_files(root)]
    assert len(rels) > 100
    assert rels == sorted(rels, key=_walk_order)
    for rel in rels:
        assert not set(rel.parts[:-1]) & corpus.SKIP_DIRS, rel
        assert not rel.name.startswith("test_"), rel


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _fake_stdlib(root: Path, order: list[str]) -> None:
    """A tiny stdlib with one kept module per marker and test suites that must be skipped."""
    files = {
        "alpha.py": f'"""{_sentence("alphaword")}\n\n{DOCTEST}"""\n'
                    f'def f():\n    """{_sentence("alphafunc")}"""\n',
        "pkg/__init__.py": f'"""{_sentence("pkgword")}"""\n',
        "pkg/tests/helper.py": f'"""{_sentence("testsword")}"""\n',
        "test/test_beta.py": f'"""{_sentence("testsuiteword")}"""\n',
        "test_toplevel.py": f'"""{_sentence("toplevelword")}"""\n',
        "idlelib/idle_test/delta.py": f'"""{_sentence("idletestword")}"""\n',
        "site-packages/thirdparty.py": f'"""{_sentence("thirdpartyword")}"""\n',
        "encodings/cp999.py": f'"""{_sentence("codecword")}"""\n',
        "py2.py": 'print "not python 3"\n',
        "pydoc_data/topics.py": f"topics = {{'zeta': {_sentence('zetatopic')!r}, "
                                f"'eta': {_sentence('etatopic')!r}}}\n",
    }
    for rel in order:
        _write(root, rel, files[rel])


def test_fake_stdlib_order_and_skips(tmp_path):
    names = ["alpha.py", "pkg/__init__.py", "pkg/tests/helper.py", "test/test_beta.py",
             "test_toplevel.py", "idlelib/idle_test/delta.py", "site-packages/thirdparty.py",
             "encodings/cp999.py", "py2.py", "pydoc_data/topics.py"]
    _fake_stdlib(tmp_path / "a", names)
    _fake_stdlib(tmp_path / "b", names[::-1])
    docs = corpus.build_documents(tmp_path / "a")
    assert docs == corpus.build_documents(tmp_path / "b")
    text = "\n".join(docs)
    for skipped in ("testsword", "testsuiteword", "toplevelword", "idletestword",
                    "thirdpartyword", "codecword"):
        assert skipped not in text
    assert docs == [_sentence("alphaword") + "\n\n" + _sentence("alphafunc"),
                    _sentence("pkgword"), _sentence("etatopic"), _sentence("zetatopic")]


@pytest.mark.slow
@needs_vocab
def test_build_corpus_ends_each_document_with_one_eot(documents):
    tok = load_tokenizer()
    built = corpus.build_corpus(tok, min_tokens=64, documents=documents)
    assert len(built) > 50
    for ids in built:
        assert ids[-1] == 50256 and ids.count(50256) == 1 and len(ids) >= 64
        assert all(type(i) is int for i in ids[:8])
    # Text "<|endoftext|>" stays text; short documents are dropped.
    long_doc = "A document that mentions <|endoftext|> in its text. " * 10
    out = corpus.build_corpus(tok, min_tokens=20, documents=["Too short.", long_doc])
    assert len(out) == 1 and out[0].count(50256) == 1 and tok.decode(out[0][:-1]) == long_doc


def test_save_corpus_is_a_plain_pickle(tmp_path):
    data = [[1, 2, 50256], [3, 50256]]
    out = tmp_path / "sub" / "corpus.pkl"
    corpus.save_corpus(data, out)
    assert pickle.loads(out.read_bytes()) == data
    assert [p.name for p in out.parent.iterdir()] == ["corpus.pkl"]  # no temporary left behind


def _script():
    spec = importlib.util.spec_from_file_location("build_default_corpus",
                                                  REPO / "data" / "build_default_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_skips_existing_output_and_rejects_bad_flags(tmp_path, capsys):
    script = _script()
    out = tmp_path / "stdlib_docs.pkl"
    out.write_bytes(b"keep me")
    assert script.main(["--output", str(out)]) == 0
    assert out.read_bytes() == b"keep me" and "--force" in capsys.readouterr().out
    assert script.main(["--output", str(tmp_path / "x.pkl"), "--min-tokens", "0"]) == 2
    assert "--min-tokens" in capsys.readouterr().err
