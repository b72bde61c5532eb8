"""Tokenizers: GPT-2 on tiktoken (the default), any other on Hugging Face `tokenizers`.

Every tokenizer in this package exposes the same small surface, so data scripts, the trainer and
generation never care which one they hold: `encode`, `encode_batch`, `decode`, `eot_id`,
`vocab_size`, `name`, `save(dir)` (writes files `load_tokenizer(dir)` reads back) and `source`
(what to pass to `load_tokenizer` to load it again, e.g. in a worker process). `encode` treats
`<|endoftext|>` in the text as ordinary characters; document boundaries are added explicitly with
`eot_id` by the caller.

`load_tokenizer(path)` accepts:
- nothing: GPT-2 from the verified `gpt2.tiktoken` in gpt2forge.text.vocab.asset_dir();
- a `.tiktoken` rank file (must be GPT-2's, by sha256);
- a `tokenizer.json` file, or a folder holding one (a Hugging Face tokenizer, e.g. from
  `data/train_tokenizer.py` or `save_pretrained`);
- a folder holding `vocab.json` + `merges.txt` (GPT-2-style byte-level BPE; Megatron's
  `--vocab-file`/`--merge-file` pair is `load_bpe_files`). When those are GPT-2's own files (same
  content), the tiktoken tokenizer is returned, which gives the same ids faster.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import tiktoken

from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError
from gpt2forge.text.vocab import (
    DERIVED_SHA256,
    EOT_TOKEN,
    MERGES_FILE,
    TIKTOKEN_FILE,
    VOCAB_FILE,
    asset_dir,
    byte_level_bpe,
    gpt2_encoding,
    verify,
)

HF_FILE = "tokenizer.json"
# End-of-document tokens looked up, in this order, in a Hugging Face vocabulary.
EOT_CANDIDATES = (EOT_TOKEN, "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


class GPT2Tokenizer:
    """GPT-2 byte-level BPE (50257 ids, `<|endoftext|>` = 50256) backed by a tiktoken Encoding."""

    name = "gpt2"

    def __init__(self, encoding: tiktoken.Encoding, source: str | None = None):
        self._enc = encoding
        self.eot_id: int = encoding.eot_token
        self.vocab_size: int = encoding.n_vocab
        self.source = source

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; `<|endoftext|>` inside it is encoded as plain text."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 8) -> list[list[int]]:
        """`encode` for each text, in order, on `num_threads` threads (tiktoken releases the GIL)."""
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._enc.decode(list(ids))

    def save(self, directory: str | Path) -> Path:
        """Write GPT-2's `vocab.json` + `merges.txt` to `directory` (load_tokenizer reads them back
        as this tokenizer). Returns the folder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in (VOCAB_FILE, MERGES_FILE):
            src = asset_dir() / name
            if not src.is_file():
                raise UsageError(f"{src} is missing; run `make` (or `python -m gpt2forge.text.vocab`)")
            write_atomic(directory / name, src.read_bytes())
        return directory

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class HFTokenizer:
    """Any Hugging Face `tokenizers.Tokenizer` behind the package's tokenizer surface.

    `eot_id` is the first of EOT_CANDIDATES in the vocabulary, or None when it has none (then
    documents cannot be separated: preprocess_data refuses `--append-eod`). Special tokens are not
    added by `encode` (no BOS/EOS templates): the caller adds `eot_id` explicitly.
    """

    def __init__(self, tokenizer, name: str, source: str | None = None):
        self._tok = tokenizer
        self.name = name
        self.source = source
        # One past the largest id, not the token count: a vocabulary may skip ids (a hand-edited
        # vocab.json), and every id `encode` returns must index an embedding row.
        self.vocab_size: int = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        ids = (tokenizer.token_to_id(t) for t in EOT_CANDIDATES)
        self.eot_id: int | None = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 8) -> list[list[int]]:
        """`encode` for each text, in order. The Rust side parallelises unless the environment sets
        TOKENIZERS_PARALLELISM=false (preprocessing workers do: one core each); `num_threads` is
        accepted for interface parity."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.json` to `directory`. Returns the folder."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / HF_FILE, self._tok.to_str(pretty=True))
        return directory

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


Tokenizer = GPT2Tokenizer | HFTokenizer


def _gpt2_tiktoken(path: Path) -> GPT2Tokenizer:
    if not path.is_file():
        raise UsageError(f"GPT-2 vocabulary not found at {path}; run `make` "
                         f"(or `python -m gpt2forge.text.vocab`) to fetch it")
    if not verify(path):
        raise UsageError(f"GPT-2 vocabulary at {path} fails its sha256 check; delete it and run "
                         f"`make` (or `python -m gpt2forge.text.vocab`) to fetch it again")
    return GPT2Tokenizer(gpt2_encoding(path), source=str(path))


def _merge_lines(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#version")]


def is_gpt2_files(vocab_file: Path, merge_file: Path) -> bool:
    """True if `vocab_file` + `merge_file` hold GPT-2's BPE (same bytes as ours, or same content:
    the vocab mapping and the merge list, e.g. the `gpt2-vocab.json` Megatron's README fetches)."""
    if (file_sha256(vocab_file) == DERIVED_SHA256[VOCAB_FILE]
            and file_sha256(merge_file) == DERIVED_SHA256[MERGES_FILE]):
        return True
    ours = asset_dir()
    if not (ours / VOCAB_FILE).is_file() or not (ours / MERGES_FILE).is_file():
        return False
    try:
        same_vocab = (json.loads(vocab_file.read_text(encoding="utf-8"))
                      == json.loads((ours / VOCAB_FILE).read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return same_vocab and _merge_lines(merge_file) == _merge_lines(ours / MERGES_FILE)


def load_bpe_files(vocab_file: str | Path, merge_file: str | Path) -> Tokenizer:
    """Byte-level BPE from a `vocab.json` + `merges.txt` pair (Megatron's `--vocab-file` and
    `--merge-file`): tiktoken when they are GPT-2's, else a HF ByteLevel BPE without prefix space."""
    vocab_file, merge_file = Path(vocab_file), Path(merge_file)
    for flag, p in (("vocab", vocab_file), ("merge", merge_file)):
        if not p.is_file():
            raise UsageError(f"{flag} file {p} not found; pass a GPT-2-style {flag} file "
                             f"(e.g. gpt2forge/assets/{VOCAB_FILE if flag == 'vocab' else MERGES_FILE})")
    if is_gpt2_files(vocab_file, merge_file):
        return _gpt2_tiktoken(asset_dir() / TIKTOKEN_FILE)
    try:
        raw = byte_level_bpe(vocab_file, merge_file)
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise UsageError(f"{vocab_file} + {merge_file}: not a BPE vocab/merges pair ({exc})") from None
    if raw.token_to_id(EOT_TOKEN) is not None:
        raw.add_special_tokens([EOT_TOKEN])
    return HFTokenizer(raw, name=vocab_file.parent.name or "bpe", source=str(vocab_file.parent))


def _load_hf_json(path: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as HFRaw

    try:
        raw = HFRaw.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise UsageError(f"{path}: not a Hugging Face tokenizer file ({exc}); re-create it with "
                         f"`python data/train_tokenizer.py`") from None
    name = path.parent.name if path.name == HF_FILE else path.stem
    return HFTokenizer(raw, name=name or "tokenizer", source=str(path))


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer at `path` (see the module docstring for what it may be); GPT-2 by default.

    Raises UsageError naming the path and the fix if nothing loadable is there.
    """
    if path is None:
        return _gpt2_tiktoken(asset_dir() / TIKTOKEN_FILE)
    path = Path(path)
    if path.is_dir():
        if (path / VOCAB_FILE).is_file() and (path / MERGES_FILE).is_file():
            if is_gpt2_files(path / VOCAB_FILE, path / MERGES_FILE):
                return _gpt2_tiktoken(asset_dir() / TIKTOKEN_FILE)
            if not (path / HF_FILE).is_file():
                return load_bpe_files(path / VOCAB_FILE, path / MERGES_FILE)
        if (path / HF_FILE).is_file():
            return _load_hf_json(path / HF_FILE)
        raise UsageError(f"tokenizer folder {path} holds neither {HF_FILE} nor {VOCAB_FILE} + "
                         f"{MERGES_FILE}; make one with `python data/train_tokenizer.py` or "
                         f"`save_pretrained` of a fast Hugging Face tokenizer")
    if path.suffix == ".json" and path.is_file():
        return _load_hf_json(path)
    if path.suffix == ".tiktoken":
        return _gpt2_tiktoken(path)
    if not path.exists():
        raise UsageError(f"tokenizer {path} not found; pass a tokenizer folder (tokenizer.json, or "
                         f"vocab.json + merges.txt) or leave it out for GPT-2")
    raise UsageError(f"{path}: not a tokenizer (expected a folder, a {HF_FILE} or gpt2.tiktoken)")


def tokenizer_files(path: str | Path) -> dict[str, Path]:
    """File name -> path of the files that make up the tokenizer at `path` (what a checkpoint
    ships so that `load_tokenizer(checkpoint_dir)` reloads it). UsageError if none is there."""
    tok = load_tokenizer(path)  # validates, and names the fix when it is not a tokenizer
    path = Path(path)
    if isinstance(tok, GPT2Tokenizer):
        folder = path if path.is_dir() and (path / VOCAB_FILE).is_file() else asset_dir()
        return {name: folder / name for name in (VOCAB_FILE, MERGES_FILE)}
    if path.is_file():
        return {HF_FILE: path}
    if (path / HF_FILE).is_file():
        return {HF_FILE: path / HF_FILE}
    return {name: path / name for name in (VOCAB_FILE, MERGES_FILE)}


def worker_environment() -> None:
    """Keep one tokenizer per process on one core (HF's Rust pool would oversubscribe workers)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


__all__ = ["GPT2Tokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "load_bpe_files",
           "is_gpt2_files", "tokenizer_files", "worker_environment"]
