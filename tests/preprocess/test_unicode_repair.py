"""fix_text's light lines: equal to ftfy.fix_text on every kind of line, and taken where they should be."""

import random

import pytest

ftfy = pytest.importorskip("ftfy")

from gpt2forge.preprocess import unicode_repair  # noqa: E402

# One piece per thing a fixer acts on, and the characters that can start a chain of fixes.
PIECES = [
    "plain words ", "x", " ", "\n", "\r\n", "\r", "\t", "\u2028", "&", "&amp;", "&#64257;", "&lt;b&gt;", "<p>",
    "it\u2019s", "\u2018q\u2019", "\u201cdq\u201d", "\u02bc", "\u2014", "\u2013", "\u2026", "\u00a0",
    "\ufb01ne", "\ufb02", "\u01c5", "\u0149", "\uff37\uff49\uff44\uff45", "\u3000", "\uff06amp;",
    "e\u0301", "A\u0303", "\u0303", "\u0301", "caf\u00e9", "\u00e9", "\u00fc", "\u00c3", "\u00c2", "\u00c2 ",
    "caf\u00c3\u00a9", "\u00e2\u20ac\u0153", "\u00e2\u20ac\x9d", "\u00c3\u00a2\u00e2\u201a\u00ac\u00e2\u201e\u00a2",
    "\u00d8\u00b1", "\u0432\u0402", "\u00c3 ", "a \u00c3 ", "\u20ac", "\u2122", "\u00b0", "\u00c9\u00b0",
    "\x80", "\x9d", "\x85", "\x07", "\x1b[31m", "\x7f", "\ufeff", "\ud83d", "\ud83d\ude00", "\U0001f600",
    "\u1100\u1161", "\u1100", "\u1161", "\u0b47\u0b3e", "\u0b3e", "\u4e2d\u6587", "\u0645\u0631\u062d\u0628\u0627",
    "\u00e0\u00b2", "\u221a\u00b1", "\u00b7", "\u00ad", "\u2502", "\u01c4", "\u212b", "\u2126", "\u00a9", "\u00c5",
]


def test_fix_text_equals_ftfy_on_random_mixtures():
    """ftfy's own fix_text is the oracle. Each guard of the light path was removed from the module
    once, on purpose: without `&`, the fullwidth forms, the control characters, the surrogates or
    the mojibake-regex test this failed; without both the combining-mark and the NFC guard it failed
    (`A` + combining tilde + space becomes `à` through ftfy's mojibake fix), each alone covers the
    other. The C1 and non-ASCII-ligature guards are covered by the regex test here."""
    rng = random.Random(0)
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
        assert unicode_repair.fix_text(text) == ftfy.fix_text(text), repr(text)


def test_the_mojibake_regex_is_understood():
    """With the pinned ftfy every alternative of its mojibake regex needs a known set of characters;
    otherwise every non-plain line would silently take ftfy's whole path."""
    tables = unicode_repair._tables()
    assert tables is not None
    heavy, required, _, _ = tables
    assert len(required) > 30 and all(sets for sets in required)
    assert {"&", "\x80", "\u0301", "\uff06"} <= heavy


@pytest.mark.parametrize("line, light", [
    ("It\u2019s fine \u2014 really\u2026\n", True),
    ("\u201cquoted\u201d words\n", True),
    ("Stra\u00dfe in M\u00fcnchen\n", True),
    ("\ufb01ne print\n", True),
    ("caf\u00c3\u00a9\n", False),
    ("AT&amp;T\n", False),
    ("e\u0301\n", False),
    ("\uff37ide\n", False),
])
def test_lines_take_the_path_their_characters_allow(monkeypatch, line, light):
    seen = []
    real = ftfy.fix_and_explain
    monkeypatch.setattr(unicode_repair.ftfy, "fix_and_explain",
                        lambda text, config: seen.append(config) or real(text, config))
    assert unicode_repair.fix_text(line) == ftfy.fix_text(line)
    assert (seen[0].fix_encoding is False) == light
