"""Expected training tokens/s of GPT-2 small..XL on 1, 8 and 64 GPUs (the model in docs/scaling.md).

Per update, each of n data-parallel GPUs computes its share of the global batch in t_1 (the
single-GPU step time for that share: measured, or derived from an MFU) and then all-reduces the
gradient: a ring all-reduce moves 2 (n-1)/n x P x b bytes per GPU (P parameters, b bytes per
gradient value) at the slowest link's bandwidth: NVLink inside a node, the node's network share
across nodes, of which NCCL reaches a share e (bus efficiency). DDP overlaps the all-reduce with
the backward pass (about 2/3 of the step) bucket by bucket; the last bucket (25 MB) only starts
when backward ends, so it is always exposed:

    t_comm   = 2 (n-1)/n * P * b / (e * bandwidth)
    t_last   = 2 (n-1)/n * min(25 MB, P * b) / (e * bandwidth)
    t_update = t_1 + max(t_last, t_comm - overlap * t_1)     overlap = 2/3, e = 0.7 by default
    tokens/s = n * tokens_per_gpu / t_update

ZeRO-1 moves the same bytes (reduce-scatter + all-gather); ZeRO-3 adds one parameter all-gather in
forward and one in backward (3x the ZeRO-1 volume). Pipeline stages add the bubble (S-1)/(M+S-1).

    .venv/bin/python benchmarks/scaling_model.py                       # H100 SXM, 40% MFU, bf16 grads
    .venv/bin/python benchmarks/scaling_model.py --tokens-per-sec gpt2=180000   # your measured 1-GPU figure
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt2forge.model.config import ModelConfig  # noqa: E402

MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def expected_tokens_per_sec(params: int, tokens_1: float, tokens_per_gpu: int, gpus: int, gpus_per_node: int,
                            nvlink_gbs: float, network_gbs: float, grad_bytes: int, overlap: float,
                            bus_efficiency: float = 0.7, zero3: bool = False) -> float:
    """Aggregate tokens/s of `gpus` data-parallel GPUs, each processing `tokens_per_gpu` per update."""
    t_1 = tokens_per_gpu / tokens_1
    if gpus == 1:
        return tokens_1
    bandwidth = bus_efficiency * 1e9 * (nvlink_gbs if gpus <= gpus_per_node else network_gbs / gpus_per_node)
    ring = 2 * (gpus - 1) / gpus
    t_comm = ring * params * grad_bytes * (3 if zero3 else 1) / bandwidth
    t_last = ring * min(25e6, params * grad_bytes) / bandwidth
    return gpus * tokens_per_gpu / (t_1 + max(t_last, t_comm - overlap * t_1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-tflops", type=float, default=989.0, help="GPU dense bf16 peak (H100 SXM: 989)")
    p.add_argument("--mfu", type=float, default=0.40, help="assumed single-GPU MFU when no measured figure is given")
    p.add_argument("--tokens-per-sec", nargs="*", default=[], metavar="MODEL=TOK_S",
                   help="measured single-GPU tokens/s per model (overrides --mfu for that model)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--tokens-per-gpu", type=int, default=64 * 1024, help="tokens per GPU per update")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbs", type=float, default=450.0, help="all-reduce bandwidth inside a node, GB/s per GPU")
    p.add_argument("--network-gbs", type=float, default=400.0, help="network bandwidth per node, GB/s (8x400 Gb/s IB)")
    p.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient value in the all-reduce (bf16: 2)")
    p.add_argument("--overlap", type=float, default=2 / 3, help="share of the step the all-reduce can hide behind")
    p.add_argument("--bus-efficiency", type=float, default=0.7, help="share of the link bandwidth NCCL reaches")
    p.add_argument("--zero3", action="store_true", help="ZeRO-3: 3x the communication volume")
    args = p.parse_args(argv)
    measured = dict(kv.split("=", 1) for kv in args.tokens_per_sec)
    print(f"seq {args.seq_len}, {args.tokens_per_gpu} tokens/GPU/update, NVLink {args.nvlink_gbs:g} GB/s, "
          f"network {args.network_gbs:g} GB/s per node of {args.gpus_per_node}, {args.grad_bytes}-byte gradients"
          f"{', ZeRO-3' if args.zero3 else ''}")
    print(f"{'model':<12} {'params':>7} {'1-GPU tok/s':>12} {'source':>10} {'8 GPUs':>11} {'64 GPUs':>11} "
          f"{'64-GPU eff.':>11}")
    for name in MODELS:
        cfg = ModelConfig.preset(name)
        params = cfg.num_params()
        if name in measured:
            tokens_1, source = float(measured[name]), "measured"
        else:
            tokens_1 = args.mfu * args.peak_tflops * 1e12 / cfg.flops_per_token(args.seq_len)
            source = f"{args.mfu:.0%} MFU"
        rates = [expected_tokens_per_sec(params, tokens_1, args.tokens_per_gpu, n, args.gpus_per_node,
                                         args.nvlink_gbs, args.network_gbs, args.grad_bytes, args.overlap,
                                         args.bus_efficiency, args.zero3)
                 for n in (8, 64)]
        print(f"{name:<12} {params / 1e6:>6.0f}M {tokens_1:>12,.0f} {source:>10} {rates[0]:>11,.0f} {rates[1]:>11,.0f} "
              f"{rates[1] / (64 * tokens_1):>11.0%}")
    print("64-GPU eff. = 64-GPU tokens/s / (64 x 1-GPU tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
