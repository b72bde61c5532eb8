"""The package's imports point one way, down the layers that gpt2forge/*/__init__.py declare."""

import ast
import graphlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "gpt2forge"
# Lowest first: a module may import its own layer and those to its left (gpt2forge/__init__.py is
# the bottom, gpt2forge/cli.py the top).
LAYERS = ["", "core", "ops", "text", "model", "data", "preprocess", "parallel", "generate", "evaluation", "train",
          "frontends", "tools", "benchmark_runner", "cli"]
MODULES = {".".join(("gpt2forge", *p.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__"): p
           for p in sorted(PKG.rglob("*.py"))}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 and parts[1] in LAYERS else "")


def imports(path: Path):
    """(line, imported module, inside a function, under `if TYPE_CHECKING:`) for each gpt2forge import."""
    def walk(node, in_function=False, type_only=False):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("gpt2forge"):
                for alias in child.names:  # `from gpt2forge.data import mmap` imports the module gpt2forge.data.mmap
                    name = f"{child.module}.{alias.name}"
                    yield child.lineno, name if name in MODULES else child.module, in_function, type_only
            elif isinstance(child, ast.Import):
                yield from ((child.lineno, a.name, in_function, type_only) for a in child.names
                            if a.name.startswith("gpt2forge"))
            yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                            type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)))
    yield from walk(ast.parse(path.read_text()))


EDGES = {m: list(dict.fromkeys(imports(p))) for m, p in MODULES.items()}


def check(found: list[str]) -> None:
    assert not found, "\n".join(found)


def test_imports_point_down_the_layers():
    check([f"{m}:{line} imports {target}, a higher layer" for m, edges in EDGES.items()
           for line, target, _, _ in edges if layer(target) > layer(m)])


def test_function_level_imports_say_why():
    check([f"{m}:{line} imports {target} inside a function without a `# why` comment"
           for m, edges in EDGES.items() for line, target, in_function, _ in edges
           if in_function and "#" not in MODULES[m].read_text().splitlines()[line - 1]])


def test_no_import_cycles():
    graph = {m: {t for _, t, in_function, type_only in edges if not (in_function or type_only) and t in MODULES}
             for m, edges in EDGES.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("import cycle: " + " -> ".join(reversed(exc.args[1])))


LOOP_CONFIG = "gpt2forge.train.config"
"""The one module of gpt2forge.train a front end may import: the TrainConfig it builds."""


def test_the_loop_knows_no_front_end_and_no_front_end_knows_the_loop():
    check([f"{m}:{line} imports {target}" for m, edges in EDGES.items() for line, target, _, _ in edges
           if (m.startswith("gpt2forge.train") and target.startswith("gpt2forge.frontends"))
           or (m.startswith("gpt2forge.frontends") and target.startswith("gpt2forge.train")
               and target != LOOP_CONFIG)])
