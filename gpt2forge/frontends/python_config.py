"""Python config files read without running them: the forms a settings module uses, evaluated from its
syntax tree (`ast`), nothing else.

Accepted: imports (the names they bind stand for what they import), `NAME = value` with a literal
(number, string, bool, None, list, tuple, dict display), `dict(key=value)`, a call of an imported or
known name with literal keyword arguments (an `Instance`), a name bound above, a dotted name (a
`Symbol`: `torch.half`) or arithmetic on numbers (`2**5`); docstrings and `pass`. Anything else (a
function, a loop, a call of anything else) stops with one line naming `file:line`. Used for
Colossal-AI's configs (gpt2forge.frontends.colossal).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from collections.abc import Collection
from pathlib import Path
from typing import Any

from gpt2forge.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Symbol:
    """A name the file imports or uses bare (a class, a function, an enum member), dotted as written."""

    name: str

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class Instance:
    """A call of a Symbol with keyword arguments (`TensorShardStrategy()`)."""

    symbol: Symbol
    kwargs: dict


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class _Reader:
    """Evaluates the accepted forms of one file; `refuse` is the one-line error naming file:line."""

    def __init__(self, path: str, known_names: Collection[str]):
        self.path, self.known_names = path, known_names
        self.names: dict[str, Any] = {}

    def refuse(self, node: ast.AST, what: str) -> UsageError:
        return UsageError(f"--config {self.path}:{node.lineno}: {what}; a Python config is read here, never "
                          "run: write literals, dict(...) and imported names")

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    raise self.refuse(node, f"`from {node.module} import *`")
                self.names[alias.asname or alias.name] = Symbol(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                self.names[bound] = Symbol(alias.name if alias.asname else bound)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not all(isinstance(t, ast.Name) for t in targets):
                raise self.refuse(node, "an assignment to something other than a name")
            value = self.value(node.value)
            for target in targets:
                self.names[target.id] = value
        elif isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            return
        else:
            raise self.refuse(node, f"`{ast.unparse(node).splitlines()[0]}` is not a plain assignment")

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
                raise self.refuse(node, "a dict key that is not a string")
            return {k.value: self.value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            if node.id in self.known_names:
                return Symbol(node.id)
            raise self.refuse(node, f"`{node.id}` is neither imported nor assigned above")
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if not isinstance(base, Symbol):
                raise self.refuse(node, f"`.{node.attr}` of a value")
            return Symbol(f"{base.name}.{node.attr}")
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = self.number(node.left), self.number(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or (isinstance(left, int) and
                                                             abs(left).bit_length() * right > 4096)):
                raise self.refuse(node, f"`{ast.unparse(node)}` is too large a power")
            try:
                return _ARITHMETIC[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError) as exc:
                raise self.refuse(node, f"`{ast.unparse(node)}`: {exc}") from None
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            number = self.number(node.operand)
            return -number if isinstance(node.op, ast.USub) else number
        raise self.refuse(node, f"`{ast.unparse(node)}` is not a literal")

    def number(self, node: ast.expr) -> int | float:
        value = self.value(node)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.refuse(node, f"arithmetic on `{ast.unparse(node)}`, which is not a number")
        return value

    def call(self, node: ast.Call) -> Any:
        is_dict = isinstance(node.func, ast.Name) and node.func.id == "dict" and "dict" not in self.names
        callee = None if is_dict else self.value(node.func)
        if not (is_dict or isinstance(callee, Symbol)):
            raise self.refuse(node, f"a call of `{ast.unparse(node.func)}`, which is not an imported name")
        if node.args or any(k.arg is None for k in node.keywords):
            raise self.refuse(node, f"`{ast.unparse(node)}` has positional or ** arguments; write key=value")
        kwargs = {k.arg: self.value(k.value) for k in node.keywords}
        return kwargs if is_dict else Instance(callee, kwargs)


def read_config_file(path: str, known_names: Collection[str] = ()) -> dict[str, Any]:
    """The settings (top-level assignments) of the Python config at `path`, evaluated without running it;
    `known_names` may be used without an import (each becomes a Symbol).

    Raises:
        UsageError: the file is unreadable, not Python, or uses a form outside the accepted ones (file:line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise UsageError(f"--config {path}:{exc.lineno}: not Python ({exc.msg}); fix the file") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; nesting too deep for the parser
        raise UsageError(f"--config {path}: not a Python config this reader takes ({type(exc).__name__}); write "
                         "literals, dict(...) and imported names") from None
    reader = _Reader(path, known_names)
    for node in tree.body:
        reader.statement(node)
    return {name: value for name, value in reader.names.items() if not isinstance(value, Symbol)}
