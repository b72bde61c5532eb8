"""Blend-order build time: the C++ op `gpt2forge::build_blending_indices` vs its Python reference
and Megatron-Core's own C++ helper, one run.

A weighted blend (`--data-path 0.5 A 0.3 B 0.2 C`) orders its samples with Megatron's greedy rule
(gpt2forge/data/blend.py); each choice depends on all earlier ones, so the build is one sequential
loop over samples x corpora. This times it for `--samples` samples of `--corpora` corpora with
random weights: ours (the op), the pure-Python reference (the fallback without the custom ops
library), and `megatron.core.datasets.helpers_cpp.build_blending_indices` when megatron-core is
installed (its compiled module is loaded alone, without the rest of the package). Every result is
checked equal to ours. Each is timed `--repeats` times, interleaved, and the best time counts;
the Python reference is timed on `--python-samples` samples (it is linear in the samples) and
its time per sample is printed.

    .venv/bin/python benchmarks/blend_order.py                               # 1e7 samples, 3 corpora
    .venv/bin/python benchmarks/blend_order.py --corpora 100 --samples 1e6
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.data import blend  # noqa: E402
from gpt2forge.ops.library import has_op  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=float, default=1e7)
    p.add_argument("--corpora", type=int, default=3)
    p.add_argument("--python-samples", type=float, default=1e6, help="samples the Python reference builds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def megatron_helpers():
    """megatron-core's compiled helpers module, loaded from its file, or None."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "core" / "datasets"
    found = sorted(folder.glob("helpers_cpp*.so"))
    if not found:
        return None
    loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", str(found[0]))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("helpers_cpp", loader))
    loader.exec_module(module)
    return module


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not has_op("build_blending_indices"):
        sys.exit("the custom ops library is not built (or lacks build_blending_indices): run `make custom_ops`")
    size, small = int(args.samples), int(min(args.python_samples, args.samples))
    weights = blend.normalize(np.random.default_rng(args.seed).random(args.corpora) + 0.01)
    helpers = megatron_helpers()

    def megatron(n):
        index, sample = np.zeros(n, dtype=np.int16), np.zeros(n, dtype=np.int64)
        helpers.build_blending_indices(index, sample, np.array(weights), len(weights), n, False)
        return index, sample

    times = {"ours": float("inf"), "megatron-core": float("inf")}
    for _ in range(args.repeats):  # interleaved
        t, ours = best_of(lambda: blend.blending_indices(weights, size), 1)
        times["ours"] = min(times["ours"], t)
        if helpers is not None:
            t, theirs = best_of(lambda: megatron(size), 1)
            times["megatron-core"] = min(times["megatron-core"], t)
            assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), "megatron-core's order differs"
    t_py, ref = best_of(lambda: blend.blending_indices_reference(weights, small), 1)
    assert all(np.array_equal(a[:small], b) for a, b in zip(ours, ref)), "the Python reference's order differs"

    print(f"{size:,} samples of {args.corpora} corpora (best of {args.repeats})")
    print(f"  ours (C++ op)       {times['ours']:8.3f} s  {times['ours'] / size * 1e9:7.1f} ns/sample")
    if helpers is not None:
        print(f"  megatron-core C++   {times['megatron-core']:8.3f} s  "
              f"{times['megatron-core'] / size * 1e9:7.1f} ns/sample   ours / megatron-core "
              f"{times['ours'] / times['megatron-core']:.2f}x the time; arrays equal")
    else:
        print("  megatron-core       not installed (pip install megatron-core) or its helpers do not load")
    per = t_py / small
    print(f"  Python reference    {t_py:8.3f} s for {small:,} samples  {per * 1e9:7.1f} ns/sample   "
          f"ours is {per / (times['ours'] / size):.0f}x faster; arrays equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
