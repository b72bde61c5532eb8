"""Every name that README.md, docs/ and the folders' READMEs give a reader resolves: a repository path
exists, a module of the package (`gpt2forge.train.optim`, `train/optim.py`, `train.step.train_step`) and
the name inside it are defined, a flag given to one of our commands is in that command's parser, a `make`
target is in the Makefile, a custom op (`gpt2forge::lm_head_ce`) is in custom_ops/, a link's file and
heading exist. A rename that leaves the prose behind fails here, naming the document and line.

What counts as a name, and what is another tool's or the reader's: tests/markdown_names.py. A flag alone
in the prose must be in one of our commands' parsers (or, in a paragraph that names another tool, may be
that tool's); a flag in a command line, in that command's parser. tests/test_paths.py checks the paths
that comments and docstrings name.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import io
import json
import re
import runpy
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path

from markdown_names import PACKAGE, REPOSITORY, ROOT, SUBPACKAGES, Name, files_by_name, names_in

DOCS = ("README.md", "docs/**/*.md", "*/README.md")
NOT_OURS = {
    ("data/README.md", "inspect.py"), ("data/README.md", "data/inspect.py"),  # the name inspect_data.py avoids
    ("benchmarks/README.md", "data/stdlib_docs/{train,val}.bin"),  # in peer_nanogpt.py's temporary nanoGPT copy
}
"""(document, name): names that a rule cannot tell from a stale one, said by their document not to be ours."""


# -- resolving a name --------------------------------------------------------------------------------------


def path_exists(text: str, doc: str) -> bool:
    """A repository path (a glob or `{a,b}` matches something), one inside the package, or a link
    relative to the document's folder."""
    stem = text.rstrip("/")
    braces = re.search(r"\{([^}]*)\}", stem)
    variants = [stem[:braces.start()] + v + stem[braces.end():] for v in braces.group(1).split(",")] if braces \
        else [stem]
    bases = (ROOT, PACKAGE, (ROOT / doc).parent)
    return all(any(next(base.glob(v), None) if "*" in v else (base / v).exists() for base in bases) for v in variants)


def link_resolves(target: str, doc: str) -> bool:
    """A Markdown link: its file exists and, for `file.md#anchor` or `#anchor`, that file has the heading."""
    file, _, anchor = target.partition("#")
    if file and not path_exists(file, doc):
        return False
    page = (ROOT / doc).parent / file if file else ROOT / doc
    return not anchor or page.suffix != ".md" or not page.is_file() or anchor in _anchors(page)


