"""What an indexed dataset was made from: `<prefix>.source.json` beside `<prefix>.bin/.idx`.

Megatron's format records neither its input nor its tokenizer, so `preprocess_data.py` writes them
beside the output: re-running it into the same prefix with another input is refused instead of
reporting the old output as complete, and `inspect_data.py` decodes with the tokenizer that made
the ids. Written after the `.bin/.idx` are complete; an output without it (made elsewhere, or
before this file existed) is read as "input and tokenizer unknown".

    {"input": {"path": "/abs/corpus.json", "size": 123, "mtime_ns": 1700000000000000000},
     "json_key": "text", "append_eod": true,
     "tokenizer": {"name": "gpt2", "vocab_size": 50257, "path": null, "vocab_file": null, "merge_file": null}}
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess.engine import TokenizerSpec

SUFFIX = ".source.json"


def recipe_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def input_identity(path: Path) -> dict:
    """The input file's absolute path, size (bytes) and modification time (ns): a changed file or
    another file gives another identity."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_recipe(prefix: str | Path, src: Path, json_key: str, append_eod: bool, spec: TokenizerSpec,
                 tok) -> None:
    """Record what made `prefix` (call after its .bin/.idx are complete)."""
    tokenizer = {"name": tok.name, "vocab_size": tok.vocab_size, **asdict(spec)}
    for key in ("path", "vocab_file", "merge_file"):  # absolute, so the record holds from any folder
        if tokenizer[key]:
            tokenizer[key] = str(Path(tokenizer[key]).resolve())
    recipe = {"input": input_identity(src), "json_key": json_key, "append_eod": append_eod, "tokenizer": tokenizer}
    recipe_path(prefix).write_text(json.dumps(recipe, indent=1) + "\n", encoding="utf-8")


def read_recipe(prefix: str | Path) -> dict | None:
    """The recorded recipe of `prefix`, or None when there is none (or it is unreadable)."""
    path = recipe_path(prefix)
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recipe if isinstance(recipe, dict) else None


def check_same_input(prefix: str | Path, src: Path) -> None:
    """UsageError (one line) when `prefix`'s recorded input is not `src` as it is now."""
    recipe = read_recipe(prefix)
    if recipe is None or not isinstance(recipe.get("input"), dict):
        return
    made_from, now = recipe["input"], input_identity(src)
    if made_from == now:
        return
    what = "another file" if made_from.get("path") != now["path"] else "the same path, since changed"
    raise UsageError(f"{prefix}.bin/.idx were made from {what} ({made_from.get('path')}, "
                     f"{made_from.get('size')} bytes), not --input {src} ({now['size']} bytes); pass another "
                     f"--output-prefix, or --overwrite to rebuild")


def recorded_tokenizer(prefix: str | Path) -> TokenizerSpec | None:
    """The TokenizerSpec that made `prefix`, or None when unrecorded."""
    recipe = read_recipe(prefix)
    tok = recipe.get("tokenizer") if recipe else None
    if not isinstance(tok, dict):
        return None
    return TokenizerSpec(path=tok.get("path"), vocab_file=tok.get("vocab_file"), merge_file=tok.get("merge_file"))
