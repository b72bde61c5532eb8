"""The names a Markdown document gives a reader, for tests/test_docs_names.py to resolve: backticked spans
and link targets in its prose, the commands of its fenced blocks (their scripts, `-m` modules, console
scripts, flags and make targets) and the entries of its layout listings.

Not read as names of this repository, by rule:
  - what a reader brings or a run writes: a path whose first folder is not the repository's
    (`checkpoints/mini/`, `corpus/`, a folder .gitignore lists), `my-...`/`your-...` files, the
    arguments of a command (`--input raw.jsonl`), placeholders (`step_N/`, `<dir>`, `$OUT`, `--flag`);
  - other tools' names: a script that is not in the tree (nanoGPT's `train.py`), a launcher's flags (those
    before the script: `torchrun --nproc-per-node 4 train_gpt2.py`), and, marked `theirs`, a flag in a
    paragraph, list item or table row that names the tool it may belong to (`FOREIGN_TOOLS`).
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpt2forge"
GENERATED = {line.strip("/") for line in (ROOT / ".gitignore").read_text().split() if re.fullmatch(r"/?[\w.-]+/", line)}
"""Top-level folders that commands write (build/, checkpoints/, runs/): named in the docs, absent from a clone."""
REPOSITORY = {p.name for p in ROOT.iterdir() if p.name not in GENERATED and not p.name.endswith(".egg-info")}
SUBPACKAGES = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.glob("**/__init__.py") if p.parent != PACKAGE}
"""`train`, `train/metrics`, ...: a path that starts with one is a path inside the package."""
PACKAGE_HEADS = {s.split("/")[0] for s in SUBPACKAGES} | {s.split("/")[-1] for s in SUBPACKAGES}
"""The first word of a dotted name from inside the package: `train.step.train_step`, `metrics.lines.StepReport`."""

PLACEHOLDER = re.compile(r"[<>$]|\.\.\.|(^|[/_.-])([A-Z][A-Z0-9_]*|N|M|K)($|[/_.{-])")
"""`<dir>`, `$OUT`, `...`, `step_N/`, `PREFIX_text_document.bin`: a name the reader fills in."""
WRITTEN_BY_USERS = re.compile(r"(^|/)(my[-_]|your[-_]|example[-_./]|out/)")
"""A file that an example command writes or the reader brings (`data/my-gpt2`)."""
PLACEHOLDER_FLAGS = {"--flag"}
"""training.md's `--flag`, `--flag True`: how any switch is written."""
FILE_SUFFIXES = {"py", "json", "safetensors", "bin", "idx", "txt", "md", "pkl", "jsonl", "yaml", "yml", "tokens",
                 "raw", "npy", "npz", "pt", "cpp", "cu", "h", "sh", "sbatch", "tar", "gz", "csv", "html", "png"}
"""`model.safetensors`, `train.py`: a file's name, not a dotted module path."""
FOREIGN_TOOLS = re.compile(r"torchrun|Slurm|nanoGPT|Megatron-LM")
"""Tools whose own flags the docs give: in a paragraph that names one, a flag that none of our commands has
is that tool's (torchrun's `--max-restarts`, a Megatron-LM run's `--disable-bias-linear`)."""

FOREIGN_SCRIPTS = {"train.py", "run_clm_no_trainer.py"}
"""Other tools' scripts that the docs name by file name: nanoGPT's train.py, Hugging Face's run_clm_no_trainer.py."""

PYTHON = re.compile(r"^(python3?(\.\d+)?|\S*/bin/python3?)$")
LAUNCHERS = {"time", "nice", "env", "exec", "srun", "torchrun", "bash", "sh", "deepspeed", "accelerate", "launch"}
"""Words before a command's script: the flags among them are the launcher's."""
FLAG = re.compile(r"--[A-Za-z][\w-]*")
LISTING = re.compile(r"( *)((?:[\w-]+/|[\w-]+\.\w+)(?:,\s*(?:[\w-]+/|[\w-]+\.\w+))*)(?: {2,}\S.*)?")
"""A line of a layout listing in a fenced block: a file or folder (or several, with commas), then two
spaces and what it holds."""


