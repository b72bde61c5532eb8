"""The code's comments and docstrings carry no timing logs: a measured time, bandwidth, FLOP rate or
speed-up lives in docs/benchmarks.md (its "Design measurements" names the choice and the file), where
it is dated by its machine and its command; the source says what the code does and why, in words
(STYLE.md, "Docs describe the present"). Checked: the package, custom_ops and the top-level scripts;
benchmarks/ and tests/ measure and state targets, so they may name figures."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("gpt2forge/**/*.py", "custom_ops/*.cpp", "custom_ops/*.h", "custom_ops/*.cu", "*.py", "tasks/*.py",
           "data/*.py")
NUMBER = r"~?\d(?:[\d,]*\d)?(?:\.\d+)?"
UNIT = r"(?:ms/token|ms|us|µs|ns|GB/s|MB/s|GiB/s|GFLOP/s|TFLOP/s|tokens/s)"
MEASURED = re.compile(rf"{NUMBER}(?:-{NUMBER})?\s?{UNIT}(?![\w/])|{NUMBER}x (?:faster|slower)\b")
"""A figure with a time or rate unit (`72-74 ms`, `~10 us`, `17-21 GB/s`, `1.2 GFLOP/s`), or a speed-up."""


def python_texts(source: str):
    """(line, text) of every comment and every string that stands as a statement (docstrings,
    attribute docstrings), line by line."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for offset, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + offset, line


def cpp_texts(source: str):
    """(line, text) of every `//` comment and every line inside `/* ... */`."""
    in_block = False
    for number, line in enumerate(source.splitlines(), 1):
        if in_block:
            yield number, line
            in_block = "*/" not in line
        elif "/*" in line:
            comment = line[line.index("/*"):]
            yield number, comment
            in_block = "*/" not in comment
        elif "//" in line:
            yield number, line[line.index("//"):]


def timing_logs(path: Path) -> list[str]:
    text = path.read_text()
    texts = python_texts(text) if path.suffix == ".py" else cpp_texts(text)
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for number, line in texts if MEASURED.search(line)]


def test_comments_and_docstrings_carry_no_timing_logs():
    found = [log for pattern in SOURCES for path in sorted(ROOT.glob(pattern)) for log in timing_logs(path)]
    assert not found, ("measured figures in the source (move them to docs/benchmarks.md's Design measurements "
                       "and say the reason in words):\n" + "\n".join(found))


def test_the_check_finds_a_timing_log(tmp_path):
    planted = tmp_path / "kernel.cpp"
    planted.write_text("int f();  // 8 streams read 17-21 GB/s where one row gave 13-15\n"
                       "/* a step took\n   72-74 against 129-148 ms */\nint g();  // tile: 16 x 64 rows, 1 KiB ahead\n")
    assert [line for line, text in cpp_texts(planted.read_text()) if MEASURED.search(text)] == [1, 3]
    module = '"""Loads in ~10 us."""\nx = 1  # 20 against 47 us\ny = "12 ms"  # a value, not a comment\n'
    assert [line for line, text in python_texts(module) if MEASURED.search(text)] == [2, 1]  # comments, then docstrings
    assert MEASURED.search("emulated bf16 ran 100x slower") and MEASURED.search("1.2 vs 158 GFLOP/s")
    assert not MEASURED.search("the weights' 1 KiB lines, 16 lanes, B=4, T=256, 2 streams, ms/token in the log")
    assert MEASURED.search("a token: 10.74 against 11.25 ms/token")
