"""Raw web text to training-ready data in one resumable command (see docs/corpus.md):

    python data/prepare_corpus.py --input raw.jsonl more.jsonl --output-dir out/ --lang en \
        --eval-files wiki.test.tokens lambada_test.jsonl \
        --output-prefix out/corpus --tokenizer-type GPT2BPETokenizer --workers 8

clean -> exact dedup -> near dedup -> decontaminate -> shuffle -> optional .bin/.idx, each stage's
file in --output-dir (atomic) and out/manifest.json (counts, removals by rule, examples, settings).
A stage whose output is complete for the same settings and inputs is skipped. Logic:
gpt2forge/preprocess/prepare.py.

On many machines (a job array: run/prepare_corpus_array.sbatch, run/prepare_corpus_array.pbs), the
same flags plus `--num-shards N`: task K adds `--shard K`, then one merge without it; the merge's
outputs are the one-machine run's byte for byte (gpt2forge/preprocess/sharded.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/prepare_corpus.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.prepare import build_parser, prepare_corpus  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    prepare_corpus(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
