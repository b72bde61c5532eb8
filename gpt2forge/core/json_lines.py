"""One line of loose JSON (one object per line), checked the same way by every reader of such files.

The readers (training's --dataset jsonl, the corpus-preparation tools, Megatron-style preprocessing,
the tokenizer trainer, the evaluation sets) each say where the line is and what to do about it;
what is wrong with the line itself is worded here, once:

    problem, obj = json_object(raw)            # "" and the dict, or what is wrong and None
    problem = problem or string_field(obj, "text")
    if problem:
        raise UsageError(f"{path}:{n}: {problem}; <the reader's fix>")
"""

from __future__ import annotations

import json


def json_object(raw: bytes | str) -> tuple[str, dict | None]:
    """(what is wrong with this line as one JSON object, or ""; the object when nothing is).

    Bytes must be UTF-8; a leading byte-order mark is ignored, as json.loads(bytes) ignores it.
    """
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"invalid UTF-8 at byte {exc.start} of the line", None
    try:
        obj = json.loads(raw.lstrip("\ufeff"))
    except ValueError as exc:
        return f"not valid JSON ({getattr(exc, 'msg', exc)} at column {getattr(exc, 'colno', '?')})", None
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object", None
    return "", obj


def string_field(obj: dict, key: str) -> str:
    """What is wrong with obj[key] as a text field (missing, or not a string), or ""."""
    if key not in obj:
        return f"no {key!r} field (fields: {', '.join(map(str, obj)) or 'none'})"
    if not isinstance(obj[key], str):
        return f"the {key!r} field is a JSON {type(obj[key]).__name__}, not a string"
    return ""
