"""GPT-2 tokenizer: tiktoken (Rust) over the verified `gpt2.tiktoken` rank file from gpt2forge.vocab.

Every tokenizer in this package exposes the same small surface, so data scripts and generation
never care which one they hold: `encode`, `encode_batch`, `decode`, `eot_id`, `vocab_size`, `name`.
`encode` treats `<|endoftext|>` in the text as ordinary characters; document boundaries are
added explicitly with `eot_id` by the caller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from gpt2forge.errors import UsageError
from gpt2forge.vocab import EOT_ID, EOT_TOKEN, TIKTOKEN_FILE, TIKTOKEN_SHA256, asset_dir, verify

# OpenAI's original GPT-2 pre-tokenizer regex (gpt-2/src/encoder.py), the same one Hugging Face's
# ByteLevel pre-tokenizer uses, so ids match `GPT2TokenizerFast` exactly.
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class GPT2Tokenizer:
    """GPT-2 byte-level BPE (50257 ids, `<|endoftext|>` = 50256) backed by a tiktoken Encoding."""

    name = "gpt2"

    def __init__(self, encoding: tiktoken.Encoding):
        self._enc = encoding
        self.eot_id: int = encoding.eot_token
        self.vocab_size: int = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; `<|endoftext|>` inside it is encoded as plain text."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 8) -> list[list[int]]:
        """`encode` for each text, in order, on `num_threads` threads (tiktoken releases the GIL)."""
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._enc.decode(list(ids))

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def load_tokenizer(path: Path | None = None) -> GPT2Tokenizer:
    """The GPT-2 tokenizer from `path` (default: `gpt2.tiktoken` in gpt2forge.vocab.asset_dir()).

    Raises UsageError if the file is missing or fails its sha256 check.
    """
    path = Path(path) if path is not None else asset_dir() / TIKTOKEN_FILE
    if not path.is_file():
        raise UsageError(f"GPT-2 vocabulary not found at {path}; run `make` "
                         f"(or `python -m gpt2forge.vocab`) to fetch it")
    if not verify(path):
        raise UsageError(f"GPT-2 vocabulary at {path} fails its sha256 check; delete it and run "
                         f"`make` (or `python -m gpt2forge.vocab`) to fetch it again")
    # tiktoken caches even local files (keyed by path) under its temp cache dir; passing the hash
    # makes it discard a stale cached copy instead of silently using it.
    ranks = load_tiktoken_bpe(str(path), expected_hash=TIKTOKEN_SHA256)
    encoding = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                                 special_tokens={EOT_TOKEN: EOT_ID})
    return GPT2Tokenizer(encoding)
