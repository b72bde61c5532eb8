"""Cleaning throughput (documents/s per core) with language ID on: ours vs the seed's cleanup.

    .venv/bin/python benchmarks/clean_throughput.py               # 5,000 documents
    .venv/bin/python benchmarks/clean_throughput.py --docs 200    # quick variant

Same generated input for both (`corpus`: ~3 KB English documents of common words, with 10%
Turkish and 10% too short), each arm in this process, on one core (rate from CPU time):
- ours: `clean_file` with `workers=0`, the path `data/cleanup_dataset.py` runs (ftfy, min 128
  GPT-2 tokens for texts under 1,024 characters, lid.176 language ID, atomic output);
- the seed's (Megatron's openwebtext/cleanup_dataset.py, re-implemented minimally here): ftfy
  `fix_text`, `langdetect.detect(text) == "en"`, then min 128 GPT-2 tokens (our tokenizer, so only
  the language ID differs). Skipped with the reason when langdetect is not installed.
Both arms must keep the same documents (printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpt2forge.preprocess.clean import CleanConfig, clean_file  # noqa: E402
from gpt2forge.text import vocab  # noqa: E402
from gpt2forge.text.tokenizer import load_tokenizer  # noqa: E402

TR = ("Belediye meclisi salı günü, sakinlerin akşamları çalışmak için sıcak ve sessiz bir yer istemesi üzerine "
      "şehir kütüphanesinin çalışma saatlerini kış boyunca uzatma kararı aldı. ")
MIN_TOKENS = 128


def corpus(n: int, seed: int = 0) -> list[dict]:
    """`n` loose-JSON records: 80% English (~3 KB), 10% Turkish (~2 KB), 10% under 128 tokens."""
    table = json.loads((vocab.asset_dir() / vocab.VOCAB_FILE).read_text(encoding="utf-8"))
    words = [w[1:] for w, _ in sorted(table.items(), key=lambda kv: kv[1])
             if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower() and len(w) > 3][:3000]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.1:
            text = TR * 12
        elif kind < 0.2:
            text = " ".join(rng.choice(words, 20)).capitalize() + "."
        else:
            text = " ".join(" ".join(rng.choice(words, int(rng.integers(8, 16)))).capitalize() + "." for _ in range(40))
        out.append({"text": text, "url": f"doc{i}"})
    return out


def ours(src: Path, dst: Path) -> list[str]:
    clean_file(src, dst, CleanConfig(), workers=0)
    return [json.loads(line)["url"] for line in dst.read_text(encoding="utf-8").splitlines()]


def seed(src: Path, dst: Path) -> list[str]:
    import ftfy
    import langdetect
    langdetect.DetectorFactory.seed = 0
    tokenizer, kept = load_tokenizer(), []
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for line in f:
            record = json.loads(line)
            text = ftfy.fix_text(record["text"])
            try:
                if langdetect.detect(text) != "en":
                    continue
            except langdetect.LangDetectException:  # the seed dropped documents langdetect rejects
                continue
            if len(text) < 8 * MIN_TOKENS and len(tokenizer.encode(text)) < MIN_TOKENS:
                continue
            out.write(json.dumps(record | {"text": text}, ensure_ascii=False) + "\n")
            kept.append(record["url"])
    return kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=5000, help="documents in the generated input")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "raw.jsonl"
        src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in corpus(args.docs)), encoding="utf-8")
        print(f"input: {args.docs} documents, {src.stat().st_size / 1e6:.1f} MB")
        print("| arm | docs/s per core | CPU s | kept |")
        print("|---|---|---|---|")
        results = {}
        for name, arm, needs in (("ours (cleanup_dataset.py, lid.176)", ours, None),
                                 ("seed (ftfy + langdetect + 128 tokens)", seed, "langdetect")):
            if needs:
                try:
                    __import__(needs)
                except ImportError:
                    print(f"| {name} | skipped: {needs} is not installed; pip install {needs} | | |")
                    continue
            start = time.process_time()
            results[name] = arm(src, Path(tmp) / "out.jsonl")
            cpu = time.process_time() - start
            print(f"| {name} | {args.docs / cpu:,.0f} | {cpu:.2f} | {len(results[name])} |")
        if len(results) == 2:
            a, b = results.values()
            print(f"same documents kept: {a == b} ({len(set(a) ^ set(b))} differ)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
