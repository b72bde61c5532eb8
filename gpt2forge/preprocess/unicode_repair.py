"""ftfy's `fix_text`, equal to it character for character, without the passes that cannot change a line.

ftfy (6.x) fixes each line of a text apart, running a dozen fixers on it until nothing changes. On
web text most of its time goes to two of them that rarely fire: the mojibake test (`is_bad`, one
large regular expression over the line) and the `str.translate` passes (ligatures, character width,
control characters). `fix_text` here sorts each line into one of three kinds:

- plain: printable ASCII, tab and newline only, no `&`. No fixer changes such a line: kept as is.
- light: every character not plain is inert (below), the line is NFC-normalised, and the mojibake
  regex cannot match it. ftfy runs on it with the fixers that cannot fire turned off; those that
  can (curly quotes, line breaks, Latin ligatures, NFC) stay on.
- heavy: anything else (a character some switched-off fixer acts on, or one that can begin a chain
  of fixes: `&`, a C1 or other control character, a fullwidth form, a surrogate, a combining mark,
  a ligature that expands to non-ASCII, or characters that together can match the mojibake regex).
  ftfy runs on it exactly as `ftfy.fix_text` would.

Why a light line needs no more: what its fixers write is ASCII (straight quotes, `\\n`, the ASCII
ligature expansions) next to characters that do not combine with it, so the fixed line is light
again and the fixers switched off still have nothing to act on in ftfy's next round.

Whether the mojibake regex can match is decided from the regex itself (ftfy.badness.BADNESS_RE,
read with the `re` parser when first needed): each of its alternatives needs, in fixed positions,
one character from each of several sets of non-ASCII characters; a line that lacks every character
of one such set for every alternative cannot match. If ftfy's regex ever has an alternative that
needs no such set, no line is treated as light and every non-plain line runs the whole of ftfy.

tests/preprocess/test_unicode_repair.py checks the result against `ftfy.fix_text` on lines of every
kind and on random mixtures of the characters above; the speed is in docs/corpus.md.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from re import _constants as sre_constants
from re import _parser as sre_parser

import ftfy
from ftfy import badness, chardata

FTFY_CONFIG = ftfy.TextFixerConfig(explain=False)
NOT_PLAIN = re.compile(r"[^\t\n\x20-\x25\x27-\x7e]")
"""A character some ftfy fixer may change: anything but printable ASCII, tab and newline, and `&`
(the start of an HTML entity). A line without one is left as it is by every fixer."""
LIGHT_CONFIG = FTFY_CONFIG._replace(
    unescape_html=False, fix_encoding=False, fix_c1_controls=False, fix_character_width=False,
    fix_surrogates=False, remove_terminal_escapes=False, remove_control_chars=False)
"""The fixers a light line can need: curly quotes, line breaks, Latin ligatures, NFC."""
LIGHT_NO_LIGATURES = LIGHT_CONFIG._replace(fix_latin_ligatures=False)


def _char_set(op, av) -> frozenset[str] | None:
    """The characters one regex item matches, or None when it is not a plain literal or class."""
    if op is sre_constants.LITERAL:
        return frozenset(chr(av))
    if op is not sre_constants.IN:
        return None
    chars = set()
    for kind, arg in av:
        if kind is sre_constants.LITERAL:
            chars.add(chr(arg))
        elif kind is sre_constants.RANGE:
            chars.update(map(chr, range(arg[0], arg[1] + 1)))
        else:  # a negated class or a category: not a known set
            return None
    return frozenset(chars)


@functools.cache
def _tables() -> tuple[frozenset[str], list[list[frozenset[str]]], dict[str, list[int]], frozenset[str]] | None:
    """(heavy characters, each regex alternative's required non-ASCII sets, the alternatives keyed by
    each character of their smallest set, the ligatures) or None when the regex defeats the analysis."""
    (branch_op, (_, alternatives)), *rest = sre_parser.parse(badness.BADNESS_RE.pattern, badness.BADNESS_RE.flags).data
    if rest or branch_op is not sre_constants.BRANCH:
        return None
    required = []
    for alternative in alternatives:
        sets = [s for s in (_char_set(op, av) for op, av in alternative.data)
                if s is not None and all(ord(c) > 0x7F for c in s)]
        if not sets:
            return None
        required.append(sets)
    by_char: dict[str, list[int]] = {}
    for index, sets in enumerate(required):
        for char in min(sets, key=len):
            by_char.setdefault(char, []).append(index)
    heavy = {"&", *map(chr, chardata.WIDTH_MAP), *map(chr, chardata.CONTROL_CHARS), *map(chr, range(0x80, 0xA0)),
             *map(chr, range(0xD800, 0xE000))}
    heavy.update(chr(k) for k, v in chardata.LIGATURES.items() if not v.isascii() or "&" in v)
    heavy.update(c for c in map(chr, range(0x110000)) if unicodedata.combining(c))
    return frozenset(heavy), required, by_char, frozenset(map(chr, chardata.LIGATURES))


def _may_be_mojibake(chars: set[str], required, by_char) -> bool:
    """Whether BADNESS_RE could match a line holding these non-plain characters."""
    candidates = {i for c in chars for i in by_char.get(c, ())}
    return any(all(not s.isdisjoint(chars) for s in required[i]) for i in candidates)


def _fix_line(line: str, config: ftfy.TextFixerConfig, chars: set[str]) -> str:
    """ftfy on one line whose non-plain characters are `chars`."""
    tables = _tables()
    if tables is not None:
        heavy, required, by_char, ligatures = tables
        if (chars.isdisjoint(heavy) and not _may_be_mojibake(chars, required, by_char)
                and unicodedata.is_normalized("NFC", line)):
            return ftfy.fix_and_explain(line, LIGHT_NO_LIGATURES if chars.isdisjoint(ligatures) else LIGHT_CONFIG).text
    return ftfy.fix_and_explain(line, config).text


def fix_text(text: str) -> str:
    """`ftfy.fix_text(text)`, character for character. The loop over lines is ftfy's own (ftfy.fix_text,
    6.x), including its switch that stops unescaping HTML after the first `<`."""
    if not NOT_PLAIN.search(text):
        return text
    config, out, pos = FTFY_CONFIG, [], 0
    while pos < len(text):
        end = text.find("\n", pos) + 1 or len(text)
        end = min(end, pos + config.max_decode_length)
        segment = text[pos:end]
        if config.unescape_html == "auto" and "<" in segment:
            config = config._replace(unescape_html=False)
        chars = set(NOT_PLAIN.findall(segment))  # one scan: the test and the characters
        out.append(_fix_line(segment, config, chars) if chars else segment)
        pos = end
    return "".join(out)


__all__ = ["FTFY_CONFIG", "NOT_PLAIN", "fix_text"]
