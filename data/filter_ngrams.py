"""Remove training documents sharing a 13-word n-gram with evaluation sets (GPT-3 decontamination).

    python data/filter_ngrams.py --input clean.json --output decontaminated.json \
        --eval $(gpt2forge-fetch-data path lambada) ~/.cache/gpt2forge/eval-data/wikitext/wiki.test.raw
    python data/filter_ngrams.py --input clean.json --output out.json --eval lambada.jsonl --mode cut

Megatron-LM's tools/openwebtext flags work too, with their meaning (cut mode, 13-grams, whole evaluation
texts of 8 to 12 words, n-grams held by 10 or more training documents kept):

    python data/filter_ngrams.py --tasks lambada --lambada-path lambada_test.jsonl \
        --dedup-dataset clean.json text --output decontaminated.json

Logic: gpt2forge/preprocess/decontaminate.py; guide: docs/corpus.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/filter_ngrams.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import UsageError, cli_main  # noqa: E402
from gpt2forge.preprocess.decontaminate import DecontaminateConfig, decontaminate_file  # noqa: E402
from gpt2forge.preprocess.jsonl import already_complete  # noqa: E402

MEGATRON_TASKS = ("lambada",)
"""Megatron's --tasks read here: LAMBADA from --lambada-path (the others came from the Hugging Face hub)."""


def build_parser() -> argparse.ArgumentParser:
    d = DecontaminateConfig()
    p = argparse.ArgumentParser(description="Drop (or cut) training text that shares an n-gram with evaluation "
                                            "sets. Memory: 8 bytes per evaluation n-gram plus a few chunks of text.")
    p.add_argument("--input", help="training loose JSON (or Megatron's --dedup-dataset FILE KEY)")
    p.add_argument("--output", required=True, help="decontaminated loose JSON (written atomically)")
    p.add_argument("--eval", nargs="+", default=[],
                   help="evaluation files: .json/.jsonl (e.g. LAMBADA) or plain text (e.g. WikiText wiki.test.raw)")
    p.add_argument("--ngram", "--max-ngram-size", type=int, default=None,
                   help=f"words per n-gram (default {d.ngram}; --max-ngram-size: Megatron's name)")
    p.add_argument("--mode", choices=("drop", "cut"), default=None,
                   help="drop overlapping documents, or cut the overlapping spans out and split there (default: "
                        "drop; cut with Megatron's flags, its only behaviour)")
    p.add_argument("--margin", "--remove-char-each-side", type=int, default=d.margin,
                   help="cut mode: characters removed around a span")
    p.add_argument("--min-piece-chars", "--filter-text-char-len", type=int, default=d.min_piece_chars,
                   help="cut mode: drop pieces under this many characters")
    p.add_argument("--max-splits", "--splits-count", type=int, default=d.max_splits,
                   help="cut mode: drop a document cut more than this many times")
    p.add_argument("--workers", "--num-threads", type=int, default=1,
                   help="worker processes (0: in the main process; default 1, Megatron's --num-threads 40)")
    g = p.add_argument_group("Megatron-LM's tools/openwebtext/filter_ngrams.py")
    g.add_argument("--tasks", nargs="*", default=None,
                   help="evaluation tasks: lambada (read from --lambada-path); Megatron's hub tasks (squad, ...) "
                        "are not downloaded: pass their files with --eval")
    g.add_argument("--lambada-path", help="the LAMBADA JSON lines of --tasks lambada")
    g.add_argument("--dedup-dataset", nargs=2, metavar=("FILE", "KEY"),
                   help="the training loose JSON and its text field (= --input FILE --text-key KEY)")
    g.add_argument("--min-ngram-size", type=int, default=None,
                   help="evaluation texts shorter than the n-gram but of at least this many words count whole "
                        "(default: 8 with Megatron's flags, else off)")
    g.add_argument("--key-threshold", type=int, default=None,
                   help="only n-grams found in fewer than this many training documents are removed (a first pass "
                        "counts them; default: 10 with Megatron's flags, else off)")
    g.add_argument("--save-dictionary", help="write the n-gram tables (.npz of hashes) after the counting pass")
    g.add_argument("--load-dictionary", help="read tables from --save-dictionary instead of the evaluation files")
    p.add_argument("--text-key", default="text", help="JSON field holding the text (training and .jsonl eval files)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed training lines")
    p.add_argument("--overwrite", action="store_true", help="redo the work even when the output exists")
    return p


def megatron_flags(args: argparse.Namespace) -> bool:
    """Fold Megatron's --tasks/--lambada-path/--dedup-dataset into --eval/--input/--text-key; whether they
    were used (Megatron's defaults then apply). Raises UsageError naming the flag and the fix."""
    if args.dedup_dataset is not None:
        if args.input is not None:
            raise UsageError("--input and --dedup-dataset both name the training file; give one")
        args.input, args.text_key = args.dedup_dataset
    for task in args.tasks or ():
        if task not in MEGATRON_TASKS:
            raise UsageError(f"--tasks {task}: Megatron read it from the Hugging Face hub and nothing is downloaded "
                             "here; save its texts as JSON lines ({\"text\": ...}) and pass the file with --eval")
    if args.tasks is not None and "lambada" in args.tasks:
        if args.lambada_path is None:
            raise UsageError("--tasks lambada needs --lambada-path FILE (LAMBADA's JSON lines)")
        args.eval = [*args.eval, args.lambada_path]
    elif args.lambada_path is not None:
        raise UsageError("--lambada-path is read with --tasks lambada; add it")
    if args.input is None:
        raise UsageError("the training file is missing: --input FILE (or --dedup-dataset FILE KEY)")
    if not args.eval and args.load_dictionary is None:
        raise UsageError("no evaluation set: --eval FILES (or --tasks lambada --lambada-path FILE)")
    return args.dedup_dataset is not None or args.tasks is not None


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    megatron = megatron_flags(args)
    if already_complete(args.output, args.overwrite):
        return 0
    d = DecontaminateConfig()
    ngram = d.ngram if args.ngram is None else args.ngram
    if megatron:  # Megatron's defaults: its only mode, whole short texts of 8+ words, 10 documents
        args.mode = args.mode or "cut"
        args.min_ngram_size = min(8, ngram) if args.min_ngram_size is None else args.min_ngram_size
        args.key_threshold = 10 if args.key_threshold is None else args.key_threshold
    cfg = DecontaminateConfig(ngram=ngram, mode=args.mode or d.mode, margin=args.margin,
                              min_piece_chars=args.min_piece_chars, max_splits=args.max_splits,
                              min_ngram=args.min_ngram_size, key_threshold=args.key_threshold)
    summary = decontaminate_file(args.input, args.output, args.eval, cfg, workers=args.workers,
                                 text_key=args.text_key, eval_text_key="text" if megatron else args.text_key,
                                 skip_bad_lines=args.skip_bad_lines, load_path=args.load_dictionary,
                                 save_path=args.save_dictionary)
    print(summary.line(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
