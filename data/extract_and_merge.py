"""OpenWebText tarballs -> loose JSON, one {"text", "url"} object per file (see --help).

    python data/extract_and_merge.py <openwebtext_dir> [<extract_dir>] [--output openwebtext_raw.json]

Logic: gpt2forge/preprocess/sources.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python data/extract_and_merge.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.sources import extract_and_merge, openwebtext_parser  # noqa: E402


@cli_main
def main(argv: list[str] | None = None) -> int:
    extract_and_merge(openwebtext_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
