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


MODEL_ROOM = "gpt2forge.model"
SHAPE_MAKERS = {"ModelConfig", "load_model_config", "megatron_model_config"}
"""What makes a model's shape: the config class (constructed, or one of its readers such as
`ModelConfig.preset`), and the readers of a checkpoint's shape. Outside gpt2forge.model a run gets its
shape from `model.build.resolve_model` (through `TrainConfig.model_source`)."""
SHAPES_MADE_ELSEWHERE: dict[str, str] = {}
"""Modules still making a shape outside gpt2forge.model, each with what it calls: owned by other work in
flight, to move to `model.build` (an entry that no longer makes one must leave this list)."""


def shape_makers(path: Path) -> list[tuple[int, str]]:
    """(line, callee) for each call in `path` that makes a model's shape (SHAPE_MAKERS)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        parts, part = [], node.func
        while isinstance(part, ast.Attribute):  # config.ModelConfig.preset(...): preset, ModelConfig, config
            parts.append(part.attr)
            part = part.value
        if isinstance(part, ast.Name):
            parts.append(part.id)
        if SHAPE_MAKERS.intersection(parts):
            found.append((node.lineno, ast.unparse(node.func)))
    return found


def test_only_the_model_room_makes_a_model_shape():
    made = {m: shape_makers(p) for m, p in MODULES.items() if not m.startswith(MODEL_ROOM)}
    check([f"{m}:{line} calls {callee}: a model's shape is made in {MODEL_ROOM}.build "
           "(resolve_model, or TrainConfig.model_source)"
           for m, calls in made.items() for line, callee in calls
           if SHAPES_MADE_ELSEWHERE.get(m) != callee])
    check([f"{m} no longer calls {callee}: drop it from SHAPES_MADE_ELSEWHERE"
           for m, callee in SHAPES_MADE_ELSEWHERE.items() if callee not in {c for _, c in made.get(m, [])}])


def test_a_shape_made_outside_the_model_room_is_caught(tmp_path):
    source = tmp_path / "elsewhere.py"
    source.write_text("from gpt2forge.model.config import ModelConfig\n\na = ModelConfig(n_layer=2)\n"
                      "b = ModelConfig.preset('gpt2')\nc = config.ModelConfig.from_json(p)\n"
                      "d = load_model_config(ckpt)\ne = resolve_model(arch).config\n")
    assert [callee for _, callee in shape_makers(source)] == [
        "ModelConfig", "ModelConfig.preset", "config.ModelConfig.from_json", "load_model_config"]


TRAINER_NAMES = 40
"""The most names gpt2forge/train/trainer.py imports: the loop is an orchestrator; what it needs is
built by gpt2forge.train.setup and handed over as one `Loop`."""


def imported_names(path: Path) -> list[str]:
    """Every name an import statement in `path` binds (`from __future__` aside), in order."""
    return [alias.asname or alias.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__"
            for alias in node.names]


def test_the_trainer_imports_few_names():
    names = imported_names(MODULES["gpt2forge.train.trainer"])
    assert len(names) <= TRAINER_NAMES, f"trainer.py imports {len(names)} names: {', '.join(names)}"


def test_imported_names_counts_every_binding(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from __future__ import annotations\nimport os, sys as system\nfrom a.b import (c, d as e)\n\n"
                      "def f():\n    import json  # why: lazy\n")
    assert imported_names(source) == ["os", "system", "c", "e", "json"]
