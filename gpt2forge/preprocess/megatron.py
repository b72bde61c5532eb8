"""Loose JSON -> Megatron indexed dataset (`preprocess_data.py`), and merging datasets.

Flags follow Megatron-LM's `tools/preprocess_data.py` so its README commands run unchanged;
the output is `<output-prefix>_<json-key>_document.{bin,idx}`, as that tool writes it: one sequence
per document, or per sentence when the text is a list of sentences; an empty text keeps its empty
document entry. Beside it, `<prefix>.source.json` records the input and tokenizer (gpt2forge.preprocess.recipe).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpt2forge.core.errors import UsageError, collect
from gpt2forge.data.indexed import IndexedDataset, IndexedWriter, best_dtype, exists
from gpt2forge.preprocess.engine import Stats, TokenizerSpec, check_eod, chunk_records, encode_chunks
from gpt2forge.preprocess.recipe import check_same_input, recipe_path, write_recipe

TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF")


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags (shared by every tool that tokenizes)."""
    group = parser.add_argument_group("tokenizer (Megatron's flags)")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="GPT2BPETokenizer",
                       help="GPT2BPETokenizer (default; GPT-2's BPE, or --vocab-file/--merge-file) or "
                            "PretrainedFromHF (a local tokenizer folder, --tokenizer-name-or-path)")
    group.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None,
                       help="GPT-2-style vocab.json (with --merge-file); default: GPT-2's own")
    group.add_argument("--merge-file", default=None, help="GPT-2-style merges.txt (with --vocab-file)")
    group.add_argument("--tokenizer-name-or-path", default=None,
                       help="local tokenizer folder (tokenizer.json, or vocab.json + merges.txt), "
                            "e.g. one written by data/train_tokenizer.py; no downloads")


def tokenizer_spec(args: argparse.Namespace) -> TokenizerSpec:
    """The TokenizerSpec the tokenizer flags describe; UsageError on contradictory flags."""
    if args.tokenizer_type == "PretrainedFromHF":
        if not args.tokenizer_name_or_path:
            raise UsageError("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path DIR")
        if not Path(args.tokenizer_name_or_path).exists():
            raise UsageError(f"--tokenizer-name-or-path {args.tokenizer_name_or_path}: no such "
                             f"folder (hub names are not downloaded; save the tokenizer locally "
                             f"with save_pretrained and pass its folder)")
        return TokenizerSpec(path=args.tokenizer_name_or_path)
    if args.tokenizer_name_or_path:
        return TokenizerSpec(path=args.tokenizer_name_or_path)
    if args.vocab_file or args.merge_file:
        return TokenizerSpec(vocab_file=args.vocab_file, merge_file=args.merge_file)
    return TokenizerSpec()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/preprocess_data.py",
        description="Tokenize a loose-JSON corpus (one JSON object per line) into Megatron's "
                    "indexed dataset <output-prefix>_<json-key>_document.{bin,idx}.")
    parser.add_argument("--input", required=True, help="loose JSON file, one object per line")
    parser.add_argument("--json-key", "--json-keys", dest="json_key", default="text",
                        help="field holding the text (default: text)")
    parser.add_argument("--output-prefix", required=True,
                        help="output path prefix; _<json-key>_document.{bin,idx} is appended")
    parser.add_argument("--dataset-impl", choices=("mmap", "lazy", "cached"), default="mmap",
                        help="mmap (Megatron's default) is what is written; Megatron's old lazy and "
                             "cached formats are accepted and written as mmap, with a notice")
    add_tokenizer_args(parser)
    parser.add_argument("--append-eod", action="store_true",
                        help="append the end-of-document token to every document")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes, one core each (default: all cores)")
    parser.add_argument("--chunk-size", type=int, default=1024,
                        help="documents per task sent to a worker (also capped at 1 MiB of text)")
    parser.add_argument("--log-interval", type=int, default=100, help="accepted for Megatron "
                        "compatibility; progress is a tqdm bar")
    parser.add_argument("--overwrite", action="store_true",
                        help="rebuild even if a complete output already exists")
    return parser


def read_lines(path: Path, bar: tqdm) -> Iterator[tuple[bytes, int]]:
    """Every line of `path` (blank ones too, so record numbers are line numbers) with its byte
    count; advances `bar` by bytes read."""
    pending = 0
    with open(path, "rb") as f:
        for line in f:
            pending += len(line)
            if pending >= 1 << 22:
                bar.update(pending)
                pending = 0
            yield line, len(line)
    bar.update(pending)


def is_complete(prefix: str | Path) -> bool:
    """True if `<prefix>.bin/.idx` exist and pass the on-open checks."""
    if not exists(prefix):
        return False
    try:
        IndexedDataset(prefix).close()
    except UsageError:
        return False
    return True


def skip_existing(prefix: str | Path, overwrite: bool) -> bool:
    """Print why and return True when `prefix` is complete and not to be overwritten."""
    if overwrite or not is_complete(prefix):
        if exists(prefix) and not overwrite:
            print(f"{prefix}: existing files are incomplete or corrupt; rebuilding")
        return False
    print(f"{prefix}.bin/.idx already exist and are complete; nothing to do "
          f"(pass --overwrite to rebuild)")
    return True


