"""Drop URLs by domain and file extension before download: the seed's Megatron blacklist step.

    python data/blacklist_urls.py <folder or file of URL lists> clean_urls.txt

Reads every file in the folder (one URL per line), writes the URLs that pass, deduplicated, in
first-seen order (atomically), and prints what each rule removed. Rules (gpt2forge/preprocess/urls.py),
as the seed's tool: a blacklisted domain label (video, image, social, shopping and file hosts), a
blacklisted file extension (images, video, audio, archives, documents, executables), shorter than 8
characters, or not http(s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/blacklist_urls.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.atomic import write_atomic  # noqa: E402
from gpt2forge.core.errors import cli_main  # noqa: E402
from gpt2forge.preprocess.jsonl import already_complete  # noqa: E402
from gpt2forge.preprocess.urls import filter_urls  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Filter URL lists by domain and extension rules (seed's blacklist_urls).")
    p.add_argument("input", help="a folder of URL list files (one URL per line), or one such file")
    p.add_argument("output", help="the URLs that pass, one per line (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="redo the work even when the output exists")
    return p


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if already_complete(args.output, args.overwrite):
        return 0
    kept, removed = filter_urls(Path(args.input))
    write_atomic(args.output, "".join(u + "\n" for u in kept))
    rules = ", ".join(f"{r} {c}" for r, c in sorted(removed.items())) or "none"
    print(f"{args.output}: kept {len(kept)} of {len(kept) + sum(removed.values())} URLs; removed: {rules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
