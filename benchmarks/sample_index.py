"""Sample-index build time: the C++ op `gpt2forge::build_sample_idx` vs its numpy reference, one run.

The input is what `--dataset mmap` builds for a corpus of `--tokens` tokens: synthetic document
sizes (uniform in [1, 2 * mean), mean `--tokens / --docs`), one epoch of document ids shuffled as
Megatron shuffles them, `--seq-length` tokens per sample. Both implementations get the same
arrays; their outputs are compared for equality; each is timed `--repeats` times, interleaved
(C++, numpy, C++, ...) so background load hits both alike, and the best time counts.
The reference is vectorized numpy (cumsum + searchsorted), far faster than Megatron's own
Python-loop `_build_sample_idx` (what Megatron's helpers.cpp replaced); `--megatron-loop` times that
loop too, once. The op uses OpenMP threads on inputs of 2^17 documents or more (OMP_NUM_THREADS, or
torch.set_num_threads, decides how many); the numpy reference runs on one core.
Target: C++ at least 20x faster than the numpy reference (reported, not enforced: exit 0).

    .venv/bin/python benchmarks/sample_index.py                      # 1e9 tokens, 2e6 documents
    .venv/bin/python benchmarks/sample_index.py --tokens 1e7 --docs 2e4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.data import mmap  # noqa: E402
from gpt2forge.ops.library import load_custom_ops  # noqa: E402

TARGET = 20.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=float, default=1e9, help="corpus size in tokens")
    p.add_argument("--docs", type=float, default=2e6, help="number of documents")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sample (--max-len)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each implementation")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--megatron-loop", action="store_true",
                   help="also time Megatron's Python-loop _build_sample_idx once (slow: ~1 us/sample)")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


def megatron_loop(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch) -> np.ndarray:
    """Megatron-LM's `_build_sample_idx` (megatron/data/gpt_dataset.py), as written there."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int32)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining_seq_length = seq_length + 1
        while remaining_seq_length != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining_seq_length -= doc_length
            if remaining_seq_length <= 0:
                doc_offset += remaining_seq_length + doc_length - 1
                remaining_seq_length = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index][0] = doc_idx_index
        sample_idx[sample_index][1] = doc_offset
        sample_index += 1
    return sample_idx


def synthetic_input(tokens: int, docs: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(sizes int32, one shuffled epoch of doc ids int32, tokens per epoch)."""
    rng = np.random.RandomState(seed)
    mean = max(tokens // docs, 1)
    sizes = rng.randint(1, 2 * mean, size=docs).astype(np.int32)
    doc_idx = mmap.build_doc_idx(np.arange(docs), 1, rng, False)
    return sizes, doc_idx, int(sizes.sum(dtype=np.int64))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not load_custom_ops():
        print("error: the custom ops library is not built; run `make` first", file=sys.stderr)
        return 2
    sizes, doc_idx, tokens = synthetic_input(int(args.tokens), int(args.docs), args.seed)
    call = (sizes, doc_idx, args.seq_length, 1, tokens)
    print(f"input: {len(sizes)} documents, {tokens} tokens, seq length {args.seq_length}, "
          f"{(tokens - 1) // args.seq_length} samples; {platform.processor() or platform.machine()}")
    impls = {"C++ op": mmap.build_sample_idx, "numpy reference": mmap.build_sample_idx_reference}
    best = {name: float("inf") for name in impls}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            outputs[name] = fn(*call)
            best[name] = min(best[name], time.perf_counter() - t0)
    if args.megatron_loop:
        t0 = time.perf_counter()
        loop = megatron_loop(*call)
        best["Megatron loop"] = time.perf_counter() - t0
        assert np.array_equal(loop, outputs["C++ op"]), "Megatron's loop disagrees with the op"
    equal = np.array_equal(outputs["C++ op"], outputs["numpy reference"])
    ratio = best["numpy reference"] / best["C++ op"]
    for name, secs in best.items():
        print(f"{name:16s} {secs * 1e3:10.1f} ms  ({tokens / secs / 1e9:.2f} G tokens/s)")
    verdict = "met" if ratio >= TARGET else "MISSED"
    print(f"speed-up vs numpy reference {ratio:.1f}x (target {TARGET:.0f}x: {verdict}); outputs equal: {equal}")
    if args.megatron_loop:
        print(f"speed-up vs Megatron's Python loop {best['Megatron loop'] / best['C++ op']:.0f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": tokens, "documents": len(sizes),
                                               "seq_length": args.seq_length, "best_s": best,
                                               "speedup": ratio, "equal": equal}, indent=1))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
