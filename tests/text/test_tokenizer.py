"""GPT-2 vocabulary fetch/verify (gpt2forge.text.vocab) and the tiktoken tokenizer (gpt2forge.text.tokenizer).

Tests that need the real vocabulary skip when it has not been fetched (`make` or
`python -m gpt2forge.text.vocab`); the error-path tests need nothing and always run.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError
from gpt2forge.text import vocab
from gpt2forge.text.tokenizer import GPT2Tokenizer, load_tokenizer

ASSETS = vocab.asset_dir()
needs_vocab = pytest.mark.skipif(
    not vocab.verify(ASSETS / vocab.TIKTOKEN_FILE) or not (ASSETS / vocab.VOCAB_FILE).is_file(),
    reason=f"GPT-2 vocabulary not fetched into {ASSETS}; run `python -m gpt2forge.text.vocab` (or `make`)",
)

VARIED_TEXT = (
    "The quick brown fox jumps over the lazy dog. Numbers: 3.14159, 1,000,000 and 42nd.\n"
    "Whitespace:    four spaces,\t\ttwo tabs,\r\nCRLF, and a trailing run      \n\n\n"
    "Accents and scripts: déjà vu, Straße, Ελληνικά, العربية, हिन्दी, 中文, 한국어.\n"
    "Emoji and symbols: 👩‍💻 ✓ → ∑ €5 ½.  Code: def f(x): return x**2  # comment\n"
    "<|endoftext|> is plain text here, as is <|endoftext |> and <|endoftext|><|endoftext|>.\n"
    "Contractions: don't, I'll, we've, they're, she's, you'd, I'm, O'Neil's 'quoted'."
)


@pytest.fixture(scope="module")
def tok() -> GPT2Tokenizer:
    return load_tokenizer()


@needs_vocab
def test_hello_world_ids(tok):
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"


@needs_vocab
def test_round_trip_unicode(tok):
    ids = tok.encode(VARIED_TEXT)
    assert tok.decode(ids) == VARIED_TEXT
    # Multi-byte characters need more than one id each; a byte-less tokenizer would not.
    assert len(tok.encode("中文")) > 1


@needs_vocab
def test_special_token_and_vocab_size(tok):
    assert tok.eot_id == 50256
    assert tok.vocab_size == 50257
    assert tok.name == "gpt2"
    assert tok.decode([50256]) == "<|endoftext|>"
    # In text it is ordinary characters, never the document separator.
    ids = tok.encode("a<|endoftext|>b")
    assert 50256 not in ids and len(ids) > 3


@needs_vocab
def test_encode_batch_matches_encode(tok):
    texts = VARIED_TEXT.split("\n") + ["", " "]
    assert tok.encode_batch(texts, num_threads=2) == [tok.encode(t) for t in texts]


@needs_vocab
def test_hf_tokenizers_on_derived_files_match_tiktoken(tok):
    hf = vocab.byte_level_bpe(ASSETS / vocab.VOCAB_FILE, ASSETS / vocab.MERGES_FILE)
    for text in (VARIED_TEXT, vocab.PARITY_SAMPLE, "  leading", "trailing  ", "\n\n", "x"):
        assert hf.encode(text).ids == tok.encode(text), text
    assert hf.decode(tok.encode(VARIED_TEXT)) == VARIED_TEXT
    assert len(json.loads((ASSETS / vocab.VOCAB_FILE).read_text(encoding="utf-8"))) == 50257
    merges = (ASSETS / vocab.MERGES_FILE).read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2" and len(merges) == 1 + 50000
    assert merges[1:3] == ["Ġ t", "Ġ a"]  # GPT-2's first two merges


def test_verify_detects_tampered_copy(tmp_path):
    good = tmp_path / "good.tiktoken"
    if vocab.verify(ASSETS / vocab.TIKTOKEN_FILE):
        shutil.copyfile(ASSETS / vocab.TIKTOKEN_FILE, good)
        assert vocab.verify(good)
        data = bytearray(good.read_bytes())
    else:  # still exercises the mismatch path without the asset
        data = bytearray(b"IQ== 0\nIg== 1\n")
    data[0] ^= 0x01
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(bytes(data))
    assert not vocab.verify(bad)
    assert not vocab.verify(tmp_path / "absent.tiktoken")
    with pytest.raises(UsageError, match="sha256"):
        load_tokenizer(bad)


def test_missing_asset_names_make(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2FORGE_ASSETS", str(tmp_path))
    with pytest.raises(UsageError, match="run `make`") as info:
        load_tokenizer()
    assert str(tmp_path / vocab.TIKTOKEN_FILE) in str(info.value)


def _failing_pip(cmd, **kwargs):
    assert "download" in cmd and vocab.PACKAGE in cmd and "install" not in cmd
    return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")


def test_pip_failure_is_one_line_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPT2FORGE_ASSETS", str(tmp_path))
    monkeypatch.setattr(vocab.subprocess, "run", _failing_pip)
    with pytest.raises(UsageError, match="openai-whisper") as info:
        vocab.ensure_vocab(quiet=True)
    assert "GPT2FORGE_ASSETS" in str(info.value) and "\n" not in str(info.value)
    assert vocab.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert not any(tmp_path.iterdir())  # nothing half-written


def _no_pip(cmd, **kwargs):
    raise AssertionError("pip must not run when the vocabulary is already present")


@needs_vocab
def test_ensure_vocab_is_idempotent(tmp_path, monkeypatch, capsys):
    for name in (vocab.TIKTOKEN_FILE, vocab.VOCAB_FILE, vocab.MERGES_FILE):
        shutil.copyfile(ASSETS / name, tmp_path / name)
    monkeypatch.setenv("GPT2FORGE_ASSETS", str(tmp_path))
    monkeypatch.setattr(vocab.subprocess, "run", _no_pip)
    assert vocab.ensure_vocab() == tmp_path / vocab.TIKTOKEN_FILE
    assert "already present" in capsys.readouterr().out
    assert vocab.main(["--check"]) == 0


@pytest.mark.slow
@needs_vocab
def test_ensure_vocab_derives_pinned_hf_files(tmp_path, monkeypatch):
    shutil.copyfile(ASSETS / vocab.TIKTOKEN_FILE, tmp_path / vocab.TIKTOKEN_FILE)
    monkeypatch.setenv("GPT2FORGE_ASSETS", str(tmp_path))
    monkeypatch.setattr(vocab.subprocess, "run", _no_pip)
    vocab.ensure_vocab(quiet=True)
    for name, digest in vocab.DERIVED_SHA256.items():
        assert file_sha256(tmp_path / name) == digest
    # --check catches a hand-edited derived file.
    (tmp_path / vocab.MERGES_FILE).write_text("#version: 0.2\nĠ a\nĠ t\n", encoding="utf-8")
    assert vocab.main(["--check"]) == 2
