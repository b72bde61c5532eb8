"""Extracted Wikipedia -> the `.pkl` format (`wikipedia_preprocess.py`).

Output: `<output-file-path>/wikicorpus_en_one_article_per_line.pkl`, `pickle.dump` of a list of
documents, each a list of token ids ending with ONE end-of-document token (the reference wrote two,
a QUIRK), shuffled with `--seed` (the reference's shuffle was unseeded). Documents shorter than
`--min-length` tokens (EOS included) are dropped. The pickle holds the whole corpus, so this format
is for corpora that fit in memory; use preprocess_data.py (mmap) for larger ones.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2forge.core.atomic import fsync_path
from gpt2forge.core.errors import UsageError, collect
from gpt2forge.preprocess.bpe import train_bpe
from gpt2forge.preprocess.engine import Stats, TokenizerSpec, check_eod, chunk_records, encode_chunks
from gpt2forge.preprocess.sources import iter_articles, total_bytes

PKL_NAME = "wikicorpus_en_one_article_per_line.pkl"
BPE_DIR = "tokenizer"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/wikipedia_preprocess.py",
        description="Tokenize WikiExtractor output (or a one-article-per-line text file) into "
                    f"<output-file-path>/{PKL_NAME}: a list of token-id lists, one EOS per article.")
    parser.add_argument("--input-file-path", type=Path, required=True,
                        help="WikiExtractor output folder (AA/wiki_00, ...) or a text file with one "
                             "article per line")
    parser.add_argument("--output-file-path", type=Path, required=True, help="folder for the .pkl")
    parser.add_argument("--use-bpe", action="store_true",
                        help=f"train a byte-level BPE on the corpus first (saved to "
                             f"<output-file-path>/{BPE_DIR}/) and tokenize with it")
    parser.add_argument("--vocab-size", type=int, default=30522,
                        help="vocabulary of the --use-bpe tokenizer (default: 30522, the reference's)")
    parser.add_argument("--tokenizer-name-or-path", default=None,
                        help="tokenize with this local tokenizer folder instead of GPT-2's BPE")
    parser.add_argument("--min-length", type=int, default=10,
                        help="drop articles with fewer tokens, EOS included (default: 10)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the document shuffle")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (default: all cores)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild an existing .pkl")
    return parser


def _train(args: argparse.Namespace, out_dir: Path) -> TokenizerSpec:
    tok_dir = out_dir / BPE_DIR
    if (tok_dir / "tokenizer.json").is_file() and not args.overwrite:
        print(f"using the BPE tokenizer already trained in {tok_dir}")
        return TokenizerSpec(path=str(tok_dir))
    with tqdm(total=total_bytes(args.input_file_path), unit="B", unit_scale=True,
              desc="training BPE") as bar:
        texts = (text for text, _ in iter_articles(args.input_file_path, bar) if text.strip())
        tok = train_bpe(texts, args.vocab_size, name="wikipedia-bpe")
    tok.save(tok_dir)
    print(f"trained a byte-level BPE of {tok.vocab_size} ids; saved to {tok_dir}")
    return TokenizerSpec(path=str(tok_dir))


def _write_pickle(docs: list[list[int]], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(docs, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def wikipedia_preprocess(args: argparse.Namespace) -> Stats | None:
    """Run the tool for parsed `args`; returns the Stats (None if the .pkl already existed)."""
    collect([m for m in (
        None if args.input_file_path.exists() else f"--input-file-path {args.input_file_path}: "
                                                   f"no such file or folder",
        None if args.workers >= 1 else f"--workers must be at least 1, got {args.workers}",
        None if not (args.use_bpe and args.tokenizer_name_or_path) else
        "--use-bpe and --tokenizer-name-or-path exclude each other",
    ) if m])
    out = args.output_file_path / PKL_NAME
    if out.is_file() and not args.overwrite:
        print(f"{out} already exists (written atomically, so complete); nothing to do "
              f"(pass --overwrite to rebuild)")
        return None
    args.output_file_path.mkdir(parents=True, exist_ok=True)
    spec = _train(args, args.output_file_path) if args.use_bpe \
        else TokenizerSpec(path=args.tokenizer_name_or_path)
    tok = check_eod(spec, append_eod=True)
    stats, docs = Stats(), []
    with tqdm(total=total_bytes(args.input_file_path), unit="B", unit_scale=True,
              desc="tokenizing") as bar:
        chunks = chunk_records(iter_articles(args.input_file_path, bar))
        for enc in encode_chunks(chunks, spec, workers=args.workers, dtype=np.int32,
                                 append_eod=True):
            stats.add(enc)
            ends = np.cumsum(enc.sizes)
            docs.extend(doc.tolist() for doc in np.split(enc.tokens, ends[:-1]) if doc.size)
    kept = [d for d in docs if len(d) >= args.min_length]
    if not kept:
        raise UsageError(f"{args.input_file_path}: no article has --min-length {args.min_length} "
                         f"tokens; nothing to write")
    random.Random(args.seed).shuffle(kept)
    _write_pickle(kept, out)
    lengths = np.array([len(d) for d in kept])
    print(f"wrote {out}: {len(kept)} documents kept of {len(docs)} (tokenizer {tok.name}, "
          f"vocab {tok.vocab_size})")
    print(f"mean of text len:{lengths.mean():.1f},median of text len:{np.median(lengths):.0f},"
          f"max len:{lengths.max()}")
    print(stats.line())
    return stats
