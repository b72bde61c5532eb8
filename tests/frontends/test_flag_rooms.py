"""Every train_gpt2.py flag is defined in the room whose code reads it (STYLE.md: a setting lives once, in
the room of the code that consumes it), so grep for a flag's definition lands beside its consumer: a module
in the package folder of the file that defines the flag's section (subfolders included) reads the field as
an attribute (`args.min_loss_scale`, `cfg.loss_scale.min_loss_scale`). A read inside a `__post_init__` does
not count: validating a value is not using it. The check knows names, not types: an attribute of the
field's name on any object counts.

It fails when a field moves to a room that does not read it. Tried by hand: `loss_scale_hysteresis` moved
from LossScaleArgs (gpt2forge/core/loss_scaler.py) back into RuntimeArgs (gpt2forge/train/config.py) made
test_every_flag_is_read_in_the_room_that_defines_it fail with

    --loss-scale-hysteresis: defined in gpt2forge/train/config.py, but gpt2forge/train/ never reads
    `.loss_scale_hysteresis` (read in: gpt2forge/core/)

which test_the_check_names_a_flag_defined_away_from_its_reader keeps.
"""

import ast
import dataclasses
import functools
import inspect
from pathlib import Path

from gpt2forge.core.flags import flag
from gpt2forge.train.config import FIELD_SECTION, SECTIONS

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "gpt2forge"


def attributes_read(source: str) -> set[str]:
    """The attribute names a module's code reads (`x.name` loaded), outside any `__post_init__`."""
    names: set[str] = set()

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == "__post_init__":
                continue
            if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load):
                names.add(child.attr)
            walk(child)

    walk(ast.parse(source))
    return names


@functools.cache
def package_reads() -> dict[Path, set[str]]:
    """Each module of the package -> the attribute names it reads."""
    return {path: attributes_read(path.read_text()) for path in PKG.rglob("*.py")}


def flag_definitions() -> list[tuple[str, Path]]:
    """(field, the file defining its section) for every train_gpt2.py flag."""
    return [(f.name, Path(inspect.getsourcefile(cls)).resolve()) for cls in SECTIONS.values()
            for f in dataclasses.fields(cls)]


def unread_flags(definitions: list[tuple[str, Path]]) -> list[str]:
    """One line per (field, defining file) whose room, the file's folder, reads no attribute of the field's
    name: the flag, the file, and the folders that do read it."""
    found = []
    for name, defined_in in definitions:
        readers = sorted({path.parent for path, names in package_reads().items() if name in names})
        room = defined_in.parent
        if not any(folder == room or room in folder.parents for folder in readers):
            where = ", ".join(f"{folder.relative_to(REPO)}/" for folder in readers) or "nowhere"
            found.append(f"--{flag(name)}: defined in {defined_in.relative_to(REPO)}, but {room.relative_to(REPO)}/ "
                         f"never reads `.{name}` (read in: {where})")
    return found


def test_every_flag_is_read_in_the_room_that_defines_it():
    definitions = flag_definitions()
    assert len(definitions) == len(FIELD_SECTION)  # every flag is checked
    problems = unread_flags(definitions)
    assert not problems, "\n".join(problems)


def test_the_check_names_a_flag_defined_away_from_its_reader():
    assert unread_flags([("loss_scale_hysteresis", PKG / "train" / "config.py")]) == [
        "--loss-scale-hysteresis: defined in gpt2forge/train/config.py, but gpt2forge/train/ never reads "
        "`.loss_scale_hysteresis` (read in: gpt2forge/core/)"]
    assert unread_flags([("loss_scale_hysteresis", PKG / "core" / "loss_scaler.py")]) == []


def test_a_read_in_post_init_is_not_a_use():
    source = ("class Args:\n    def __post_init__(self):\n        assert self.checked > 0\n\n"
              "    @property\n    def total(self):\n        return self.used * 2\n\n"
              "def f(args):\n    args.stored = args.loaded\n")
    assert attributes_read(source) == {"used", "loaded"}
