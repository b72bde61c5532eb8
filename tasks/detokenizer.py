"""The reference's `tasks/detokenizer.py` names; the rules live in gpt2forge.evaluation.detokenizer."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.evaluation.detokenizer import (  # noqa: E402,F401
    DETOKENIZERS,
    detokenizer_name_for,
    lambada_detokenizer,
    ptb_detokenizer,
    wikitext_detokenizer,
)


def get_detokenizer(path):
    """The detokenizer for a data file, picked from its name (Megatron's signature; `*.raw` gets none)."""
    return DETOKENIZERS[detokenizer_name_for(path)]

__all__ = ["DETOKENIZERS", "detokenizer_name_for", "get_detokenizer", "lambada_detokenizer", "ptb_detokenizer",
           "wikitext_detokenizer"]