def preprocess_data(args: argparse.Namespace) -> Stats | None:
    """Run the tool for parsed `args`; returns the Stats, or None if the output was complete."""
    src = Path(args.input)
    collect([m for m in (
        None if src.is_file() else f"--input {src}: no such file",
        None if args.workers >= 1 else f"--workers must be at least 1, got {args.workers}",
        None if args.chunk_size >= 1 else f"--chunk-size must be at least 1, got {args.chunk_size}",
    ) if m])
    if args.dataset_impl != "mmap":
        print(f"--dataset-impl {args.dataset_impl}: mmap replaces Megatron's lazy and cached formats (every "
              f"reader here takes mmap); writing mmap")
    prefix = f"{args.output_prefix}_{args.json_key}_document"
    if not args.overwrite and is_complete(prefix):
        check_same_input(prefix, src)  # stale output made from another input is not "complete"
    if skip_existing(prefix, args.overwrite):
        return None
    recipe_path(prefix).unlink(missing_ok=True)  # a rebuild's old record would describe other data
    spec = tokenizer_spec(args)
    tok = check_eod(spec, args.append_eod)
    dtype = best_dtype(tok.vocab_size)
    stats = Stats()
    with tqdm(total=src.stat().st_size, unit="B", unit_scale=True, desc="tokenizing") as bar, \
            IndexedWriter(prefix, dtype) as writer:
        chunks = chunk_records(read_lines(src, bar), chunk_docs=args.chunk_size)
        for enc in encode_chunks(chunks, spec, workers=args.workers, dtype=dtype,
                                 append_eod=args.append_eod, json_key=args.json_key,
                                 source=str(src)):
            writer.add_documents_flat(enc.tokens, enc.sizes, enc.doc_sequences)
            stats.add(enc)
            bar.set_postfix(docs=stats.documents, tokens=stats.tokens, refresh=False)
    write_recipe(prefix, src, args.json_key, args.append_eod, spec, tok)
    print(f"wrote {prefix}.bin/.idx ({dtype}, tokenizer {tok.name}, vocab {tok.vocab_size}) and {recipe_path(prefix)}")
    print(stats.line())
    return stats


def merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="data/merge_preprocessed_data.py",
        description="Concatenate several indexed datasets (same tokenizer) into one.")
    parser.add_argument("--datasets", nargs="+", required=True,
                        help="input prefixes (without .bin/.idx), in output order")
    parser.add_argument("--output-prefix", required=True, help="output prefix (without .bin/.idx)")
    parser.add_argument("--overwrite", action="store_true",
                        help="rebuild even if a complete output already exists")
    return parser


def merge(args: argparse.Namespace) -> Stats | None:
    """Merge `args.datasets` into `args.output_prefix`; None if the output was complete."""
    collect([f"--datasets {p}: {p}.bin/.idx not found" for p in args.datasets if not exists(p)])
    if skip_existing(args.output_prefix, args.overwrite):
        return None
    first = IndexedDataset(args.datasets[0])
    dtype = first.dtype
    first.close()
    stats = Stats()
    with IndexedWriter(args.output_prefix, dtype) as writer:
        for prefix in tqdm(args.datasets, desc="merging", unit="dataset"):
            before = writer.num_tokens
            writer.add_prefix(prefix)
            stats.tokens += writer.num_tokens - before
            stats.documents = writer.num_sequences
    print(f"wrote {args.output_prefix}.bin/.idx ({dtype}, {len(args.datasets)} datasets)")
    print(stats.line())
    return stats


def gather_documents(prefixes: list[Path], order: np.ndarray, output_prefix: Path, chunk: int = 8192) -> None:
    """Write the documents of the datasets at `prefixes` (numbered across them, in order) into one
    dataset at `output_prefix`, document i of it being document `order[i]`: a sharded run's
    tokenized parts in the one-machine shuffle's order (gpt2forge.preprocess.sharded). A
    document keeps its sequences (and an empty one its entry), so the result is byte for byte what
    tokenizing the documents in that order writes. Tokens are read with pread, not mapped, so the
    parts' pages do not count in this process's memory."""
    sets = [IndexedDataset(p) for p in prefixes]
    dtypes = {ds.dtype for ds in sets}
    if len(dtypes) != 1:
        raise UsageError(f"{', '.join(map(str, prefixes))}: token dtypes differ ({', '.join(map(str, dtypes))}); "
                         "tokenize every part with the same tokenizer")
    dtype = dtypes.pop()
    counts = [ds.num_documents for ds in sets]
    if len(order) != sum(counts):
        raise ValueError(f"order lists {len(order)} documents, the datasets hold {sum(counts)}")
    first = np.concatenate([[0], np.cumsum(counts)])
    with contextlib.ExitStack() as stack, IndexedWriter(output_prefix, dtype) as writer:
        fds = [stack.enter_context(open(f"{p}.bin", "rb")).fileno() for p in prefixes]
        for lo in range(0, len(order), chunk):
            tokens, sizes, per_doc = [], [], []
            block = order[lo:lo + chunk]
            for j, d in zip(block.tolist(), (np.searchsorted(first, block, side="right") - 1).tolist()):
                ds, k = sets[d], j - int(first[d])
                a, b = int(ds.doc_idx[k]), int(ds.doc_idx[k + 1])
                seqs = ds.sizes[a:b]
                if b > a:
                    raw = os.pread(fds[d], int(seqs.sum(dtype=np.int64)) * dtype.itemsize, int(ds.pointers[a]))
                    tokens.append(np.frombuffer(raw, dtype))
                sizes.append(seqs)
                per_doc.append(b - a)
            flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype)
            writer.add_documents_flat(flat, np.concatenate(sizes), per_doc)
    for ds in sets:
        ds.close()
