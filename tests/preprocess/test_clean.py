"""Cleaning: ftfy, language ID, min tokens, Gopher rules, bad input, atomic output, the seed's command."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2forge.core.errors import UsageError
from gpt2forge.preprocess import clean as clean_mod
from gpt2forge.preprocess.clean import CleanConfig, Cleaner, clean_file, quality_rule

ROOT = Path(__file__).resolve().parents[2]
EN = ("The council voted on Tuesday to extend the opening hours of the city library through the winter "
      "months, after residents asked for a warm and quiet place to study in the evenings. ") * 12
TR = ("Belediye meclisi salı günü, sakinlerin akşamları çalışmak için sıcak ve sessiz bir yer istemesi üzerine "
      "şehir kütüphanesinin çalışma saatlerini kış boyunca uzatma kararı aldı. ") * 12
PROSE = ("A quiet river runs past the old mill, where children once gathered to watch the wheel turn.\n"
         "Today the building holds a small museum about the history of the town and its bakers.\n"
         "Visitors can walk along the water and read the signs that explain how flour was made.\n"
         "In spring the meadow beside the mill fills with flowers, and families come to picnic there.\n"
         "The museum opens at ten every morning except Mondays, and entry is free for children.\n")


def write(path: Path, lines) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


FTFY_CASES = ["plain ASCII line\nand another\n", "The cafÃ© was â€œgreatâ€\x9d.\nNext line, plain.\n",
              "AT&amp;T &lt;b&gt; in text\n", "<p>a tag first</p>\nthen &amp; stays\n", "&amp; before\n<b>tag</b>\n",
              "CR\r\nLF and a lone\rCR", "bell\x07 tab\t form\x0c feed\x7f del\x1b[31m red",
              "\ufb01ne ｗｉｄｅ “q” — dash", "no newline at the end", "", "\n\n\n", "Ã©\n", "ü" * 3 + "\n" + "x" * 50]


def test_fix_text_equals_ftfy_on_every_kind_of_line():
    """The plain-line shortcut changes no output: ftfy's own fix_text is the oracle, on hand-made
    lines of every kind its fixers touch and on random mixtures of them (a shortcut taken on a line
    that a fixer changes, or a lost HTML switch, fails)."""
    ftfy = pytest.importorskip("ftfy")
    rng = random.Random(0)
    pieces = [line for case in FTFY_CASES for line in case.splitlines(keepends=True)] + ["&", "<", "\r", "Ã", "\x80"]
    mixtures = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(400)]
    for text in FTFY_CASES + mixtures:
        assert clean_mod.fix_text(text) == ftfy.fix_text(text), repr(text)


def test_ftfy_repairs_mojibake():
    kept, rule = Cleaner(CleanConfig(lang="any", min_tokens=0)).clean("The cafÃ© was â€œgreatâ€\x9d.")
    # ftfy's default also straightens curly quotes (uncurl_quotes), as the seed's fix_text did.
    assert (kept, rule) == ('The café was "great".', "")


@pytest.mark.parametrize("lang, keep", [("en", EN), ("tr", TR)])
def test_language_filter_keeps_the_chosen_language(tmp_path, lang, keep):
    src = write(tmp_path / "raw.json", [{"text": EN, "url": "en"}, {"text": TR, "url": "tr"}])
    summary = clean_file(src, tmp_path / "out.json", CleanConfig(lang=lang), workers=0)
    out = [json.loads(ln) for ln in (tmp_path / "out.json").read_text().splitlines()]
    assert [o["text"] for o in out] == [keep] and summary.removed == {"lang": 1}


def test_unknown_language_code_is_a_usage_error():
    with pytest.raises(UsageError, match="--lang xx"):
        Cleaner(CleanConfig(lang="xx"))


def test_min_tokens_counts_gpt2_tokens():
    cleaner = Cleaner(CleanConfig(lang="any", min_tokens=20))
    assert cleaner.clean("just a few words here") == (None, "min_tokens")
    assert cleaner.clean(" ".join(["word"] * 30))[1] == ""


@pytest.mark.parametrize("rule, text", [
    ("word_count", "Too short to be a document."),
    ("mean_word_length", "a b c d e f g h i j " * 10),
    ("symbol_ratio", "#tag #news #today words here " * 20),
    ("bullet_lines", "\n".join(f"- item number {i} in the list of things we sell" for i in range(20))),
    ("ellipsis_lines", "\n".join(f"and then the story went on and on for a long while after that night {i}..."
                                  for i in range(20))),
    ("duplicate_lines", "\n".join(["Click here to subscribe to our newsletter today."] * 15 + [PROSE])),
])
def test_each_quality_rule_fires_on_its_document_and_not_on_prose(rule, text):
    cfg = CleanConfig(quality=True)
    assert quality_rule(text, cfg) == rule
    assert quality_rule(PROSE, cfg) == ""


@pytest.mark.parametrize("line, what", [
    ('{"text": "ok"', "not valid JSON"),
    ('{"body": "no text key"}', "no 'text' field"),
    (b'{"text": "bad \xff byte"}', "invalid UTF-8"),
])
def test_bad_line_stops_with_file_and_line_or_is_skipped(tmp_path, line, what):
    src = tmp_path / "raw.json"
    raw = line if isinstance(line, bytes) else line.encode()
    src.write_bytes(json.dumps({"text": EN}).encode() + b"\n" + raw + b"\n")
    with pytest.raises(UsageError, match=rf"raw.json:2: {what}"):
        clean_file(src, tmp_path / "out.json", CleanConfig(), workers=0)
    assert not (tmp_path / "out.json").exists()
    summary = clean_file(src, tmp_path / "out.json", CleanConfig(), workers=0, skip_bad_lines=True)
    assert summary.bad_lines == 1 and summary.docs_out == 1


def test_empty_file_is_an_error(tmp_path):
    (tmp_path / "raw.json").write_text("")
    with pytest.raises(UsageError, match="empty"):
        clean_file(tmp_path / "raw.json", tmp_path / "out.json", CleanConfig(), workers=0)


def test_interrupted_run_leaves_no_output(tmp_path, monkeypatch):
    src = write(tmp_path / "raw.json", [{"text": EN}] * 3)

    def boom(self, text):
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(clean_mod.Cleaner, "clean", boom)
    with pytest.raises(RuntimeError):
        clean_file(src, tmp_path / "out.json", CleanConfig(), workers=0)
    assert list(tmp_path.iterdir()) == [src]


def run_script(*args):
    return subprocess.run([sys.executable, str(ROOT / "data" / "cleanup_dataset.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_seed_command_runs_as_written_with_workers_and_skips_when_done(tmp_path):
    src = write(tmp_path / "raw.json", [{"text": EN, "url": "a"}, {"text": TR, "url": "b"}, {"text": "hi", "url": "c"}])
    out = tmp_path / "owt" / "clean.json"  # its folder is created, as write_atomic's are
    proc = run_script(src, out, "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(ln)["url"] for ln in out.read_text().splitlines()] == ["a"]
    assert "kept 1 of 3" in proc.stdout
    assert "skipping" in run_script(src, out).stdout


def test_seed_command_bad_input_is_one_line_exit_2(tmp_path):
    src = tmp_path / "raw.json"
    src.write_text('{"text": "fine"}\nnot json\n')
    proc = run_script(src, tmp_path / "clean.json")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "raw.json:2:" in proc.stderr
    assert not (tmp_path / "clean.json").exists()


def test_seed_fix_and_blacklist_commands(tmp_path):
    # As docs/corpus.md writes it: `--output-path fixed/` is created (with its parents); Megatron's
    # --log-interval is taken (progress is a tqdm bar here).
    src = write(tmp_path / "clean.json", [{"text": EN, "url": "a"}, {"text": "tiny", "url": "b"}])
    fix = [sys.executable, str(ROOT / "data" / "cleanup_fix_dataset.py"), "--input-files", str(src),
           "--tasks", "remove_512", "--output-path", f"{tmp_path / 'out' / 'fixed'}/", "--log-interval", "100"]
    proc = subprocess.run(fix, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(ln)["url"] for ln in (tmp_path / "out" / "fixed" / "clean_cleaned.json").open()] == ["a"]
    proc = subprocess.run([*fix[:-4], "--output-path", str(src)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == f"error: --output-path {src}: a file, not a folder; name a " \
                                                   "folder (created when missing)\n"
    (tmp_path / "urls").mkdir()
    (tmp_path / "urls" / "a.txt").write_text("https://example.com/story\nhttps://www.youtube.com/watch?v=1\n"
                                             "http://example.org/cat.jpg\nhttps://example.com/story\n")
    bl = [sys.executable, str(ROOT / "data" / "blacklist_urls.py"), str(tmp_path / "urls"), str(tmp_path / "ok.txt")]
    proc = subprocess.run(bl, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and (tmp_path / "ok.txt").read_text() == "https://example.com/story\n"
    assert "domain 1, duplicate 1, extension 1" in proc.stdout


def test_seed_fix_tasks_write_cleaned_and_filtered(tmp_path):
    short_js = "Please enable JavaScript to view this page."
    long_js = "JavaScript tutorial. " * 20  # over 256 characters: kept by remove_256_javascript
    spaced = "one  two   three\nfour"
    src = write(tmp_path / "c.jsonl", [{"text": short_js, "url": "js"}, {"text": long_js, "url": "long"},
                                       {"text": spaced, "url": "ws"}])
    (tmp_path / "fixed").mkdir()
    fix = [sys.executable, str(ROOT / "data" / "cleanup_fix_dataset.py"), "--input-files", str(src),
           "--tasks", "remove_256_javascript", "general_cleaning", "--output-path", str(tmp_path / "fixed")]
    proc = subprocess.run(fix, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    kept = [json.loads(ln) for ln in (tmp_path / "fixed" / "c_cleaned.jsonl").open()]
    removed = [json.loads(ln) for ln in (tmp_path / "fixed" / "c_filtered.jsonl").open()]
    assert [r["url"] for r in kept] == ["long", "ws"] and removed == [{"text": short_js, "url": "js"}]
    assert kept[1]["text"] == "one two three four"  # the seed's general_cleaning regex
    assert "javascript 1" in proc.stdout


@pytest.mark.parametrize("url, rule", [
    ("a.b/c", "too_short"), ("ftp://example.com/file", "not_http"),
    ("https://www.youtube.com/watch?v=1", "domain"),
    ("https://example.org/Cat.JPG", "extension"), ("https://example.org/story.html", ""),
])
def test_url_rules(url, rule):
    from gpt2forge.preprocess.urls import rule as url_rule
    assert url_rule(url) == rule


def test_map_texts_same_order_and_results_for_any_workers():
    docs = [type("Doc", (), {"text": f"document {i}"})() for i in range(600)]  # more than two chunks
    one = [(d.text, r) for d, r in clean_mod.map_texts(len, docs, 0)]
    assert one == [(d.text, r) for d, r in clean_mod.map_texts(len, docs, 2)] == [(d.text, len(d.text)) for d in docs]
