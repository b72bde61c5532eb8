"""Per-CPU-class performance check: three same-run ratios, recorded and compared with the docs' figures.

For the CPU it runs on, in a few minutes, it runs the existing benchmarks with short settings, each
in its own process, and takes from each a ratio measured within that one run:

  decode       benchmarks/generation_latency.py, GPT-2 small, fp32, batch 1, prompt 64, 128 new
               tokens, 3 rounds: ours' ms/token over the bandwidth floor read in the same run (at
               its start, around each round, and right after each step)
  train        benchmarks/train_throughput.py, GPT-2 small, B=4, T=256, fp32, 2 warm-up + 3 timed
               steps interleaved with transformers: ours' tokens/s over transformers'
  lm_head_op   benchmarks/lm_head_memory.py's op children (plain and fused, not the PyTorch
               reference), N=4096, V=50304, C=768, best of 2: the fused LM head + loss's time (and
               extra memory) over the plain logits + cross-entropy's

It names the CPU's class from its /proc/cpuinfo flags, as a label only (amx, avx512_bf16, avx512,
avx2; nothing is chosen from it), appends one JSON line (class, CPU model, commit, date, the
1-minute load at the start, the ratios and the raw figures) to --results, and says which of the
class's figures in benchmarks/class_figures.json (each copied, with its source line, from
docs/benchmarks.md) today's ratios contradict: outside the recorded value (or range of runs) by more
than --tolerance. A figure of one class is never compared with another: a class matches by its
flags label and a word of the CPU model name (EPYC, Xeon), and a run held to an older instruction set
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS or GPT2FORGE_OPS_ISA set) is recorded
with those variables and compared with no class's. Contradicting a figure is reported, not an error;
the exit status is non-zero only when a benchmark failed.

Time on 2 cores: about 6 minutes on the AVX2 EPYC, the slowest class (from the documented figures:
decode 1.5-2 min, training 2-3 min with ours' cold compile, the LM head op about 1 min), less on the
others; `--checks` runs a subset.

    .venv/bin/python benchmarks/class_check.py                   # or: make class-check
    .venv/bin/python benchmarks/class_check.py --checks decode --wait-quiet 120
    .venv/bin/python benchmarks/class_check.py --smoke           # tiny shapes: does it run (not comparable)
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt2forge.tools.machine_report import cpu_info, wait_for_quiet  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent
FIGURES = BENCHMARKS / "class_figures.json"
RESULTS = ROOT / "build" / "class_check.jsonl"
SMOKE_RESULTS = ROOT / "build" / "class_check_smoke.jsonl"
TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class Ratio:
    """What one recorded ratio means."""
    better: str  # "lower" or "higher"
    what: str


RATIOS = {
    "decode_start_floor_ratio": Ratio(better="lower", what="decode ms/token over the floor read at the run's start"),
    "decode_round_floor_ratio": Ratio(better="lower", what="decode ms/token over the floor read around each "
                                                           "round, median of rounds"),
    "decode_paired_floor_ratio": Ratio(better="lower", what="each decode step over the kernel's read of its "
                                                            "bytes right after it, median of steps"),
    "train_fp32_ratio": Ratio(better="higher", what="training tokens/s, ours over transformers, fp32"),
    "lm_head_op_time_ratio": Ratio(better="lower", what="fused LM head + loss time over the plain path's"),
    "lm_head_op_memory_ratio": Ratio(better="lower", what="fused LM head + loss extra memory over the plain "
                                                          "path's"),
}


class CheckFailed(RuntimeError):
    """A benchmark the check runs failed; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One check's outcome: its ratios, the machine state they were read in, the raw figures."""
    ratios: dict[str, float]
    state: dict[str, float]
    raw: dict


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison: the benchmark it runs, its arguments (full size and smoke size), and `run`,
    which runs it with a choice of those arguments and returns what it measured."""
    name: str
    benchmark: str
    args: tuple[str, ...]
    smoke_args: tuple[str, ...]
    run: Callable[[tuple[str, ...]], Measured]


def run_benchmark(script: str, args: tuple[str, ...]) -> dict:
    """benchmarks/<script> ARGS --json TMP in its own process (its output goes to ours); its JSON."""
    with tempfile.TemporaryDirectory(prefix="class-check-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)]
        code = subprocess.run(cmd, cwd=ROOT).returncode
        if code != 0 or not out.is_file():
            raise CheckFailed(f"{script} exited with {code} (its output is above)")
        return json.loads(out.read_text())


def decode(args: tuple[str, ...]) -> Measured:
    out = run_benchmark("generation_latency.py", args)
    r = out["results"][0]
    ratios = {"decode_start_floor_ratio": r["floor_ratio"], "decode_round_floor_ratio": r.get("round_floor_ratio"),
              "decode_paired_floor_ratio": r.get("paired_floor_ratio")}
    trips = [t for t in r.get("round_trip_ns", []) if t is not None]
    raw = {"ours_ms_per_token": r["ours"]["ms_per_token"], "floor_ms_per_token": r["floor_ms_per_token"],
           "transformers_ms_per_token": r["transformers"]["ms_per_token"],
           "transformers_threads": r["transformers"]["threads"], "ours_threads": r["ours_threads"],
           "weights_MB": r["weights_MB"], "start_floor_GBs": round(out["bandwidth_GBs"]["start"]["floor"], 1),
           "end_floor_GBs": round(out["bandwidth_GBs"]["end"]["floor"], 1),
           **{k: r[k] for k in ("round_floor_GBs", "round_floor_ratios", "round_trip_ns", "paired_floor_ratios")
              if k in r}}
    return Measured(ratios={k: v for k, v in ratios.items() if v is not None},
                    state={"decode_round_trip_ns": statistics.median(trips)} if trips else {}, raw=raw)


def train(args: tuple[str, ...]) -> Measured:
    out = run_benchmark("train_throughput.py", args)
    if not out["results"]:
        raise CheckFailed("train_throughput.py measured no precision")
    s = out["results"][0]
    o, t = s["impls"]["ours"], s["impls"]["transformers"]
    raw = {"ours_tokens_per_s": round(o["tokens_per_s"], 1), "transformers_tokens_per_s": round(t["tokens_per_s"], 1),
           "ours_step_s": o["step_s"], "transformers_step_s": t["step_s"],
           "ours_mfu": None if o["mfu"] is None else round(o["mfu"], 3),
           "peak_GFLOPs": None if s["device_peak_flops"] is None else round(s["device_peak_flops"] / 1e9, 1),
           "ours_compile_s": o["compile_s"]}
    return Measured(ratios={f"train_{s['precision']}_ratio": round(s["ratio"], 3)}, state={}, raw=raw)


def lm_head_op(args: tuple[str, ...]) -> Measured:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import lm_head_memory  # its op children: plain and fused (the PyTorch reference is not needed here)
    finally:
        sys.path.remove(str(BENCHMARKS))
    results = {}
    for variant in ("plain", "fused"):
        results[variant] = r = lm_head_memory.run_child(list(args), variant)
        if "error" in r:
            raise CheckFailed(f"lm_head_memory.py {' '.join(args)}, {variant}: {r['error']}")
        print(f"  lm_head_op {variant}: {r['seconds']:.3f} s, {r['extra_gib']:.3f} GiB above its inputs", flush=True)
    p, f = results["plain"], results["fused"]
    ratios = {"lm_head_op_time_ratio": round(f["seconds"] / p["seconds"], 3)}
    if p["extra_gib"] > 0:  # tiny shapes may not move the resident set at all
        ratios["lm_head_op_memory_ratio"] = round(f["extra_gib"] / p["extra_gib"], 3)
    raw = {f"{v}_{k}": round(results[v][k], 4) for v in ("plain", "fused") for k in ("seconds", "extra_gib")}
    return Measured(ratios=ratios, state={}, raw=raw)


CHECKS = (
    Check(name="decode", benchmark="generation_latency.py",
          args=("--precisions", "fp32", "--batch-sizes", "1", "--rounds", "3", "--hf-threads", "default"),
          smoke_args=("--model", "gpt2-test", "--precisions", "fp32", "--batch-sizes", "1", "--prompt-len", "8",
                      "--new-tokens", "4", "--rounds", "1", "--hf-threads", "default", "--no-compile"),
          run=decode),
    Check(name="train", benchmark="train_throughput.py",
          args=("--precisions", "fp32", "--batch-size", "4", "--seq-len", "256", "--warmup", "2", "--steps", "3",
                "--device", "cpu"),
          smoke_args=("--model", "gpt2-test", "--precisions", "fp32", "--batch-size", "1", "--seq-len", "32",
                      "--warmup", "1", "--steps", "2", "--device", "cpu", "--warm-compile-cache"),
          run=train),
    Check(name="lm_head_op", benchmark="lm_head_memory.py",
          args=("op", "--tokens", "4096", "--vocab", "50304", "--embd", "768", "--repeats", "2"),
          smoke_args=("op", "--tokens", "64", "--vocab", "512", "--embd", "32", "--repeats", "1"),
          run=lm_head_op),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [c.name for c in CHECKS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checks", default=",".join(names), help=f"comma-separated subset of {', '.join(names)}")
    p.add_argument("--results", default=None,
                   help=f"JSON-lines file the record is appended to (default: {RESULTS.relative_to(ROOT)}; with "
                        f"--smoke {SMOKE_RESULTS.relative_to(ROOT)})")
    p.add_argument("--figures", default=str(FIGURES.relative_to(ROOT)),
                   help="the recorded figures per class (JSON, see its `about`)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="a figure is contradicted when today's ratio is further than this fraction outside it")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for a 1-minute load below 0.5 before starting (0: report the load "
                        "at once, with a warning when the machine is not quiet)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and a step or two: checks that everything runs; its ratios are not "
                        "comparable with the figures")
    args = p.parse_args(argv)
    args.checks = [s.strip() for s in args.checks.split(",") if s.strip()]
    problems = [f"--checks: {c!r} is not one of {', '.join(names)}" for c in args.checks if c not in names]
    if not args.checks:
        problems.append("--checks is empty")
    if not 0 <= args.tolerance < 1:
        problems.append("--tolerance must be a fraction in [0, 1)")
    if problems:
        p.error("; ".join(problems))
    args.results = Path(args.results) if args.results else (SMOKE_RESULTS if args.smoke else RESULTS)
    return args


def cpu_class(flags: list[str]) -> str:
    """The class label of a CPU from its /proc/cpuinfo flags: amx, avx512_bf16, avx512, avx2 or other."""
    if "amx_tile" in flags or "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


def isa_limits() -> dict[str, str]:
    """The variables set that hold ATen, oneDNN, MKL or the custom ops to an older instruction set
    (`gpt2forge.core.precision.ISA_LIMITS`): a run under them measures another machine than its flags
    name, so it is recorded with them and compared with no class's figures."""
    from gpt2forge.core import precision  # imports torch: not at the script's start

    return precision.isa_limits()