@dataclass(frozen=True)
class Name:
    """One name a document gives. kind: path, link (a Markdown link's target), module, file (a script's file
    name), op (`gpt2forge::name`), command (a console script), flag or target (make's); script: the command
    whose parser a flag must be in (None: any of ours); theirs: the flag's paragraph names another tool."""

    doc: str
    line: int
    kind: str
    text: str
    script: str | None = None
    theirs: bool = False

    def __str__(self) -> str:
        of = f" of {self.script}" if self.script else ""
        return f"{self.doc}:{self.line}: {self.kind}{of} `{self.text}`"


# -- reading a document ------------------------------------------------------------------------------------


def names_in(markdown: str, doc: str) -> list[Name]:
    """The names a Markdown text gives: backticked spans and link targets in its prose, paragraph by
    paragraph (a list item and a table row are paragraphs of their own), and its fenced commands."""
    found: list[Name] = []
    unit: list[tuple[int, str]] = []
    fence: list[tuple[int, str]] | None = None
    for number, line in enumerate([*markdown.splitlines(), ""], 1):
        if line.lstrip().startswith("```"):
            if fence is not None:
                found += _block_names(fence, doc)
            fence = None if fence is not None else []
            continue
        if fence is not None:
            fence.append((number, line))
            continue
        if not line.strip() or re.match(r"([-*] |\d+\. |\||#)", line):
            found += _prose_names(unit, doc)
            unit = []
        if line.startswith("    ") and not unit:  # an indented code block: commands
            found += _command_names(line, doc, number)
        elif line.strip():
            unit.append((number, line))
    return found


def _prose_names(unit: list[tuple[int, str]], doc: str) -> list[Name]:
    theirs = bool(FOREIGN_TOOLS.search(" ".join(line for _, line in unit)))
    found: list[Name] = []
    for number, line in unit:
        for span in re.findall(r"`([^`]+)`", line):
            found += [Name(n.doc, n.line, n.kind, n.text, n.script, theirs and n.script is None)
                      for n in _span_names(span.strip(), doc, number)]
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", target):  # a web address
                found.append(Name(doc, number, "link", target))
    return found


def _block_names(block: list[tuple[int, str]], doc: str) -> list[Name]:
    """The commands of a fenced block (a continued line, `\\` at its end, joined to the next) and the
    entries of a layout listing (`gpt2forge/` above `  core/   errors, ...`: gpt2forge/core/)."""
    found: list[Name] = []
    pending, start = "", 0
    folders: list[tuple[int, str]] = []  # (indent, path) of the listing's folders above this line
    for number, line in block:
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands = _command_names(pending + line, doc, start)
        found += commands
        pending, start = "", 0
        entry = LISTING.fullmatch(line.rstrip())
        if commands or not entry:
            continue
        indent = len(entry.group(1))
        folders = [f for f in folders if f[0] < indent]
        for item in re.split(r",\s*", entry.group(2)):
            path = (folders[-1][1] if folders else "") + item
            if _is_ours(path):
                found.append(Name(doc, number, "path", path))
        if entry.group(2).endswith("/") and "," not in entry.group(2):
            folders.append((indent, path))
    return found


def _span_names(span: str, doc: str, line: int) -> list[Name]:
    """What one backticked span names: a command, flags, a path or a module (else nothing)."""
    words = span.split()
    if _is_command(words):
        return _command_names(span, doc, line)
    if FLAG.fullmatch(words[0].split("=")[0]):
        return [Name(doc, line, "flag", w.split("=")[0]) for w in words if FLAG.fullmatch(w.split("=")[0])
                and w.split("=")[0] not in PLACEHOLDER_FLAGS]
    if len(words) > 1:
        return []
    span = re.sub(r"\(\S*\)$", "", span)  # `gpt2forge.core.capability.forced(...)`
    if PLACEHOLDER.search(span) or WRITTEN_BY_USERS.search(span) or "://" in span:
        return []
    if re.fullmatch(r"gpt2forge::\w+", span):
        return [Name(doc, line, "op", span)]
    if "/" in span and span.split("/")[0] in REPOSITORY or span in REPOSITORY:
        return [Name(doc, line, "path", span)]
    dotted = re.fullmatch(r"((?:\w+/)*)(\w+(?:\.\w+)+)", span)
    if dotted and dotted.group(2).split(".")[-1] not in FILE_SUFFIXES:  # `gpt2forge.x.y`, `train/step.train_step`
        name = dotted.group(1).replace("/", ".") + dotted.group(2)
        return [Name(doc, line, "module", name)] if name.split(".")[0] in PACKAGE_HEADS | {"gpt2forge"} else []
    if re.fullmatch(r"[\w-]+\.(py|sh)", span) and span not in FOREIGN_SCRIPTS:
        return [Name(doc, line, "file", span)]
    return [Name(doc, line, "path", span)] if _is_ours(span) else []


