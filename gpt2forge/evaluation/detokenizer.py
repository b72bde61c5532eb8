"""Detokenizers for the zero-shot tasks: Megatron-LM's `tasks/zeroshot_gpt/detokenizer.py`, rule for rule.

WikiText and PTB ship word-tokenized text (`guest @-@ starring`, `Teddy 's`); a byte-level BPE model
was trained on ordinary text, so the tokenization is undone before encoding. The perplexity is still
reported per *original* token (`protocol.count_original_tokens`), which makes it comparable across
tokenizers. LAMBADA's OpenAI version is already plain text: its detokenizer is the identity.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path


def ptb_detokenizer(text: str) -> str:
    text = text.replace(" '", "'")
    text = text.replace(" \n", "\n")
    text = text.replace("\n ", "\n")
    text = text.replace(" n't", "n't")
    text = text.replace(" N ", "1 ")
    text = text.replace("$ 1", "$1")
    return text.replace("# 1", "#1")


def wikitext_detokenizer(text: str) -> str:
    # contractions
    text = text.replace("s '", "s'")
    # Megatron's no-op-looking rule (its pattern matches a literal "/' 1/"); kept so ids match exactly.
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    # number separators
    text = text.replace(" @-@ ", "-")
    text = text.replace(" @,@ ", ",")
    text = text.replace(" @.@ ", ".")
    # punctuation
    text = text.replace(" : ", ": ")
    text = text.replace(" ; ", "; ")
    text = text.replace(" . ", ". ")
    text = text.replace(" ! ", "! ")
    text = text.replace(" ? ", "? ")
    text = text.replace(" , ", ", ")
    # spaces inside brackets and quotes
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    # miscellaneous
    text = text.replace("= = = =", "====")
    text = text.replace("= = =", "===")
    text = text.replace("= =", "==")
    text = text.replace(" " + chr(176) + " ", chr(176))
    text = text.replace(" \n", "\n")
    text = text.replace("\n ", "\n")
    text = text.replace(" N ", " 1 ")
    return text.replace(" 's", "'s")


def lambada_detokenizer(text: str) -> str:
    return text


def identity(text: str) -> str:
    return text


DETOKENIZERS: dict[str, Callable[[str], str]] = {
    "wikitext": wikitext_detokenizer,
    "ptb": ptb_detokenizer,
    "lambada": lambada_detokenizer,
    "none": identity,
}


WIKITEXT_MARKS = re.compile(r" @[-,.]@ |^ = [^=\n].* = $", re.MULTILINE)
"""WikiText's own tokenization: ` @-@ `, ` @,@ `, ` @.@ ` and ` = Heading = ` lines (raw and tokenized files)."""


def detokenizer_name_for(path: str | Path, sample: str | None = None) -> str:
    """`--detokenizer auto`: from the content when a sample of it is given, else from the file name.

    WikiText's marks in the sample -> wikitext (its raw files are word-tokenized too: ` @-@ `, ` , `);
    `ptb` in the name -> ptb; `lambada` -> lambada; `wiki` (no sample) -> wikitext. Anything else:
    none. Megatron picked the wikitext rules for any path containing `wiki`, and an earlier version
    of this function gave `*.raw` files none, which left WikiText's raw tokenization in place.
    """
    name = Path(path).name.lower()
    if sample is not None and WIKITEXT_MARKS.search(sample):
        return "wikitext"
    if "ptb" in name:
        return "ptb"
    if "lambada" in name:
        return "lambada"
    if "wiki" in name and sample is None:
        return "wikitext"
    return "none"


def sample_of(path: str | Path, size: int = 1 << 16) -> str | None:
    """The first `size` bytes of a text file, decoded leniently (None when `path` is not a file)."""
    p = Path(path)
    if not p.is_file():
        return None
    with p.open("rb") as f:
        return f.read(size).decode("utf-8", errors="replace")


def get_detokenizer(name: str) -> Callable[[str], str]:
    """The detokenizer called `name` (a key of DETOKENIZERS)."""
    return DETOKENIZERS[name]
