"""`python -m gpt2forge.tools.machine_report`: what this machine and install give a run, in one report.

Versions (Python, torch and the libraries the project uses), devices, CPU features (flags from
/proc/cpuinfo, torch's own CPU capability), whether the custom ops library is built and loads, and
which fast paths are on. The benchmark runner prints it at the top of every log, so a figure always
comes with the setup that produced it. `--json` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
from typing import Any

PACKAGES = ("torch", "numpy", "transformers", "tokenizers", "tiktoken", "safetensors", "tfrecord", "tqdm",
            "tensorboard", "matplotlib", "wandb")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")


QUIET_LOAD = 0.5
"""A 1-minute load average below this is a quiet machine for a benchmark."""


def wait_for_quiet(limit_s: float, poll_s: float = 5.0) -> float:
    """The 1-minute load average once it is below QUIET_LOAD, or after `limit_s` seconds (0: at
    once); prints it, with a warning when the machine is still not quiet. Benchmarks that compare
    timings call it before they start: their ratios are interleaved, but a loaded machine adds noise."""
    deadline = time.monotonic() + limit_s
    while (load := os.getloadavg()[0]) >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(poll_s)
    if load >= QUIET_LOAD:
        waited = f" after waiting {limit_s:.0f} s" if limit_s > 0 else ""
        print(f"warning: the machine is not quiet (1-minute load {load:.2f}{waited}, quiet is below "
              f"{QUIET_LOAD}); figures may be noisy", flush=True)
    else:
        print(f"1-minute load {load:.2f}: quiet machine", flush=True)
    return load


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_info() -> dict[str, Any]:
    """Model name, cores, and which of CPU_FLAGS /proc/cpuinfo lists (empty off Linux)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "flags": [f for f in CPU_FLAGS if f in flags]}


def _devices(torch) -> dict[str, Any]:
    cuda = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cuda.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                         "memory_gib": round(p.total_memory / 2**30, 1)})
    return {"cuda": cuda, "cuda_runtime": torch.version.cuda, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _custom_ops(torch) -> dict[str, Any]:
    from gpt2forge.ops import library as custom_ops  # lazy: it imports torch, which the report loads only when present

    path = custom_ops.library_path()
    loaded = path.is_file() and custom_ops.load_custom_ops()
    names = torch._C._dispatch_get_all_op_names() if loaded else []  # `gpt2forge::op.overload` strings
    ops = sorted({n.split("::", 1)[1].split(".")[0] for n in names if n.startswith("gpt2forge::")})
    return {"library": str(path), "built": path.is_file(), "loaded": bool(loaded), "ops": ops,
            "build_info": custom_ops.build_info() if loaded else None}


def _fast_paths(torch, ops: dict[str, Any]) -> dict[str, Any]:
    """What the project uses when it can: each value says on/off (and why off where useful)."""
    cuda = torch.cuda.is_available()
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
    out = {
        "fused LM-head loss kernel (CPU)": "lm_head_ce" in ops["ops"],
        "sample index op (mmap data)": "build_sample_idx" in ops["ops"],
        "torch.compile (inductor)": "yes" if cuda or compiler else "no C++ compiler for CPU inductor",
        "oneDNN (mkldnn)": torch.backends.mkldnn.is_available(),
        "bf16 matmul on CPU (oneDNN)": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "OpenMP": torch.backends.openmp.is_available(),
    }
    if cuda:
        from gpt2forge.core.precision import gpu_has_native_bf16  # imports torch: only here, as the caller does

        out.update({"SDPA flash": torch.backends.cuda.flash_sdp_enabled(),
                    "SDPA memory-efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                    "bf16 on this GPU": gpu_has_native_bf16()})
    return out


def environment() -> dict[str, Any]:
    """The report as a dict (what benchmark_results.json stores)."""
    import torch

    ops = _custom_ops(torch)
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "packages": {p: _version(p) for p in PACKAGES}, "cpu": cpu_info(), "devices": _devices(torch),
            "custom_ops": ops, "fast_paths": _fast_paths(torch, ops),
            "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR")
                    if k in os.environ}}


def format_report(env: dict[str, Any]) -> str:
    """The report as text lines (`== environment ==` ... )."""
    d, cpu, ops = env["devices"], env["cpu"], env["custom_ops"]
    gpus = "; ".join(f"{g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)" for g in d["cuda"]) or "none"
    lines = [
        "== environment (python -m gpt2forge.tools.machine_report) ==",
        f"python {env['python']} on {env['platform']}",
        "packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items()),
        f"cpu: {cpu['model']}, {cpu['usable_cpus']} of {cpu['logical_cpus']} logical CPUs usable, "
        f"torch threads {d['torch_threads']}, torch CPU capability {d['cpu_capability']}",
        f"cpu flags: {' '.join(cpu['flags']) or 'none of ' + ' '.join(CPU_FLAGS)}",
        f"cuda: {gpus}" + (f" (CUDA runtime {d['cuda_runtime']})" if d["cuda"] else ""),
        f"custom ops: {'loaded' if ops['loaded'] else 'built but not loadable' if ops['built'] else 'not built (make)'}"
        + (f" ({', '.join(ops['ops'])}); {ops['build_info']}" if ops["loaded"] else ""),
        "fast paths: " + ", ".join(f"{k}: {_on(v)}" for k, v in env["fast_paths"].items()),
    ]
    if env["env"]:
        lines.append("environment variables: " + ", ".join(f"{k}={v}" for k, v in env["env"].items()))
    return "\n".join(lines)


def _on(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt2forge.tools.machine_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    env = environment()
    print(json.dumps(env, indent=1) if args.json else format_report(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
