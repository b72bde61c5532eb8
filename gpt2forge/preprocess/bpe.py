"""Training a byte-level BPE tokenizer (Hugging Face `tokenizers`) on any corpus, any language.

The result is GPT-2-shaped: byte-level (every string encodes, nothing is unknown), GPT-2's
pre-tokenizer regex without a prefix space, and `<|endoftext|>` as the end-of-document token
(id 0: trainers put special tokens first). It is saved as `<dir>/tokenizer.json`, which
`load_tokenizer(dir)`, `--tokenizer-name-or-path dir` and the trainer read.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from gpt2forge.core.errors import UsageError, collect
from gpt2forge.core.json_lines import json_object, string_field
from gpt2forge.text.tokenizer import HF_FILE, HFTokenizer, load_tokenizer
from gpt2forge.text.vocab import EOT_TOKEN


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              special_tokens: tuple[str, ...] = (EOT_TOKEN,), name: str = "bpe") -> HFTokenizer:
    """A byte-level BPE of `vocab_size` ids (specials included) trained on `texts` (streamed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise UsageError(f"--vocab-size must be at least {len(alphabet) + len(special_tokens)} "
                         f"(256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, name=name)


def iter_texts(paths: list[Path], json_key: str | None, bar: tqdm) -> Iterator[str]:
    """Texts of `paths`: JSON lines' `json_key` field for .json/.jsonl files, else text lines."""
    for path in paths:
        as_json = json_key is not None and path.suffix in (".json", ".jsonl")
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, start=1):
                bar.update(len(line))
                if not line.strip():
                    continue
                if not as_json:
                    yield line
                    continue
                problem, obj = json_object(line)
                if problem := problem or string_field(obj, json_key):
                    raise UsageError(f"{path}:{n}: {problem}; the input must be loose JSON, one object per "
                                     "line, its text in the --json-key field")
                yield obj[json_key]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/train_tokenizer.py",
        description="Train a byte-level BPE tokenizer (any language) and save it as a folder that "
                    "--tokenizer-name-or-path and the trainer accept.")
    parser.add_argument("--input", nargs="+", type=Path, required=True,
                        help="corpus files: loose JSON (.json/.jsonl, text in --json-key) or plain "
                             "text (one document or paragraph per line)")
    parser.add_argument("--json-key", default="text", help="text field of JSON inputs (default: text)")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="ids in the trained vocabulary, <|endoftext|> included")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="merges must occur at least this often (default: 2)")
    parser.add_argument("--output-dir", type=Path, required=True,
                        help="folder to write tokenizer.json into")
    parser.add_argument("--overwrite", action="store_true", help="retrain even if it exists")
    return parser


def train_tokenizer(args: argparse.Namespace) -> HFTokenizer | None:
    """Run the tool for parsed `args`; returns the tokenizer (None if it already existed)."""
    collect([f"--input {p}: no such file" for p in args.input if not p.is_file()]
            + ([f"--min-frequency must be at least 1, got {args.min_frequency}"]
               if args.min_frequency < 1 else []))
    out = args.output_dir / HF_FILE
    if out.is_file() and not args.overwrite:
        existing = load_tokenizer(args.output_dir)  # written atomically: present means complete
        print(f"{out} already exists ({existing.vocab_size} ids); nothing to do "
              f"(pass --overwrite to retrain)")
        return None
    start = time.perf_counter()
    total = sum(p.stat().st_size for p in args.input)
    with tqdm(total=total, unit="B", unit_scale=True, desc="training BPE") as bar:
        tok = train_bpe(iter_texts(args.input, args.json_key, bar), args.vocab_size,
                        args.min_frequency, name=args.output_dir.name)
    tok.save(args.output_dir)
    secs = time.perf_counter() - start
    print(f"wrote {out}: {tok.vocab_size} ids, end-of-document {EOT_TOKEN} = {tok.eot_id}")
    print(f"bytes: {total}, seconds: {secs:.2f}, MB/s: {total / secs / 1e6:.2f}")
    return tok
