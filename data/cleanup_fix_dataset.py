"""Dataset-specific cleanup after cleanup_dataset.py (the seed's Megatron cleanup_fix_dataset.py).

    python data/cleanup_fix_dataset.py --input-files clean.json --tasks remove_512 --output-path fixed/
    python data/cleanup_fix_dataset.py --input-files a.json b.json --tasks remove_256_javascript \\
        general_cleaning --output-path fixed/

Writes `<output-path>/<name>_cleaned<ext>` (kept records) and `<name>_filtered<ext>` (removed
records, as read) per input, both atomically; the folder is created when missing. Megatron's
`--log-interval` is accepted (progress is a tqdm bar). Tasks, with the seed's meanings:
remove_512 (under 512 characters), remove_256_javascript (under 256 characters and mentioning
javascript), remove_512_non_english (under 512 characters and not --lang, default en), ftfy_fix_text
(ftfy's fix_text), general_cleaning (runs of spaces, and newlines after a word, become one space).
The seed stops at the first of ftfy_fix_text and general_cleaning (a QUIRK): here every task given
applies. Any cleaning flag of cleanup_dataset.py also works (e.g. --quality for Gopher's rules).
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

TASKS = ("remove_512", "remove_256_javascript", "remove_512_non_english", "ftfy_fix_text", "general_cleaning")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Dataset-specific filters on cleaned loose JSON (the seed's cleanup_fix_dataset).")
    p.add_argument("--input-files", nargs="+", required=True, help="loose-JSON files to fix")
    p.add_argument("--output-path", required=True,
                   help="folder for <name>_cleaned<ext> and <name>_filtered<ext> (created when missing)")
    p.add_argument("--tasks", nargs="*", default=[], choices=TASKS, help="the seed's named filters")
    p.add_argument("--log-interval", type=int, default=100,
                   help="accepted for Megatron's command line (its progress line every N documents); progress is a "
                        "tqdm bar here")
    add_arguments(p, min_tokens=0)
    p.set_defaults(lang=ANY_LANGUAGE, no_fix_text=True)
    return p


def apply_tasks(args: argparse.Namespace) -> None:
    """Turn the seed's task names into cleaning flags."""
    if "remove_512" in args.tasks:
        args.min_chars = max(args.min_chars, 512)
    if "remove_256_javascript" in args.tasks:
        args.javascript_under = max(args.javascript_under, 256)
    if "remove_512_non_english" in args.tasks:
        args.lang = "en" if args.lang == ANY_LANGUAGE else args.lang
        args.lang_under = args.lang_under or 512
    if "ftfy_fix_text" in args.tasks:
        args.no_fix_text = False
    if "general_cleaning" in args.tasks:
        args.collapse_whitespace = True


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_tasks(args)
    out_dir = Path(args.output_path)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--output-path {out_dir}: a file, not a folder; name a folder (created when missing)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.input_files:
        path = Path(name)
        run_clean(name, out_dir / f"{path.stem}_cleaned{path.suffix}", args,
                  filtered_path=out_dir / f"{path.stem}_filtered{path.suffix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
