"""Memory and time of the fused chunked LM head + loss against the plain logits + cross-entropy path.

Two measurements, each variant in its own fresh process (so peak memory is its own), side by side:

  op     the loss alone, forward + backward, hidden (N, C) against the tied embedding (V, C):
         plain      logits = h @ W.T (padded columns at -inf), F.cross_entropy(sum), backward
         fused      gpt2forge.ops.lm_head_loss with the C++ kernel (the default when `make` built it)
         reference  the same chunked algorithm in PyTorch (the fallback without the library)
  train  whole training steps of a GPT-2 shape (forward, loss, backward, AdamW) with
         `--lm-loss plain` vs `--lm-loss fused` math (eager, as the trainer's model runs them),
         optionally with activation checkpointing of every block in both.

Peak memory: CUDA max_memory_allocated; CPU the process's peak resident set (VmHWM) minus its
resident set just before the measured work (the inputs, weights and optimizer state are
allocated first and counted in "base"). Time: the best of --repeats after one warm-up.

    .venv/bin/python benchmarks/lm_head_memory.py op                        # N=8192, V=50304, C=768
    .venv/bin/python benchmarks/lm_head_memory.py train --batch-size 8 --seq-len 1024
    .venv/bin/python benchmarks/lm_head_memory.py op --tokens 1024 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OP_TARGET = 1.0  # fused time / plain time on CPU: no slower
TRAIN_MEMORY_TARGET = 0.6  # fused peak / plain peak


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", choices=("op", "train"))
    p.add_argument("--tokens", type=int, default=8192, help="op: rows N")
    p.add_argument("--vocab", type=int, default=50304, help="op: padded vocabulary V (real: 50257)")
    p.add_argument("--embd", type=int, default=768, help="op: C")
    p.add_argument("--model", default="gpt2", help="train: model preset")
    p.add_argument("--batch-size", type=int, default=8, help="train: B")
    p.add_argument("--seq-len", type=int, default=1024, help="train: T")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--recompute", action="store_true", help="train: checkpoint every block in both variants")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions (best is reported)")
    p.add_argument("--device", default="auto")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _measure(fn, device, repeats: int, release=lambda: None) -> dict:
    """Best time of `fn` and its memory above what is held before it; `release` frees what a call
    leaves behind (gradients) so the baseline does not already hold it."""
    import torch

    fn()  # warm-up: thread pools, allocator, libraries
    release()
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_bytes("VmRSS")
        _reset_hwm()
    best = float("inf")
    for _ in range(repeats):
        release()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_bytes("VmHWM")
    return {"seconds": best, "base_gib": base / 2**30, "extra_gib": (peak - base) / 2**30}


def child_op(args, variant: str) -> dict:
    import torch
    import torch.nn.functional as F

    import gpt2forge.ops.lm_head_loss as lhl
    from gpt2forge.core.device import resolve_device
    from gpt2forge.core.precision import autocast

    device = resolve_device(args.device)
    V = 50257 if args.vocab >= 50257 else args.vocab
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.embd, generator=g).to(device).requires_grad_()
    W = (torch.randn(args.vocab, args.embd, generator=g) * 0.02).to(device).requires_grad_()
    y = torch.randint(0, V, (args.tokens,), generator=g).to(device)
    if variant == "reference":
        lhl._use_kernel = lambda hidden: False
    elif variant == "fused" and device.type == "cpu" and not lhl._use_kernel(h):
        raise SystemExit("fused: the custom ops library is not built; run `make`")

    def release():
        h.grad = W.grad = None

    def step():
        with autocast(device, args.precision):
            if variant == "plain":
                logits = h @ W.T
                logits[:, V:] = float("-inf")
                loss = F.cross_entropy(logits.float(), y, reduction="sum")
            else:
                loss = lhl.fused_lm_head_loss(h, W, y, V)[0]
        loss.backward()
        return loss

    result = _measure(step, device, args.repeats, release)
    release()
    loss = step()  # what the variant computes, for the parent's comparison with plain's
    result.update(loss=float(loss), grad_hidden_norm=float(h.grad.norm()), grad_weight_norm=float(W.grad.norm()))
    return result


def child_train(args, variant: str) -> dict:
    import torch

    from gpt2forge.core.device import resolve_device
    from gpt2forge.core.precision import autocast
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    from gpt2forge.ops.lm_head_loss import LossChunking
    from gpt2forge.train.memory_features import apply_activation_checkpointing
    from gpt2forge.train.optim import build_optimizer

    device = resolve_device(args.device)
    torch.manual_seed(0)
    cfg = dataclasses.replace(ModelConfig.preset(args.model), n_positions=max(1024, args.seq_len))
    model = GPT2LMHeadModel(cfg).to(device)
    model.init_weights()
    model.fused_loss = LossChunking() if variant == "fused" else None
    if args.recompute:
        apply_activation_checkpointing(model, range(cfg.n_layer))
    opt = build_optimizer(model, "AdamW", 1e-4, 0.01, device_type=device.type)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)

    def step():
        with autocast(device, args.precision):
            out = model(ids[:, :-1], ids[:, 1:])
        (out.loss_sum / out.tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    result = _measure(step, device, args.repeats)
    result["tokens_per_s"] = args.batch_size * args.seq_len / result["seconds"]
    return result


def run_child(argv: list[str], variant: str) -> dict:
    cmd = [sys.executable, __file__, *argv, "--child", variant]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        fn = child_op if args.what == "op" else child_train
        print(json.dumps(fn(args, args.child)))
        return 0
    variants = ("plain", "fused") if args.what == "train" else ("plain", "fused", "reference")
    device_type = args.device.split(":")[0]
    if args.what == "op" and device_type not in ("cpu", "auto"):
        variants = ("plain", "fused")  # off the CPU the fused op is the reference
    shape = (f"N={args.tokens} V={args.vocab} C={args.embd}" if args.what == "op" else
             f"{args.model} B={args.batch_size} T={args.seq_len}{' recompute' if args.recompute else ''}")
    print(f"{args.what}: {shape}, {args.precision}, best of {args.repeats}")
    results = {v: run_child(argv, v) for v in variants}
    print(f"{'variant':<10} {'seconds':>8} {'extra GiB':>10} {'base GiB':>9}" +
          (f" {'tokens/s':>9}" if args.what == "train" else ""))
    for v, r in results.items():
        if "error" in r:
            print(f"{v:<10} error: {r['error']}")
            continue
        line = f"{v:<10} {r['seconds']:8.3f} {r['extra_gib']:10.3f} {r['base_gib']:9.3f}"
        print(line + (f" {r['tokens_per_s']:9.1f}" if args.what == "train" else ""))
    p, f = results["plain"], results["fused"]
    if "error" not in p and "error" not in f:
        if args.what == "op":
            print(f"fused / plain: time {f['seconds'] / p['seconds']:.2f}x (target <= {OP_TARGET}), "
                  f"extra memory {f['extra_gib'] / p['extra_gib']:.3f}x")
            for v, r in results.items():  # the same function: relative differences from plain's
                if v != "plain" and "error" not in r:
                    diffs = ", ".join(f"{k} {abs(r[k] - p[k]) / max(abs(p[k]), 1e-30):.1e}"
                                      for k in ("loss", "grad_hidden_norm", "grad_weight_norm"))
                    print(f"{v} against plain, relative differences: {diffs}")
        else:
            tot = [(r["base_gib"] + r["extra_gib"]) for r in (f, p)]
            print(f"fused / plain: peak memory {tot[0] / tot[1]:.2f}x (target <= {TRAIN_MEMORY_TARGET}), "
                  f"tokens/s {f['tokens_per_s'] / p['tokens_per_s']:.2f}x (target >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
