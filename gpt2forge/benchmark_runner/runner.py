"""Running variants: one subprocess each (own session, so a timeout kills all its children), logs,
metrics, and the results files.

Per variant, in the log folder: `<variant>/stdout` (the environment report, then the command's
output), `<variant>/stderr`, `<variant>/variant_result.json`, and with --profile
`<variant>_profile/` (trace.json, top_ops.txt). For the run: `benchmark_results.json` and `.csv`,
rewritten after every variant so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpt2forge.benchmark_runner.extract import MetricError, derive, extract
from gpt2forge.benchmark_runner.spec import Variant
from gpt2forge.core.atomic import write_atomic
from gpt2forge.train.metrics.monitor import RUNS_DIR_ENV
from gpt2forge.train.metrics.profiler import PROFILE_DIR_ENV, PROFILE_STEPS_ENV

PASSED, FAILED, SKIPPED = "PASSED", "FAILED", "SKIPPED"


@dataclasses.dataclass
class RunOptions:
    log_dir: Path
    timeout: float | None = None
    compile_only: bool = False
    profile: bool = False
    profile_steps: str = "3:4"
    header: str = ""  # written at the top of every stdout log (the environment report)


def command_for(variant: Variant, opts: RunOptions) -> tuple[list[str], dict[str, str]]:
    """The argv and environment a variant runs with under these options."""
    argv = list(variant.argv)
    env = {**os.environ, **variant.env}
    env.setdefault(RUNS_DIR_ENV, str((opts.log_dir / variant.name / "runs").resolve()))  # trainer metrics files
    if opts.compile_only:
        argv.append("--compile-only")
    if opts.profile:
        env[PROFILE_DIR_ENV] = str((opts.log_dir / f"{variant.name}_profile").resolve())
        env[PROFILE_STEPS_ENV] = opts.profile_steps
        if variant.profile == "process" and Path(argv[0]).name.startswith("python"):
            argv[1:1] = ["-m", "gpt2forge.benchmark_runner.profiled"]  # the whole Python process under the profiler
    return argv, env


def run_variant(variant: Variant, opts: RunOptions) -> dict[str, Any]:
    """Run one variant; returns its result record (also written to `<variant>/variant_result.json`)."""
    record: dict[str, Any] = {"benchmark": variant.benchmark, "variant": variant.name, "params": variant.params,
                              "hardware": variant.hardware, "command": variant.command, "results": {},
                              "derived": {}, "exit_code": None, "seconds": 0.0, "status": FAILED, "reason": "",
                              "spec_error": False, "profile": None}
    if opts.compile_only and not variant.compile_only:
        record.update(status=SKIPPED, reason="has no --compile-only mode (compile_only: false)")
        return record
    out_dir = opts.log_dir / variant.name
    out_dir.mkdir(parents=True, exist_ok=True)
    argv, env = command_for(variant, opts)
    record["command"] = " ".join(argv)
    timeout = min((t for t in (variant.timeout, opts.timeout) if t), default=None)
    header = opts.header + f"command: {record['command']}\ncwd: {variant.cwd}\n" + "-" * 60 + "\n"
    with open(out_dir / "stdout", "w") as out, open(out_dir / "stderr", "w") as err:
        out.write(header)
        out.flush()
        t0 = time.perf_counter()
        code, timed_out = _run(argv, variant.cwd, env, out, err, timeout)
        record["seconds"] = round(time.perf_counter() - t0, 2)
    record["exit_code"] = code
    stdout = (out_dir / "stdout").read_text(errors="replace")[len(header):]
    stderr = (out_dir / "stderr").read_text(errors="replace")
    if timed_out:
        record["reason"] = f"timed out after {timeout:g} s"
    elif code != 0:
        record["reason"] = f"exit code {code}: {_error_line(stderr, stdout)[:200]}"
    metrics = [] if opts.compile_only else variant.metrics
    try:
        record["results"] = extract(metrics, stdout, stderr, command_ok=code == 0)
        record["derived"] = derive({} if opts.compile_only else variant.derived, record["results"], variant.params)
        if code == 0:
            record["status"] = PASSED
    except MetricError as exc:
        record["spec_error"] = exc.spec
        record["reason"] = record["reason"] or (f"spec error: {exc}" if exc.spec else str(exc))
    if opts.profile:
        prof = opts.log_dir / f"{variant.name}_profile"
        record["profile"] = str(prof) if (prof / "trace.json").is_file() else None
    write_atomic(out_dir / "variant_result.json", json.dumps(record, indent=1) + "\n")
    return record


def _error_line(stderr: str, stdout: str) -> str:
    """The line that best says why a command failed: the last `error: ...` or `...Error: ...` line,
    else the last line with words in it (launchers end with banners of `=`)."""
    lines = [ln.strip() for ln in (stderr + "\n" + stdout).splitlines()]
    for ln in reversed(lines):
        if re.match(r"^(error|\w*Error)\b", ln):
            return ln
    return next((ln for ln in reversed(lines) if re.search(r"[A-Za-z]{3}", ln)), "")


def _run(argv: list[str], cwd: Path, env: dict[str, str], out, err, timeout: float | None) -> tuple[int | None, bool]:
    """(exit code, timed out). The process gets its own session; on timeout or Ctrl-C the whole
    group gets SIGTERM, then SIGKILL after 10 s."""
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        err.write(f"cannot start {argv[0]}: {exc}\n")
        return 127, False
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return proc.returncode, True
    except KeyboardInterrupt:
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def write_results(log_dir: Path, records: list[dict[str, Any]], environment: dict[str, Any]) -> None:
    """benchmark_results.json (every record) and benchmark_results.csv (one row per variant)."""
    write_atomic(log_dir / "benchmark_results.json",
                 json.dumps({"environment": environment, "variants": records}, indent=1) + "\n")
    metric_cols: list[str] = []
    for r in records:
        for name in [*r["results"], *r["derived"]]:
            if name not in metric_cols:
                metric_cols.append(name)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["benchmark", "variant", "status", "seconds", *metric_cols, "reason"])
    for r in records:
        values = {**{k: next(iter(v.values())) for k, v in r["results"].items()}, **r["derived"]}
        writer.writerow([r["benchmark"], r["variant"], r["status"], r["seconds"],
                         *(values.get(c, "") for c in metric_cols), r["reason"]])
    write_atomic(log_dir / "benchmark_results.csv", buf.getvalue())
