"""Reading the evaluation sets: a WikiText-style text file, a loose-JSON corpus, a Megatron mmap
prefix, or LAMBADA's JSON lines. Every problem is a UsageError naming the file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError
from gpt2forge.core.json_lines import json_object, string_field
from gpt2forge.data.indexed import IndexedDataset
from gpt2forge.evaluation.detokenizer import get_detokenizer
from gpt2forge.evaluation.protocol import count_original_tokens


@dataclass
class TokenStream:
    """What a perplexity run scores, and how it was made (recorded in --output-json)."""

    tokens: np.ndarray  # 1-D int64
    num_original_tokens: int | None  # word-level count for the adjusted perplexity, when defined
    info: dict = field(default_factory=dict)


def read_text(path: Path, flag: str) -> str:
    if not path.is_file():
        raise UsageError(f"{flag} {path}: file not found")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8") from None


def read_json_lines(path: Path, key: str, flag: str) -> list[str]:
    """The `key` string of every non-empty line of a loose-JSON file."""
    texts = []
    for n, line in enumerate(read_text(path, flag).splitlines(), start=1):
        if not line.strip():
            continue
        problem, obj = json_object(line)
        if problem := problem or string_field(obj, key):
            raise UsageError(f"{flag} {path}: line {n}: {problem}; expected one JSON object "
                             "{\"" + key + "\": \"...\"} per line")
        texts.append(obj[key])
    if not texts:
        raise UsageError(f"{flag} {path}: no examples in the file")
    return texts


def data_format(path: str, requested: str) -> str:
    """--data-format auto: `<path>.bin`+`.idx` -> mmap; *.json / *.jsonl -> jsonl; anything else -> text."""
    if requested != "auto":
        return requested
    if Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file():
        return "mmap"
    if path.endswith((".json", ".jsonl")):
        return "jsonl"
    return "text"


def load_stream(path: str, fmt: str, detokenizer: str, encode: Callable[[str], list[int]], eot_id: int | None,
                vocab_size: int, json_key: str = "text", max_tokens: int | None = None) -> TokenStream:
    """The token stream of an evaluation corpus.

    text: the whole file, detokenized, encoded as one sequence; its word count (before
    detokenization) feeds the adjusted perplexity. jsonl: each document encoded and followed by
    `eot_id` when the tokenizer has one, as the training data is. mmap: the documents of a
    Megatron prefix, concatenated as stored. max_tokens: stop reading documents once this many
    tokens are in (jsonl, mmap).
    """
    flag = "--valid-data"
    if fmt == "mmap":
        ds = IndexedDataset(path, vocab_size)
        parts, total = [], 0
        for doc in ds.documents():
            parts.append(np.asarray(doc, dtype=np.int64))
            total += len(doc)
            if max_tokens is not None and total >= max_tokens:
                break
        info = {"path": str(path), "format": "mmap", "documents": len(parts),
                "sha256": file_sha256(Path(f"{path}.idx"), Path(f"{path}.bin"))}
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return TokenStream(tokens[:max_tokens] if max_tokens else tokens, None, info)
    p = Path(path)
    info = {"path": str(p), "format": fmt, "sha256": file_sha256(p) if p.is_file() else None,
            "detokenizer": detokenizer}
    detok = get_detokenizer(detokenizer)
    if fmt == "jsonl":
        parts, total = [], 0
        for text in read_json_lines(p, json_key, flag):
            ids = encode(detok(text)) + ([eot_id] if eot_id is not None else [])
            parts.append(np.asarray(ids, dtype=np.int64))
            total += len(ids)
            if max_tokens is not None and total >= max_tokens:
                break
        info.update(json_key=json_key, documents=len(parts))
        tokens = np.concatenate(parts)
        return TokenStream(tokens[:max_tokens] if max_tokens else tokens, None, info)
    text = read_text(p, flag)
    num_original = count_original_tokens(text)
    tokens = np.asarray(encode(detok(text)), dtype=np.int64)
    return TokenStream(tokens, num_original, info)