def load_figures(path: str | Path) -> list[dict]:
    """The classes of a figures file (see benchmarks/class_figures.json's `about`)."""
    return json.loads(Path(path).read_text())["classes"]


def find_class(classes: list[dict], label: str, cpu_model: str) -> dict | None:
    """The recorded class with this flags label whose model word the CPU's model name contains."""
    return next((c for c in classes if c["label"] == label and c["cpu_model_contains"] in cpu_model), None)


def _distance(when: dict, state: dict[str, float]) -> float:
    """How far today's state is from a figure's condition (0 inside every range; inf when unmeasured)."""
    out = 0.0
    for key, (lo, hi) in when.items():
        if key not in state:
            return float("inf")
        out += max(lo - state[key], 0.0, state[key] - hi)
    return out


def compare(ratios: dict[str, float], state: dict[str, float], figures: list[dict], tolerance: float) -> list[dict]:
    """One verdict per recorded figure: `contradicts` (today's ratio outside the figure's value or
    range by more than `tolerance`, with `worse` true or false), `agrees`, `not measured`, or, for a
    figure that holds in one machine state only, `other state` (the figures' state nearest today's
    applies) or `state unknown`."""
    conditions = [f["when"] for f in figures if f.get("when")]
    nearest = min(conditions, key=lambda w: _distance(w, state), default=None)
    if nearest is not None and _distance(nearest, state) == float("inf"):
        nearest = None
    verdicts = []
    for f in figures:
        metric, today = f["metric"], ratios.get(f["metric"])
        lo, hi = (f["value"], f["value"]) if isinstance(f["value"], (int, float)) else f["value"]
        v = {"metric": metric, "recorded": f["value"], "today": today,
             **{k: f.get(k) for k in ("doc", "section", "date", "commit", "settings", "when", "source")}}
        if f.get("when") and nearest is None:
            v["status"] = "state unknown"
        elif f.get("when") and f["when"] != nearest:
            v["status"] = "other state"
        elif today is None:
            v["status"] = "not measured"
        elif today > hi * (1 + tolerance) or today < lo * (1 - tolerance):
            higher = today > hi
            v.update(status="contradicts", worse=higher == (RATIOS[metric].better == "lower"))
        else:
            v["status"] = "agrees"
        verdicts.append(v)
    return verdicts


