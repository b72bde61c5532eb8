"""`python -m gpt2forge.benchmark_runner.profiled SCRIPT.py ARGS...` (or `-m MODULE ARGS...`): run a Python
program whole under the PyTorch profiler (CPU and CUDA activity) and write trace.json and
top_ops.txt to $GPT2FORGE_PROFILE_DIR.

The benchmark runner uses it with --profile for commands that do not profile selected steps
themselves (`profile: process` in the spec). Work done in child processes (benchmarks that spawn
workers) is not recorded: the trace shows the parent only.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from gpt2forge.train.metrics.profiler import PROFILE_DIR_ENV, export_profile, new_profiler


def main(argv: list[str]) -> int:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: python -m gpt2forge.benchmark_runner.profiled SCRIPT.py ARGS... | -m MODULE ARGS...",
              file=sys.stderr)
        return 2
    out_dir = Path(os.environ.get(PROFILE_DIR_ENV, "profile"))
    module = argv[1] if argv[0] == "-m" else None
    target_args = argv[2:] if module else argv[1:]
    sys.argv = [module or argv[0], *target_args]
    if not module:
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    prof = new_profiler()
    code = 0
    prof.start()
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # the program's own exit status
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        prof.stop()
        trace, table = export_profile(prof, out_dir, f"profile of the whole process: {' '.join(argv)}")
        print(f"profile: {trace}, {table}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
