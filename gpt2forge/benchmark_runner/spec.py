"""Reading a benchmark spec: validation (errors name the benchmark and key), variants, groups.

The format is described in `gpt2forge/benchmark_runner/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from gpt2forge.core.errors import UsageError, collect

ENTRY_KEYS = {"cmd", "parameters", "data", "derived", "env", "timeout", "hardware", "compile_only", "profile",
              "location", "description", "output", "requirements_path", "pre_run_commands"}
METRIC_KEYS = {"regexp", "skip", "reduction_type"}
REDUCTIONS = ("mean", "final", "value", "min", "max")
PROFILE_MODES = ("process", "steps")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_ENV_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    regexp: re.Pattern
    skip: int = 0
    reduction: str = "mean"


@dataclasses.dataclass
class Variant:
    """One command to run: a benchmark with one choice of its parameters."""
    benchmark: str
    name: str
    params: dict[str, str]
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    timeout: float | None
    metrics: list[Metric]
    derived: dict[str, str]
    hardware: str
    compile_only: bool
    profile: str
    description: str = ""

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


def load_spec(path: str | Path) -> dict[str, dict[str, Any]]:
    """The benchmark entries of a spec file (anchor holders dropped), validated."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--spec {path}: file not found")
    try:
        data = yaml.load(p.read_text(), Loader=yaml.FullLoader)  # FullLoader: merge keys, as examples-utils
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"--spec {path}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--spec {path}: expected a mapping of benchmark names to entries")
    entries = {str(k): v for k, v in data.items() if "options" not in str(k)}
    collect([problem for name, entry in entries.items() for problem in _check_entry(p, name, entry)])
    return entries


def _check_entry(spec: Path, name: str, entry: Any) -> list[str]:
    where = f"{spec.name}: {name}"
    if not isinstance(entry, dict):
        return [f"{where}: expected a mapping with a `cmd`"]
    problems = [f"{where}: unknown key {k!r} (valid: {', '.join(sorted(ENTRY_KEYS))})"
                for k in entry if k not in ENTRY_KEYS]
    if not isinstance(entry.get("cmd"), str):
        problems.append(f"{where}: `cmd` (a command string) is required")
    if not isinstance(entry.get("hardware"), str):
        problems.append(f"{where}: `hardware` is required (cpu, cuda, ...: what the entry is meant for)")
    if entry.get("profile", "process") not in PROFILE_MODES:
        problems.append(f"{where}: profile {entry['profile']!r} is not one of {', '.join(PROFILE_MODES)}")
    for key in ("data", "derived", "env"):
        if not isinstance(entry.get(key) or {}, dict):
            return problems + [f"{where}: `{key}` must be a mapping of names to values"]
    if entry.get("timeout") is not None and (not isinstance(entry["timeout"], (int, float)) or entry["timeout"] <= 0):
        problems.append(f"{where}: timeout must be a number of seconds > 0")
    for metric, spec_ in (entry.get("data") or {}).items():
        problems += _check_metric(f"{where}: data.{metric}", spec_)
    for metric, spec_ in (entry.get("derived") or {}).items():
        if not isinstance(spec_, dict) or set(spec_) != {"expr"}:
            problems.append(f"{where}: derived.{metric}: expected {{expr: ...}}")
    try:
        for params in expand_parameters(entry.get("parameters")):
            missing = sorted(set(_PLACEHOLDER.findall(str(entry.get("cmd", "")))) - set(params))
            if missing:
                problems.append(f"{where}: cmd uses {', '.join('{' + m + '}' for m in missing)} but `parameters` "
                                f"give {', '.join(sorted(params)) or 'nothing'}")
                break
    except ValueError as exc:
        problems.append(f"{where}: parameters: {exc}")
    return problems