def _is_command(words: list[str]) -> bool:
    first = words[0]
    return bool(PYTHON.match(first) or first in ("make", "torchrun", "bash") or first.startswith("gpt2forge-")
                or (len(words) > 1 and first.endswith((".py", ".sh")) and first not in FOREIGN_SCRIPTS))


def _is_ours(path: str) -> bool:
    """A path of the repository's tree: its first folder is the repository's, or it names a module or
    subpackage from inside the package (`train/optim.py`, `train/metrics/`), or a top-level file."""
    head, _, rest = path.partition("/")
    if not rest and not path.endswith("/"):
        return path in REPOSITORY
    if head in REPOSITORY:
        return True
    return head in SUBPACKAGES and (path.endswith(".py") or path.rstrip("/") in SUBPACKAGES)


def _command_names(command: str, doc: str, line: int) -> list[Name]:
    """The names in one shell line: for each command in it (`&&`, `;`, `|`), its script (a path of ours),
    `-m` module or console script and the flags given to it, or make's targets."""
    command = re.sub(r"(^|\s)#.*", "", command)  # a comment
    found: list[Name] = []
    for part in re.split(r"&&|\|\||;|\|", command):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before the command
            words = words[1:]
        if words[:1] == ["make"]:
            found += [Name(doc, line, "target", w) for w in words[1:] if re.fullmatch(r"[a-z][\w-]*", w)]
            continue
        script, rest = _script_of(words)
        if script is None:
            continue
        if script.startswith("-m "):
            found.append(Name(doc, line, "module", script[3:]))
        else:
            found.append(Name(doc, line, "command" if script.startswith("gpt2forge-") else "path", script))
        found += [Name(doc, line, "flag", w.split("=")[0], script) for w in rest if FLAG.fullmatch(w.split("=")[0])]
    return found


def _script_of(words: list[str]) -> tuple[str | None, list[str]]:
    """(the script of ours: a path, `-m gpt2forge...` or a console script; the words after it) of one
    command, or (None, []) for another tool's command."""
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            module = words[i + 1]
            return (f"-m {module}", words[i + 2:]) if module.split(".")[0] == "gpt2forge" else (None, [])
        if word.startswith("gpt2forge-") and i == 0:
            return word, words[1:]
        if word.endswith((".py", ".sh")) and not word.startswith("-"):
            if "/" not in word and word not in REPOSITORY and word not in FOREIGN_SCRIPTS:
                word = _by_file_name(word) or word  # `kfac_step.py --components`: benchmarks/kfac_step.py
            return (word, words[i + 1:]) if _is_ours(word) and not PLACEHOLDER.search(word) else (None, [])
        launcher_value = i > 0 and FLAG.fullmatch(words[i - 1]) and not words[i - 1].startswith("--no")
        if not (PYTHON.match(word) or word in LAUNCHERS or word.startswith("-") or launcher_value):
            return None, []
    return None, []


@functools.cache
def files_by_name() -> dict[str, list[str]]:
    """The tree's .py and .sh files by their file name (outside build outputs and the venv)."""
    found: dict[str, list[str]] = {}
    for top in sorted(REPOSITORY):
        for p in sorted((ROOT / top).glob("**/*.[ps][yh]")) if (ROOT / top).is_dir() else [ROOT / top]:
            if p.suffix in (".py", ".sh"):
                found.setdefault(p.name, []).append(p.relative_to(ROOT).as_posix())
    return found


def _by_file_name(name: str) -> str | None:
    """The one script of the tree with this file name (`kfac_step.py`: benchmarks/kfac_step.py), if one."""
    paths = files_by_name().get(name, [])
    return paths[0] if len(paths) == 1 else None
