"""Throughput and model FLOPs utilisation (MFU).

MFU = achieved training FLOP/s / peak FLOP/s of the device in the run's precision. GPU peaks come
from a table of dense tensor-core figures (the data sheets': llm.c's, nanoGPT's and torchtitan's
basis); beside it the step line shows the MFU against a large matmul read on the GPU at start-up
(`read_gpu_peak_flops`), which runs below the data sheet. CPU peaks are not published in a form we
can look up, so a CPU's is measured: the best of several reads of a large matmul in that precision,
kept in ~/.cache/gpt2forge/cpu_peak.json per CPU (`cpu_peak_flops_key`), where it only ever rises.
A step that beats the peak re-reads it or raises it (`StepMeter`): MFU never prints above 100%.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.device import synchronize
from gpt2forge.core.file_lock import exclusive
from gpt2forge.core.precision import PRECISION_DTYPES, cpu_half_matmul_is_emulated, cpu_identity
from gpt2forge.train.metrics.lines import mfu_text

PEAK_FLOPS_READS = 4
"""Matmul reads of a CPU's peak at start-up when none is cached for this CPU (one read when one is:
the cached best is the floor), and at each re-read. Several, so that one read taken in a busy
moment (another process's burst, a clock still rising) cannot stand as the peak."""
READ_REPS = 4
"""Timed products per read, after one warm-up product."""
REREADS = 2
"""Re-reads a run may take when a step beats the peak; past them a faster step raises the peak to
its own rate (each re-read's time falls into the next step's)."""


# Dense peak FLOP/s by device-name substring and compute dtype (vendor data sheets, no sparsity).
# The first key found in the name wins: a longer name comes before its prefix (A100 before A10).
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},  # SXM; fp32 = TF32 tensor cores
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 62.5e12},
    "V100": {"bf16": None, "fp16": 125e12, "fp32": 15.7e12},
    "RTX 4090": {"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp16": 71e12, "fp32": 35.6e12},
}


def gpu_peak_flops(device: torch.device, precision: str) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, peaks in GPU_PEAK_FLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


GPU_READ_SIZE = 8192
"""n of the n x n x n products a GPU's peak is read with (three n x n matrices in the run's precision)."""


def read_gpu_peak_flops(device: torch.device, precision: str, n: int = GPU_READ_SIZE, reps: int = 10) -> float | None:
    """FLOP/s of this GPU's matmul in `precision` (fp32: TF32, as `configure_matmul` sets it), read
    now: the best of `reps` n x n x n products after a warm-up, each timed between two device
    synchronisations. None where the GPU has no room left for the three matrices."""
    dtype = PRECISION_DTYPES[precision]
    try:
        gen = torch.Generator(device).manual_seed(0)  # never the global RNG: a resumed run's dropout depends on it
        a = torch.randn(n, n, device=device, generator=gen, dtype=dtype)
        b = torch.randn(n, n, device=device, generator=gen, dtype=dtype)
        torch.mm(a, b)  # warm-up: the kernel choice, the clocks
        best = float("inf")
        for _ in range(reps):
            t0 = synchronize(device)
            torch.mm(a, b)
            best = min(best, synchronize(device) - t0)
    except torch.OutOfMemoryError:
        return None
    finally:
        a = b = None
        if device.type == "cuda":
            torch.cuda.empty_cache()  # give the matrices back to the run
    return 2.0 * n**3 / best


def in_run_peak_flops(device: torch.device, precision: str) -> float | None:
    """The peak read in this run to show beside the data sheet's MFU: a GPU's `read_gpu_peak_flops`; None
    elsewhere (a CPU's peak is a read already: `device_peak_flops`)."""
    return read_gpu_peak_flops(device, precision) if device.type == "cuda" else None


def cache_file() -> Path:
    """The per-CPU peak FLOP/s cache. Its name stays cpu_peak.json, so that the peaks earlier versions
    kept there remain the floor."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2forge" / "cpu_peak.json"


def measure_cpu_peak_flops(precision: str, n: int = 1024, reps: int = 8) -> float:
    """One read: FLOP/s of an n x n x n matmul in `precision` on this CPU, best of `reps`."""
    dtype = PRECISION_DTYPES[precision]
    gen = torch.Generator().manual_seed(0)  # never the global RNG: a resumed run's dropout depends on it
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool, packing buffers
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def cpu_peak_flops_key(precision: str) -> str:
    """The peak's cache key: the CPU's model and a digest of its flags, the threads torch uses and
    torch's version (`cpu_identity`), the CPUs usable, the precision. A peak read on another machine
    class, thread count or share of the machine is never taken for this one's."""
    return f"{cpu_identity()}|{usable_cpus()} cpus|{precision}"


def _read_cache() -> dict:
    try:
        cache = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


@contextlib.contextmanager
def _cache_locked():
    """Holds the cache's lock file, so that two processes' read-merge-write never interleave (the
    slower read written over the faster); no lock where the folder cannot be written."""
    lock = cache_file().with_suffix(".lock")
    with contextlib.suppress(OSError):
        lock.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(lock, best_effort=True):
        yield


def remember_cpu_peak_flops(precision: str, flops: float) -> float:
    """Merge a measured peak into the per-CPU cache, which only ever rises; returns the best this
    CPU has shown (`flops` or the cached value, whichever is higher)."""
    key = cpu_peak_flops_key(precision)
    with _cache_locked():
        cache = _read_cache()
        best = max(float(cache.get(key, 0.0)), flops)
        if best != cache.get(key):
            cache[key] = best
            try:
                write_atomic(cache_file(), json.dumps(cache, indent=1))
            except OSError:
                pass  # a read-only home only costs a re-measurement next time
    return best


