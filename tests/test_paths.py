"""Every repository path that the docs, comments and docstrings name exists: a moved or deleted file
leaves no reference behind (README, docs/, the folders' READMEs, the package, custom_ops, run/,
benchmarks/, tests/)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("gpt2forge", "tests", "docs", "benchmarks", "custom_ops", "data", "tasks", "run", "config", ".ci")
FOLDER = "|".join(re.escape(f) for f in FOLDERS)
PATH = re.compile(rf"(?<![\w/.-])((?:{FOLDER})/[\w./-]*[\w-]\.(?:py|md|cpp|cu|h|sh|yml|yaml|toml|json|sbatch|pbs))\b")
SUBPACKAGES = "|".join(p.name for p in sorted((ROOT / "gpt2forge").iterdir())
                       if (p / "__init__.py").is_file() and p.name != "tools")  # tools/...: Megatron-LM's scripts
MODULE = re.compile(rf"(?<![\w/.-])((?:{SUBPACKAGES})/[\w/]*\w\.py)\b")
"""A module named from inside the package (`train/optim.py`): it is gpt2forge/<that>, or a top-level file."""
SOURCES = ("README.md", "docs/**/*.md", "*/README.md", "gpt2forge/**/*.py", "custom_ops/*", "run/*", "benchmarks/*",
           "tests/**/*.py", "data/*.py", "tasks/*", "Makefile", ".ci/*", "*.py")
WRITTEN_BY_USERS = re.compile(r"(^|/)(my[-_]|example|your|out/|checkpoints/)")
"""Paths in examples that a user's command writes or brings (not files of this repository)."""
NOT_OURS = {"tasks/main.py", "tasks/zeroshot_gpt/detokenizer.py",  # Megatron-LM's files, named as the origin
            "data/inspect.py"}  # the name data/inspect_data.py avoids (it would shadow the standard library's)


def named_paths() -> list[tuple[str, int, str]]:
    found = []
    for pattern in SOURCES:
        for source in sorted(ROOT.glob(pattern)):
            if not source.is_file() or source.suffix in (".so", ".pkl", ".png") or source == Path(__file__):
                continue
            for number, line in enumerate(source.read_text(errors="replace").splitlines(), 1):
                found += [(str(source.relative_to(ROOT)), number, m.group(1)) for m in PATH.finditer(line)]
                found += [(str(source.relative_to(ROOT)), number, m.group(1)) for m in MODULE.finditer(line)
                          if not (ROOT / "gpt2forge" / m.group(1)).exists()]
    return found


def exists(path: str, source: str) -> bool:
    """A repository path, one inside the package (`data/args.py`: the package's data/, not the tools') or,
    in a Markdown file, a link relative to its folder (docs/benchmarks.md's `benchmarks/x.md`)."""
    relative = source.endswith(".md") and (ROOT / source).parent.joinpath(path).exists()
    return (ROOT / path).exists() or (ROOT / "gpt2forge" / path).exists() or relative


def test_the_paths_that_docs_and_comments_name_exist():
    missing = sorted({f"{source}:{line} names {path}" for source, line, path in named_paths()
                      if not WRITTEN_BY_USERS.search(path) and path not in NOT_OURS and not exists(path, source)})
    assert not missing, "paths that do not exist (moved or removed?):\n" + "\n".join(missing)


def test_the_check_finds_a_missing_path():
    assert PATH.findall("see gpt2forge/train/args.py and docs/nowhere.md, not xgpt2forge/a.py")[:2] == [
        "gpt2forge/train/args.py", "docs/nowhere.md"]
    assert MODULE.findall("(train/args.py, frontends/graphcore.py)") == ["train/args.py", "frontends/graphcore.py"]
    assert not (ROOT / "gpt2forge/train/args.py").exists()  # moved to gpt2forge/frontends/graphcore.py
    # A Markdown link is relative to its file; elsewhere the same text names a repository path.
    assert exists("benchmarks/2026-11-history.md", "docs/benchmarks.md")
    assert not exists("benchmarks/2026-11-history.md", "README.md")
    assert not exists("benchmarks/2026-11-history.md", "gpt2forge/train/trainer.py")