@functools.cache
def _anchors(page: Path) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub makes them: lower case, punctuation but `-` and
    `_` dropped, spaces to `-`, a repeated heading's with `-1`, `-2`, ..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}  # a heading's anchor -> how many times it came before
    fenced = False
    for line in page.read_text().splitlines():
        fenced = fenced != line.lstrip().startswith("```")
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)[\s#]*$", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            anchors.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return anchors


def module_resolves(dotted: str) -> bool:
    """`gpt2forge.a.b.name` or a name from inside the package (`train.step.train_step`): the modules are
    found on disk without importing anything, then each remaining name is defined in the module's source
    (a function, class, assignment or import; then a class's own). A name from inside the package that
    is not a module path may be an object's attribute that the package sets (`model.fused_loss`) or
    another tool's config key that a front end reads (`parallel.tensor.size`)."""
    parts = dotted.split(".")
    if parts[0] != "gpt2forge":
        nested = [s for s in SUBPACKAGES if s.split("/")[-1] == parts[0]]
        parts = ["gpt2forge", *(nested[0].split("/") if len(nested) == 1 else parts[:1]), *parts[1:]]
        relative = True
    else:
        relative = False
    spec, search, i = None, [str(ROOT)], 0
    while i < len(parts):
        found = PathFinder.find_spec(parts[i], search)
        if found is None:
            break
        spec, i = found, i + 1
        if not found.submodule_search_locations:
            break
        search = list(found.submodule_search_locations)
    if i == len(parts) or spec is not None and _defines(Path(spec.origin), parts[i:]):
        return True
    if not relative:
        return len(parts) == 2 and _ops_library_class(parts[1])
    return dotted in _front_end_keys() or dotted.count(".") == 1 and _set_as_attribute(dotted.split(".")[1])


def _defines(source: Path, names: list[str]) -> bool:
    """`names[0]` is defined at the top of the module's source, `names[1]` in its body (a class's), ..."""
    body = ast.parse(source.read_text()).body
    for name in names:
        match = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                match = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                match = next((node for t in targets if isinstance(t, ast.Name) and t.id == name), match)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                match = next((node for a in node.names if (a.asname or a.name.split(".")[0]) == name), match)
        if match is None:
            return False
        body = getattr(match, "body", [])
    return True


def _ops_library_class(name: str) -> bool:
    """`gpt2forge.DecodeModel`: a class that the custom ops library registers (custom_ops/*.cpp)."""
    return any(re.search(rf'\.class_<[\w:]+>\("{name}"\)', p.read_text(errors="replace"))
               for p in (ROOT / "custom_ops").glob("*.cpp"))


def _ops_library_defines(op: str) -> bool:
    """`gpt2forge::lm_head_ce`: an op that the custom ops library defines (custom_ops/*.cpp)."""
    return any(re.search(rf'\.def\(\s*"{op}\b', p.read_text(errors="replace"))
               for p in (ROOT / "custom_ops").glob("*.cpp"))


@functools.cache
def _front_end_keys() -> set[str]:
    """String literals of the front ends (gpt2forge/frontends/): the other tools' config keys they read."""
    return {node.value for p in (PACKAGE / "frontends").glob("*.py") for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@functools.cache
def _package_source() -> str:
    return "\n".join(p.read_text() for p in PACKAGE.glob("**/*.py"))


def _set_as_attribute(name: str) -> bool:
    """`model.fused_loss`: the package sets `<object>.fused_loss = ...` somewhere."""
    return re.search(rf"\w\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]", _package_source()) is not None


def make_targets() -> set[str]:
    lines = re.findall(r"^([\w .-]+):(?!=)", (ROOT / "Makefile").read_text(), re.M)
    return {target for line in lines for target in line.split()}


# -- the commands' parsers ---------------------------------------------------------------------------------


def our_commands() -> list[str]:
    """Every command of the tree that may parse flags: the scripts of the top level, data/, tasks/, run/
    and benchmarks/, the package's `python -m` modules and the console scripts."""
    scripts = [p.relative_to(ROOT).as_posix() for pattern in ("*.py", "data/*.py", "tasks/*.py", "benchmarks/*.py")
               for p in sorted(ROOT.glob(pattern))]
    shells = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("*/*.sh"))]
    mains = [f"-m {p.parent.relative_to(ROOT).as_posix().replace('/', '.')}" for p in PACKAGE.glob("**/__main__.py")]
    mains += [f"-m {p.relative_to(ROOT).with_suffix('').as_posix().replace('/', '.')}" for p in PACKAGE.glob("**/*.py")
              if p.name != "__main__.py" and 'if __name__ == "__main__"' in p.read_text()]
    consoles = re.findall(r"^(gpt2forge-[\w-]+) = ", (ROOT / "pyproject.toml").read_text(), re.M)
    return scripts + shells + sorted(mains) + consoles


