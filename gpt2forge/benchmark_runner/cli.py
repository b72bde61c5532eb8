"""`python -m gpt2forge.benchmark_runner`: the command line of the runner (see the package docstring)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from gpt2forge.benchmark_runner.runner import FAILED, PASSED, SKIPPED, RunOptions, run_variant, write_results
from gpt2forge.benchmark_runner.spec import build_variants, load_spec, select
from gpt2forge.core.errors import UsageError, cli_main
from gpt2forge.train.metrics.profiler import parse_profile_steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpt2forge.benchmark_runner",
                                description="Run the benchmarks of a spec file (examples-utils format) and "
                                            "collect their metrics.")
    p.add_argument("--spec", nargs="+", default=["benchmarks.yml"], help="spec file(s) (default: benchmarks.yml)")
    p.add_argument("--benchmark", nargs="+", default=None, metavar="NAME",
                   help="benchmark, variant or group names (a group is a `hardware` value, e.g. cpu, or all), "
                        "run in the order given (default: every benchmark)")
    p.add_argument("--log-dir", default=None,
                   help="where logs and results go (default: build/benchmark_logs/<timestamp>)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per variant (the smaller of it and the "
                                                               "entry's `timeout`)")
    p.add_argument("--stop-on-error", action="store_true", help="stop at the first variant that fails")
    p.add_argument("--compile-only", action="store_true",
                   help="append --compile-only to each command (entries with compile_only: true; others are "
                        "skipped); no metrics but the compile time")
    p.add_argument("--profile", action="store_true",
                   help="run each variant under the PyTorch profiler: <log-dir>/<variant>_profile/trace.json "
                        "and top_ops.txt")
    p.add_argument("--profile-steps", default="3:4",
                   help="with --profile: host steps A:B the trainer profiles (counting from 1; default 3:4, "
                        "after the warm-up steps)")
    p.add_argument("--list", action="store_true", help="list the selected variants and their commands, run nothing")
    return p


@cli_main
def main(argv: Sequence[str] | None = None) -> int:
    """Exit code 0: all passed (or skipped); 1: a variant failed; 2: an error in the spec."""
    args = build_parser().parse_args(argv)
    parse_profile_steps(args.profile_steps, "--profile-steps")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be > 0 seconds")
    by_benchmark = {}
    for spec in args.spec:
        for name, entry in load_spec(spec).items():
            by_benchmark[name] = build_variants(spec, name, entry)
    variants = select(by_benchmark, args.benchmark)
    if args.list:
        for v in variants:
            print(f"{v.name} [{v.hardware}]: {v.command}")
        return 0
    # Imported here, after the spec is known to be valid: the machine report imports torch.
    from gpt2forge.tools.machine_report import environment, format_report  # lazy: imports torch

    env = environment()
    header = format_report(env) + "\n"
    print(header, flush=True)
    log_dir = Path(args.log_dir or Path("build") / "benchmark_logs" / time.strftime("%Y%m%d-%H%M%S"))
    log_dir.mkdir(parents=True, exist_ok=True)
    opts = RunOptions(log_dir, args.timeout, args.compile_only, args.profile, args.profile_steps, header)
    records = []
    for v in variants:
        print(f"RUNNING {v.name} [{v.hardware}]: {v.command}", flush=True)
        r = run_variant(v, opts)
        records.append(r)
        write_results(log_dir, records, env)
        figures = ", ".join(f"{k} {_fmt(x)}" for k, x in _figures(r).items())
        print(f"{r['status']} {v.name} ({r['seconds']:.1f} s){': ' + figures if figures else ''}"
              f"{' - ' + r['reason'] if r['reason'] else ''}", flush=True)
        if r["profile"] or (args.profile and r["status"] == PASSED):
            print(f"  profile: {r['profile'] or 'missing (the command wrote none)'}")
        if args.stop_on_error and r["status"] == FAILED:
            break
    return _summary(records, log_dir)


def _figures(record: dict) -> dict[str, float]:
    return {**{k: next(iter(v.values())) for k, v in record["results"].items()}, **record["derived"]}


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:,.0f}"


def _summary(records: list[dict], log_dir: Path) -> int:
    print("=" * 20 + " summary " + "=" * 20)
    for r in records:
        print(f"{r['status']} {r['benchmark']}::{r['variant']}" + (f" - {r['reason']}" if r["reason"] else ""))
    counts = {s: sum(r["status"] == s for r in records) for s in (PASSED, FAILED, SKIPPED)}
    print(f"{counts[PASSED]} passed, {counts[FAILED]} failed, {counts[SKIPPED]} skipped; logs and "
          f"benchmark_results.json/.csv in {log_dir}")
    if any(r["spec_error"] for r in records):
        return 2
    return 1 if counts[FAILED] else 0
