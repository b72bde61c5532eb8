"""The PyTorch profiler over chosen host steps (`--profile-steps A:B`, `--profile-dir`), for the
trainer and the benchmark runner: a chrome trace and a table of the top operators."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from gpt2forge.core import log
from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.errors import UsageError

PROFILE_STEPS_ENV = "GPT2FORGE_PROFILE_STEPS"
PROFILE_DIR_ENV = "GPT2FORGE_PROFILE_DIR"


def parse_profile_steps(text: str, source: str = "--profile-steps") -> tuple[int, int]:
    """'A:B' -> (A, B): host steps A to B, counting from 1, both included."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text))
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise UsageError(f"{source} {text!r}: expected A:B with 1 <= A <= B (host steps counting from 1), e.g. 3:4")
    return int(m[1]), int(m[2])


def new_profiler(schedule=None, on_trace_ready=None):
    """A torch.profiler.profile recording CPU and, when present, CUDA activity."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready)


def export_profile(prof, out_dir: Path, title: str, rows: int = 30) -> tuple[Path, Path]:
    """Write `trace.json` (chrome://tracing, ui.perfetto.dev) and `top_ops.txt` (operators by self
    time, device time first when CUDA was recorded) into out_dir; returns both paths."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    trace, table = out_dir / "trace.json", out_dir / "top_ops.txt"
    tmp = out_dir / ".trace.json.tmp"
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, trace)
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = prof.key_averages().table(sort_by=sort, row_limit=rows)
    write_atomic(table, f"{title}\noperators sorted by {sort}, top {rows}\n\n{text}\n")
    return trace, table


class StepProfiler:
    """Host steps first..last (counting from 1 = the first step this process runs, both included)
    under the profiler, on torch.profiler's schedule (one warm-up step before when there is one);
    the trace is exported when the last step ends, or at close() if the run ends inside the range."""

    def __init__(self, first: int, last: int, out_dir: Path):
        from torch.profiler import schedule

        self.first, self.last, self.out_dir = first, last, out_dir
        self.exported = False
        self.steps_seen = 0
        warmup = 1 if first > 1 else 0
        with warnings.catch_warnings():  # from step 1 there is no step to warm up on: known, not news
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            self.prof = new_profiler(schedule(wait=first - 1 - warmup, warmup=warmup, active=last - first + 1,
                                              repeat=1), self._export)
            self.prof.start()

    def _export(self, prof) -> None:
        if self.steps_seen < self.first:  # stopped during the warm-up step: nothing in range was recorded
            return
        what = f"host steps {self.first} to {min(self.last, self.steps_seen)}"
        trace, table = export_profile(prof, self.out_dir, f"profile of {what}")
        log.info(f"Profile of {what}: {trace}, {table}")
        self.exported = True

    def after_step(self, step: int) -> None:
        """Called once after every host step (`step` is the run's global count, for the record)."""
        if self.prof is not None:
            self.steps_seen += 1
            self.prof.step()
            if self.steps_seen >= self.last:
                self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()  # inside the active range this still calls _export
        if not self.exported:
            log.notice(f"profile steps {self.first}:{self.last}: the run ended after {self.steps_seen} step(s); "
                       "nothing profiled")