@functools.cache
def parsers() -> dict[str, list[str] | str]:
    """Each of our commands, and the other scripts of the tree that the docs run (tests/fuzz/run.py) -> its
    option strings (ending in `PASSES_ON` where it takes the flags it knows and passes the rest to another
    parser: tasks/run_gpt2_eval.py), or why it has none. Python commands are run in one child process with
    argparse's parse_args replaced by a capture (their imports and sys.path changes stay out of the suite);
    a shell script's options are the `--x)` patterns of its `case` (and of what it sources)."""
    commands = our_commands()
    commands += sorted({n.script for n in doc_names() if n.script and n.script.endswith(".py")
                        and (ROOT / n.script).is_file()} - set(commands))
    python = [c for c in commands if not c.endswith(".sh")]
    result = subprocess.run([sys.executable, __file__, *python], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    options = json.loads(result.stdout.splitlines()[-1])
    for shell in (c for c in commands if c.endswith(".sh")):
        text = (ROOT / shell).read_text()
        text += "".join((ROOT / s).read_text() for s in re.findall(r"^\s*(?:source|\.) (\S+\.sh)", text, re.M)
                        if (ROOT / s).is_file())
        cases = re.findall(r"^\s*(--[\w-]+)(?:\|--[\w-]+)*\)", text, re.M)
        options[shell] = cases or "a shell script without options of its own (its arguments are passed on)"
    return options


PASSES_ON = "..."


class _Captured(BaseException):
    """Raised by the patched parse_args with the parser a command built (a BaseException: the commands'
    handlers do not catch it)."""

    def __init__(self, parser: argparse.ArgumentParser, passes_on: bool):
        super().__init__()
        self.parser, self.passes_on = parser, passes_on


def _capture(self, *args, **kwargs):
    raise _Captured(self, passes_on=False)


def _capture_known(self, *args, **kwargs):
    raise _Captured(self, passes_on=True)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """A parser's option strings, its subcommands' included."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found |= {o for sub in action.choices.values() for o in _options(sub)}
    return found


def _options_of(command: str) -> list[str] | str:
    """The option strings of the parser that `command` builds; run in the child process."""
    argparse.ArgumentParser.parse_args = _capture
    argparse.ArgumentParser.parse_known_args = _capture_known
    sys.argv = [command]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if command.startswith("-m "):
                runpy.run_module(command[3:], run_name="__main__", alter_sys=True)
            elif command.startswith("gpt2forge-"):
                toml = (ROOT / "pyproject.toml").read_text()
                module, function = re.search(rf'^{command} = "([\w.]+):(\w+)"', toml, re.M).groups()
                getattr(__import__(module, fromlist=[function]), function)([])
            else:
                runpy.run_path(str(ROOT / command), run_name="__main__")
    except _Captured as captured:
        return sorted(_options(captured.parser)) + ([PASSES_ON] if captured.passes_on else [])
    except (Exception, SystemExit) as exc:
        return f"stops before it parses flags ({type(exc).__name__}: {exc})"[:200]
    return "parses no flags"


# -- the check ---------------------------------------------------------------------------------------------


def stale(names: list[Name]) -> list[str]:
    """The names that do not resolve, each as `doc:line: kind `text`` (and why, for a flag)."""
    options = parsers()
    ours = {o for opts in options.values() if isinstance(opts, list) for o in opts}
    targets = make_targets()
    out = []
    for n in names:
        why = ""
        if n.kind == "path":
            ok = path_exists(n.text, n.doc)
        elif n.kind == "link":
            ok = link_resolves(n.text, n.doc)
        elif n.kind == "module":
            ok = module_resolves(n.text)
        elif n.kind == "target":
            ok = n.text in targets
        elif n.kind == "file":
            ok = n.text in files_by_name()
        elif n.kind == "op":
            ok = _ops_library_defines(n.text.split("::")[1])
        elif n.kind == "command":
            ok = n.text in options
        elif n.script:
            opts = options.get(n.script, "not a command of this repository")
            if isinstance(opts, list):
                ok = n.text in opts or PASSES_ON in opts and n.text in ours
            else:
                ok = opts.startswith("a shell script")
            why = f" ({opts})" if isinstance(opts, str) else ""
        else:
            ok = n.text in ours or n.theirs
        if not ok and (n.doc, n.text) not in NOT_OURS:
            out.append(f"{n}{why}")
    return out


@functools.cache
def doc_names() -> tuple[Name, ...]:
    docs = [p.relative_to(ROOT).as_posix() for pattern in DOCS for p in sorted(ROOT.glob(pattern))]
    return tuple(n for doc in docs if doc.split("/")[0] in REPOSITORY  # not .pytest_cache/README.md
                 for n in names_in((ROOT / doc).read_text(), doc))


def test_every_name_in_the_docs_resolves():
    found = stale(list(doc_names()))
    assert not found, "names in the docs that are not in the tree, the package or the parsers (renamed?):\n" + \
        "\n".join(found)


SAMPLE = """
The optimizers are built in `gpt2forge.train.optim` (`train/optim.py`: `train.optim.build_optimizer`);
`python -m gpt2forge.tools.plot` draws the metrics. `--lm-loss fused` and `make train` as documented;
runs land in `checkpoints/mini/` and `step_N/`; the flags: [training](docs/training.md#ipu-flags-on-cpus-and-gpus).

nanoGPT's `train.py --compile=False` and its `--init_from` are its own.

```
torchrun --standalone --nproc_per_node 2 train_gpt2.py --model gpt2 --input-files my-corpus.json
python data/preprocess_data.py --input corpus.jsonl --output-prefix data/my-gpt2 --append-eod
```

```
gpt2forge/
  train/       the loop
  cli.py       console entry points
```
"""
"""A document that names a module four ways, a folder in a layout listing, a flag, a target and the
things that are not checked (a run's folders, a placeholder, another tool's script and a launcher's
flags, a user's files)."""


def test_the_check_fails_when_a_named_module_is_renamed():
    assert stale(names_in(SAMPLE, "sample.md")) == []
    new = "optimizers"  # optim renamed, the prose left behind (a variable: tests/test_paths.py reads this file)
    renamed = re.sub(r"\boptim\b", new, SAMPLE).replace("tools.plot", "tools.plots").replace("train/ ", "trainer/")
    assert stale(names_in(renamed, "sample.md")) == [
        f"sample.md:2: module `gpt2forge.train.{new}`",
        f"sample.md:2: path `train/{new}.py`",
        f"sample.md:2: module `train.{new}.build_optimizer`",
        "sample.md:3: module `gpt2forge.tools.plots`",
        "sample.md:15: path `gpt2forge/trainer/`",
    ]
    flags = SAMPLE.replace("--lm-loss", "--lm-losses").replace("--append-eod", "--append-end").replace(
        "make train", "make training").replace("#ipu-flags", "#ipu-options")
    script = "preprocess_data"
    assert stale(names_in(flags, "sample.md")) == [
        "sample.md:3: flag `--lm-losses`",
        "sample.md:3: target `training`",
        "sample.md:4: link `docs/training.md#ipu-options-on-cpus-and-gpus`",
        f"sample.md:10: flag of data/{script}.py `--append-end`",
    ]


if __name__ == "__main__":  # the child process of `parsers`
    print(json.dumps({command: _options_of(command) for command in sys.argv[1:]}))