def read_cpu_peak_flops(precision: str, reads: int = PEAK_FLOPS_READS) -> float:
    """The best of `reads` reads (`READ_REPS` products each) merged into the cache: the best this CPU
    has shown in `precision`, in FLOP/s."""
    best = max(measure_cpu_peak_flops(precision, reps=READ_REPS) for _ in range(reads))
    return remember_cpu_peak_flops(precision, best)


def cpu_peak_flops(precision: str) -> float:
    """This CPU's peak in `precision` at start-up: `PEAK_FLOPS_READS` reads when none is cached, one when
    one is (the cache is the floor, so a slow read cannot lower it; a fast one raises it). An
    emulated precision's read takes orders of magnitude longer: read once, then kept as cached."""
    cached = _read_cache().get(cpu_peak_flops_key(precision))
    emulated = cpu_half_matmul_is_emulated(precision)
    if cached is None:
        return read_cpu_peak_flops(precision, 1 if emulated else PEAK_FLOPS_READS)
    return float(cached) if emulated else read_cpu_peak_flops(precision, 1)


def _training_precisions(precision: str) -> tuple[str, ...]:
    """The matmul precisions whose best is a CPU's peak for training in `precision`: autocast training
    does much of its work in fp32, and a CPU without native bf16/fp16 kernels runs those matmuls
    slower than fp32 (emulated), so the peak is the faster of the two."""
    return ("fp32",) if precision == "fp32" else (precision, "fp32")


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s for MFU, or None when unknown (printed as 'unknown')."""
    if device.type == "cuda":
        return gpu_peak_flops(device, precision)
    if device.type == "cpu":
        return max(cpu_peak_flops(p) for p in _training_precisions(precision))
    return None


def peak_flops_reader(device: torch.device, precision: str) -> Callable[[], float] | None:
    """What re-reads the device's peak when a step beats it (`StepMeter`'s `reread_peak_flops`): on a CPU,
    `PEAK_FLOPS_READS` fresh reads of each native precision the peak takes, merged into the cache; None
    on a GPU, whose peak is its data sheet's."""
    if device.type != "cpu":
        return None
    native = tuple(p for p in _training_precisions(precision) if not cpu_half_matmul_is_emulated(p))
    return lambda: max(read_cpu_peak_flops(p) for p in native)


def _flops_text(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


class StepMeter:
    """Turns a host step's wall time into samples/s, tokens/s and MFU, never over 100%.

    A step whose training FLOP/s beat the peak proves the peak low: the meter re-reads it
    (`reread_peak_flops`, at most `REREADS` times) and, where the step still beats it, raises the peak to
    the step's rate. That step's MFU is marked `~` (uncertain), and so is every later one once the
    peak is a step's rate rather than a matmul's (an upper bound of the true MFU); a line on stdout
    says what happened.
    """

    def __init__(self, samples_per_step: int, seq_len: int, flops_per_token: float, peak_flops: float | None,
                 reread_peak_flops: Callable[[], float] | None = None, peak_flops_read: float | None = None):
        self.samples_per_step = samples_per_step
        self.seq_len = seq_len
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.peak_flops_read = peak_flops_read
        """The job's peak FLOP/s read in this run (`in_run_peak_flops`), shown beside a GPU's data-sheet
        MFU; None on a CPU."""
        self.reread_peak_flops = reread_peak_flops
        self.rereads_left = REREADS if reread_peak_flops is not None else 0
        self.peak_flops_is_a_step_rate = False
        self.last_uncertain = False
        """Whether the MFU of the last step `rates` measured is uncertain (marked `~`)."""

    def rates(self, seconds: float) -> tuple[float, float, str]:
        """(samples/s, tokens/s, MFU text as the step line prints it: "12.3%", "~97.0%" when
        uncertain, or "unknown"); raises the peak first where this step beat it."""
        samples = self.samples_per_step / seconds
        tokens = samples * self.seq_len
        achieved = tokens * self.flops_per_token
        beaten = self.peak_flops is not None and achieved > self.peak_flops
        if beaten:
            self._raise_peak_flops(achieved)
        self.last_uncertain = beaten or self.peak_flops_is_a_step_rate
        return samples, tokens, mfu_text(self.mfu(tokens), self.last_uncertain)

    def mfu(self, tokens_per_sec: float) -> float | None:
        """MFU as a fraction (0.123 = 12.3%), None when the device peak is unknown."""
        return tokens_per_sec * self.flops_per_token / self.peak_flops if self.peak_flops else None

    def read_mfu(self, tokens_per_sec: float) -> float | None:
        """MFU against `peak_flops_read` as a fraction, None without one."""
        return tokens_per_sec * self.flops_per_token / self.peak_flops_read if self.peak_flops_read else None

    def _raise_peak_flops(self, achieved: float) -> None:
        """A step ran at `achieved` FLOP/s, above the peak: re-read it, else raise it to `achieved`."""
        said = f"MFU: a step ran at {_flops_text(achieved)}, above the peak ({_flops_text(self.peak_flops)})"
        if self.rereads_left > 0:
            self.rereads_left -= 1
            read = self.reread_peak_flops()
            self.peak_flops = max(self.peak_flops, read)  # never lowered
            said += f"; re-read: {_flops_text(read)}"
        elif self.peak_flops_is_a_step_rate:  # said once already
            self.peak_flops = achieved
            return
        if achieved > self.peak_flops:
            self.peak_flops = achieved
            self.peak_flops_is_a_step_rate = True
            said += "; the peak is now the step's rate, so MFU figures marked ~ are upper bounds"
        else:
            said += "; this step's MFU is marked ~"
        log.info(said)
