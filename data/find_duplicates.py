"""Near-duplicate pairs with MinHash LSH, the seed's command (Megatron-LM's tools/openwebtext):

    python data/find_duplicates.py --inputs clean.json url --output pairs.json
    python data/find_duplicates.py --inputs shard1.json url --save-fingerprints shard1.npz
    python data/find_duplicates.py --load-fingerprints shard1.npz --inputs shard2.json url --output pairs2.json

Logic: gpt2forge/preprocess/dedup.py (see --help for the flags and the memory bound).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/find_duplicates.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.openwebtext_dedup import find_duplicates, find_duplicates_parser  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    find_duplicates(find_duplicates_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
