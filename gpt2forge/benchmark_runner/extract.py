"""Metrics from a command's output: regexp matches per line, reductions, derived expressions."""

from __future__ import annotations

import ast
import math
import operator
import re

from gpt2forge.benchmark_runner.spec import Metric

COMPILE_TIME = re.compile(r"Compiled/Loaded model in ([0-9.]+) secs")


class MetricError(ValueError):
    """A metric could not be extracted; `spec` is True when the spec is at fault (the regexp never
    matched output of a command that succeeded, or a derived expression is broken)."""

    def __init__(self, message: str, spec: bool = False):
        super().__init__(message)
        self.spec = spec


def matches(regexp: re.Pattern, text: str) -> list[str]:
    """Every match of `regexp` on every line of `text` (its first non-empty group when it has groups)."""
    out = []
    for line in text.splitlines():
        for m in regexp.findall(line):
            if isinstance(m, tuple):
                m = next((g for g in m if g), "")
            out.append(m)
    return out


def to_number(text: str) -> float:
    """'1,234.5 ' -> 1234.5 (thousands separators and spaces allowed)."""
    return float(text.replace(",", "").strip())


def reduce(metric: Metric, values: list[float]) -> float:
    """One number from all matches, examples-utils semantics (see the package docstring)."""
    if metric.reduction == "mean":
        ordered = sorted(values, reverse=metric.name == "latency")[metric.skip:]
        return sum(ordered) / len(ordered)
    kept = values[metric.skip:]
    if metric.reduction == "final":
        return kept[-1]
    if metric.reduction == "value":
        return kept[0]
    return min(kept) if metric.reduction == "min" else max(kept)


def extract(metrics: list[Metric], stdout: str, stderr: str, command_ok: bool) -> dict[str, dict[str, float]]:
    """{metric: {reduction_type: value}}; raises MetricError naming the first metric that fails."""
    out = {}
    text = stdout + "\n" + stderr
    for metric in metrics:
        raw = matches(metric.regexp, text)
        if len(raw) <= metric.skip:
            raise MetricError(f"metric {metric.name!r}: regexp {metric.regexp.pattern!r} matched {len(raw)} "
                              f"time(s), needs more than skip={metric.skip}", spec=command_ok)
        try:
            values = [to_number(r) for r in raw]
        except ValueError:
            bad = next(r for r in raw if not _is_number(r))
            raise MetricError(f"metric {metric.name!r}: matched {bad!r}, not a number; fix the regexp's group",
                              spec=command_ok) from None
        if any(math.isnan(v) for v in values):
            raise MetricError(f"metric {metric.name!r}: NaN in the output")
        out[metric.name] = {metric.reduction: reduce(metric, values)}
    compile_s = matches(COMPILE_TIME, text)
    if compile_s and "compile_time" not in out:
        out["compile_time"] = {"value": to_number(compile_s[0])}  # built in, like examples-utils' compile time
    return out


def _is_number(text: str) -> bool:
    try:
        to_number(text)
    except ValueError:
        return False
    return True


def flatten(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """{metric: {reduction: v}} -> {metric: v}."""
    return {name: next(iter(by_reduction.values())) for name, by_reduction in results.items()}


def derive(derived: dict[str, str], results: dict[str, dict[str, float]], params: dict[str, str]) -> dict[str, float]:
    """Each expr with `{name}` replaced by a metric or parameter value, then evaluated (arithmetic,
    numbers, min/max/abs/round only: the spec is data, not code)."""
    names = {**params, **{k: repr(v) for k, v in flatten(results).items()}}
    out: dict[str, float] = {}
    for name, expr in derived.items():
        names.update({k: repr(v) for k, v in out.items()})  # later derived metrics may use earlier ones
        try:
            text = re.sub(r"\{(\w+)\}", lambda m: str(names[m[1]]), expr)
        except KeyError as exc:
            raise MetricError(f"derived {name!r}: {{{exc.args[0]}}} is neither a metric nor a parameter "
                              f"(have: {', '.join(sorted(names))})", spec=True) from None
        try:
            out[name] = float(_evaluate(ast.parse(text, mode="eval").body))
        except (SyntaxError, ValueError, TypeError, ZeroDivisionError) as exc:
            raise MetricError(f"derived {name!r}: cannot evaluate {text!r} ({exc})", spec=True) from None
    return out


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.Mod: operator.mod}
_FUNCTIONS = {"min": min, "max": max, "abs": abs, "round": round}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return -_evaluate(node.operand) if isinstance(node.op, ast.USub) else _evaluate(node.operand)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _FUNCTIONS[node.func.id](*(_evaluate(a) for a in node.args))
    raise ValueError(f"only numbers, + - * / // % ** and min/max/abs/round are allowed, not {ast.dump(node)[:40]}")