def git_commit() -> tuple[str | None, bool | None]:
    """HEAD's hash and whether tracked files differ from it (None, None outside a git checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fmt(value) -> str:
    return "n/a" if value is None else (f"{value[0]:.2f}-{value[1]:.2f}x" if isinstance(value, list) else
                                        f"{value:.2f}x")


def print_summary(record: dict, klass: dict | None, figures_path: str) -> None:
    r, raw = record["ratios"], record["raw"]
    print(f"\nclass check: {record['class']} ({record['class_name'] or 'no recorded class'}; "
          f"{record['cpu_model']}), commit {(record['commit'] or 'unknown')[:10]}"
          f"{' with uncommitted changes' if record['uncommitted_changes'] else ''}, {record['date']}, "
          f"1-minute load {record['load_1min_start']:.2f} at the start")
    if "decode" in raw:
        d = raw["decode"]
        trip = record["state"].get("decode_round_trip_ns")
        print(f"decode: ours {d['ours_ms_per_token']} ms/token, floor {d['floor_ms_per_token']} ms/token at the "
              f"start: {_fmt(r.get('decode_start_floor_ratio'))}; per round median "
              f"{_fmt(r.get('decode_round_floor_ratio'))}; step by step median "
              f"{_fmt(r.get('decode_paired_floor_ratio'))}"
              + ("" if trip is None else f"; the decode threads' cores {trip:.0f} ns apart"))
    if "train" in raw:
        t = raw["train"]
        print(f"train: ours {t['ours_tokens_per_s']} tokens/s, transformers {t['transformers_tokens_per_s']} "
              f"tokens/s: ratio {_fmt(r.get('train_fp32_ratio'))}")
    if "lm_head_op" in raw:
        m = raw["lm_head_op"]
        print(f"lm_head_op: fused {m['fused_seconds']} s, plain {m['plain_seconds']} s: time "
              f"{_fmt(r.get('lm_head_op_time_ratio'))}, extra memory {_fmt(r.get('lm_head_op_memory_ratio'))}")
    for name, error in record["errors"].items():
        print(f"{name}: FAILED: {error}")
    if record["isa_limits"]:
        held = " ".join(f"{k}={v}" for k, v in record["isa_limits"].items())
        print(f"held to an older instruction set ({held}): not the {record['class']} class as it is, so not "
              f"compared with {figures_path}'s figures")
        print("0 of 0 recorded figures contradicted")
        return
    if klass is None:
        print(f"{figures_path} records no figures for class {record['class']} with this CPU model: nothing to "
              f"compare with (this record is the class's first)")
        print("0 of 0 recorded figures contradicted")
        return
    smoke = " (smoke shapes: the verdicts only exercise the check)" if record["smoke"] else ""
    print(f"against {figures_path}'s figures for the {klass['class']} (tolerance {record['tolerance']:.0%}){smoke}:")
    for v in record["verdicts"]:
        where = f"{v['doc']} ({v['section']}, {v['date']})"
        if v["status"] == "contradicts":
            print(f"  CONTRADICTS {where}: {v['metric']} {_fmt(v['recorded'])}, today {_fmt(v['today'])} "
                  f"({'worse' if v['worse'] else 'better'})")
        else:
            state = "".join(f" ({k} {lo}-{hi})" for k, (lo, hi) in (v.get("when") or {}).items())
            print(f"  {v['status']}{state}: {v['metric']} {_fmt(v['recorded'])} in {where}, today {_fmt(v['today'])}")
    compared = [v for v in record["verdicts"] if v["status"] in ("contradicts", "agrees")]
    print(f"{sum(v['status'] == 'contradicts' for v in compared)} of {len(compared)} recorded figures "
          f"contradicted{smoke}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = wait_for_quiet(args.wait_quiet)
    info = cpu_info()
    label, limits = cpu_class(info["flags"]), isa_limits()
    klass = None if limits else find_class(load_figures(args.figures), label, info["model"])
    commit, dirty = git_commit()
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit, "uncommitted_changes": dirty, "class": label,
              "class_name": klass["class"] if klass else None, "cpu_model": info["model"],
              "cpu_flags": info["flags"], "isa_limits": limits, "usable_cpus": info["usable_cpus"],
              "torch": _version("torch"),
              "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
              "load_1min_start": round(load, 2), "smoke": args.smoke, "tolerance": args.tolerance,
              "settings": {}, "seconds": {}, "ratios": {}, "state": {}, "raw": {}, "errors": {}}
    for check in (c for c in CHECKS if c.name in args.checks):
        argv_ = check.smoke_args if args.smoke else check.args
        record["settings"][check.name] = f"{check.benchmark} {' '.join(argv_)}"
        print(f"== {check.name}: {record['settings'][check.name]}", flush=True)
        t0 = time.perf_counter()
        try:
            measured = check.run(argv_)
        except CheckFailed as exc:
            record["errors"][check.name] = str(exc)
            continue
        finally:
            record["seconds"][check.name] = round(time.perf_counter() - t0, 1)
        record["ratios"].update(measured.ratios)
        record["state"].update(measured.state)
        record["raw"][check.name] = measured.raw
    record["load_1min_end"] = round(os.getloadavg()[0], 2)
    record["verdicts"] = compare(record["ratios"], record["state"], klass["figures"], args.tolerance) if klass else []
    print_summary(record, klass, args.figures)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"record appended to {args.results} ({sum(record['seconds'].values()):.0f} s of checks)")
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
