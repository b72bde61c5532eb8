"""Dataset-specific cleanup after cleanup_dataset.py (the seed's Megatron cleanup_fix_dataset.py).

    python data/cleanup_fix_dataset.py --input-files clean.json --tasks remove_512 --output-path fixed/
    python data/cleanup_fix_dataset.py --input-files a.json b.json --min-chars 512 --quality --output-path fixed/

Writes `<output-path>/<input name>_cleaned.json` per input (atomically). Tasks, as the seed's:
remove_512 (under 512 characters), remove_512_non_english (keep --lang, default en), ftfy_fix_text,
general_cleaning (the Gopher quality rules); any cleaning flag of cleanup_dataset.py also works.
Logic: gpt2forge/preprocess/clean.py; guide: docs/corpus.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as `python data/cleanup_fix_dataset.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.errors import UsageError, cli_main  # noqa: E402
from gpt2forge.preprocess.clean import ANY_LANGUAGE, add_arguments, run_clean  # noqa: E402

TASKS = ("remove_512", "remove_512_non_english", "ftfy_fix_text", "general_cleaning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Dataset-specific filters on cleaned loose JSON (the seed's cleanup_fix_dataset).")
    p.add_argument("--input-files", nargs="+", required=True, help="loose-JSON files to fix")
    p.add_argument("--output-path", required=True, help="folder for <name>_cleaned.json")
    p.add_argument("--tasks", nargs="*", default=[], choices=TASKS, help="the seed's named filters")
    add_arguments(p, min_tokens=0)
    p.set_defaults(lang=ANY_LANGUAGE, no_fix_text=True)
    return p


def apply_tasks(args: argparse.Namespace) -> None:
    """Turn the seed's task names into cleaning flags."""
    if "remove_512" in args.tasks:
        args.min_chars = max(args.min_chars, 512)
    if "remove_512_non_english" in args.tasks and args.lang == ANY_LANGUAGE:
        args.lang = "en"
    if "ftfy_fix_text" in args.tasks:
        args.no_fix_text = False
    if "general_cleaning" in args.tasks:
        args.quality = True


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_tasks(args)
    out_dir = Path(args.output_path)
    if not out_dir.is_dir():
        raise UsageError(f"--output-path {out_dir}: not a folder; create it first")
    for name in args.input_files:
        run_clean(name, out_dir / f"{Path(name).stem}_cleaned.json", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
