"""Remove training documents sharing a 13-word n-gram with evaluation sets (GPT-3 decontamination).

    python data/filter_ngrams.py --input clean.json --output decontaminated.json \
        --eval $(gpt2forge-fetch-data path lambada) ~/.cache/gpt2forge/eval-data/wikitext/wiki.test.raw
    python data/filter_ngrams.py --input clean.json --output out.json --eval lambada.jsonl --mode cut

Logic: gpt2forge/preprocess/decontaminate.py; guide: docs/corpus.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/filter_ngrams.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.decontaminate import DecontaminateConfig, decontaminate_file  # noqa: E402
from gpt2forge.preprocess.jsonl import already_complete  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    d = DecontaminateConfig()
    p = argparse.ArgumentParser(description="Drop (or cut) training text that shares an n-gram with evaluation "
                                            "sets. Memory: 8 bytes per evaluation n-gram plus a few chunks of text.")
    p.add_argument("--input", required=True, help="training loose JSON")
    p.add_argument("--output", required=True, help="decontaminated loose JSON (written atomically)")
    p.add_argument("--eval", nargs="+", required=True,
                   help="evaluation files: .json/.jsonl (e.g. LAMBADA) or plain text (e.g. WikiText wiki.test.raw)")
    p.add_argument("--ngram", type=int, default=d.ngram, help="words per n-gram")
    p.add_argument("--mode", choices=("drop", "cut"), default=d.mode,
                   help="drop overlapping documents, or cut the overlapping spans out and split there")
    p.add_argument("--margin", type=int, default=d.margin, help="cut mode: characters removed around a span")
    p.add_argument("--min-piece-chars", type=int, default=d.min_piece_chars,
                   help="cut mode: drop pieces under this many characters")
    p.add_argument("--max-splits", type=int, default=d.max_splits,
                   help="cut mode: drop a document cut more than this many times")
    p.add_argument("--workers", type=int, default=1, help="worker processes (0: in the main process)")
    p.add_argument("--text-key", default="text", help="JSON field holding the text (training and .jsonl eval files)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed training lines")
    p.add_argument("--overwrite", action="store_true", help="redo the work even when the output exists")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if already_complete(args.output, args.overwrite):
        return 0
    cfg = DecontaminateConfig(ngram=args.ngram, mode=args.mode, margin=args.margin,
                              min_piece_chars=args.min_piece_chars, max_splits=args.max_splits)
    summary = decontaminate_file(args.input, args.output, args.eval, cfg, workers=args.workers,
                                 text_key=args.text_key, eval_text_key=args.text_key,
                                 skip_bad_lines=args.skip_bad_lines)
    print(summary.line(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
