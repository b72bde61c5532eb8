"""Build the default training corpus (stdlib documentation prose, no download) as a token pickle.

    python data/build_default_corpus.py --output build/stdlib_docs.pkl [--min-tokens 64] [--force]

Writes `pickle.dump(list[list[int]])`, one GPT-2-tokenized document per list, each ending with one
`<|endoftext|>` (50256); the `--dataset pickle` reader takes it. See gpt2forge/text/corpus.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Run as `python data/build_default_corpus.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import UsageError, cli_main  # noqa: E402
from gpt2forge.text.corpus import build_corpus, build_documents, save_corpus  # noqa: E402
from gpt2forge.text.tokenizer import load_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("build/stdlib_docs.pkl"),
                        help="pickle to write (default: build/stdlib_docs.pkl)")
    parser.add_argument("--min-tokens", type=int, default=64,
                        help="drop documents with fewer tokens than this, EOT included (default: 64)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if --output already exists")
    return parser.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.min_tokens < 1:
        raise UsageError(f"--min-tokens must be at least 1, got {args.min_tokens}")
    if args.output.exists() and not args.force:
        print(f"{args.output} exists; not rebuilding (pass --force to rebuild)")
        return 0
    tokenizer = load_tokenizer()
    start = time.perf_counter()
    corpus = build_corpus(tokenizer, min_tokens=args.min_tokens, documents=build_documents())
    seconds = time.perf_counter() - start
    save_corpus(corpus, args.output)
    tokens = sum(len(doc) for doc in corpus)
    print(f"wrote {args.output}")
    print(f"documents: {len(corpus)}, tokens: {tokens}, seconds: {seconds:.2f}, "
          f"tokens/s: {tokens / seconds:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