def _check_metric(where: str, spec: Any) -> list[str]:
    if not isinstance(spec, dict):
        return [f"{where}: expected {{regexp, skip, reduction_type}}"]
    problems = [f"{where}: unknown key {k!r} (valid: {', '.join(sorted(METRIC_KEYS))})"
                for k in spec if k not in METRIC_KEYS]
    try:
        re.compile(str(spec.get("regexp")))
    except re.error as exc:
        problems.append(f"{where}: regexp {spec.get('regexp')!r} does not compile ({exc})")
    if "regexp" not in spec:
        problems.append(f"{where}: `regexp` is required")
    if spec.get("reduction_type", "mean") not in REDUCTIONS:
        problems.append(f"{where}: reduction_type {spec['reduction_type']!r} is not one of {', '.join(REDUCTIONS)}")
    if not isinstance(spec.get("skip", 0), int) or spec.get("skip", 0) < 0:
        problems.append(f"{where}: skip must be an integer >= 0")
    return problems


def expand_parameters(parameters: Any) -> list[dict[str, str]]:
    """The variants' parameter dicts: [{}] without parameters; dict form = cartesian product of the
    comma-separated values; list form = first row names, one variant per following row."""
    if not parameters:
        return [{}]
    if isinstance(parameters, dict):
        names = list(parameters)
        values = [[v.strip() for v in str(parameters[n]).split(",")] for n in names]
        return [dict(zip(names, combo)) for combo in itertools.product(*values)]
    if isinstance(parameters, list) and parameters and all(isinstance(r, list) for r in parameters):
        names = [str(n) for n in parameters[0]]
        rows = parameters[1:]
        for i, row in enumerate(rows, 1):
            if len(row) != len(names):
                raise ValueError(f"row {i} has {len(row)} values for {len(names)} names ({', '.join(names)})")
        return [{n: str(v) for n, v in zip(names, row)} for row in rows]
    raise ValueError("expected {name: 'a,b'} or [[names...], [values...], ...]")


def variant_name(benchmark: str, params: dict[str, str]) -> str:
    """`<benchmark>_<key>_<value>...` (keys sorted), safe as a folder name."""
    parts = [benchmark] + [f"{k}_{params[k]}" for k in sorted(params)]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts))


def build_variants(spec_path: str | Path, name: str, entry: dict[str, Any]) -> list[Variant]:
    """Every variant of one (validated) entry, commands ready to run."""
    spec_dir = Path(spec_path).resolve().parent
    cwd = spec_dir / entry.get("location", ".")
    extra_env = {str(k): str(v) for k, v in (entry.get("env") or {}).items()}
    env = {**os.environ, **extra_env}
    metrics = [Metric(m, re.compile(str(s["regexp"])), int(s.get("skip", 0)), s.get("reduction_type", "mean"))
               for m, s in (entry.get("data") or {}).items()]
    derived = {m: str(s["expr"]) for m, s in (entry.get("derived") or {}).items()}
    out = []
    for params in expand_parameters(entry.get("parameters")):
        cmd = _PLACEHOLDER.sub(lambda m, p=params: p[m[1]], entry["cmd"])
        cmd = _ENV_VAR.sub(lambda m: env.get(m[1] or m[2], m[0]), cmd)
        argv = shlex.split(cmd)  # newlines and runs of spaces are plain separators
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the interpreter of this venv
        timeout = entry.get("timeout")
        out.append(Variant(name, variant_name(name, params), params, argv, cwd, extra_env,
                           float(timeout) if timeout else None, metrics, derived, entry["hardware"],
                           bool(entry.get("compile_only", False)), entry.get("profile", "process"),
                           " ".join(str(entry.get("description", "")).split())))
    return out


def select(variants: dict[str, list[Variant]], wanted: list[str] | None) -> list[Variant]:
    """Variants (by benchmark name) for --benchmark names: benchmark names, variant names or groups
    (hardware values, `all`), in the order given; every variant when none are given."""
    everything = [v for vs in variants.values() for v in vs]
    if not wanted:
        return everything
    by_variant = {v.name: v for v in everything}
    groups: dict[str, list[Variant]] = {"all": everything}
    for v in everything:
        groups.setdefault(v.hardware, []).append(v)
    chosen: list[Variant] = []
    for w in wanted:
        found = variants.get(w) or groups.get(w) or ([by_variant[w]] if w in by_variant else None)
        if found is None:
            raise UsageError(f"--benchmark {w}: no such benchmark, variant or group; groups: "
                             f"{', '.join(sorted(groups))}; benchmarks: {', '.join(variants)}")
        chosen += [v for v in found if all(v is not c for c in chosen)]
    return chosen
