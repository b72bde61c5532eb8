"""Host optimizer step: the C++ AdamW op against torch.optim.AdamW and DeepSpeedCPUAdam, same run.

`HostAdamW` updates each param group in one call of the multi-tensor op; the row "C++ op, per
tensor" calls the one-tensor op once per tensor instead (one parallel region each, as before the
multi-tensor op), so the gain of the single call shows within one run.

With --optimizer-state-offchip the update runs on the CPU over fp32 master weights and moments.
Each round times every contender in turn (interleaved, so a change in machine load hits them all)
on the tensor shapes of a real GPT-2 model: one step reads p, g, m, v and writes p, m, v, 28 bytes
per parameter (+2 with the bf16 device copy), so the figure that matters is GB/s against the
machine's memory bandwidth, measured here by a STREAM-like triad in the same run.

    python benchmarks/host_optimizer.py --params 124M,774M        # GPT-2 small and large shapes
    python benchmarks/host_optimizer.py --quick                   # a tiny shape: does it run

DeepSpeedCPUAdam is timed when `deepspeed` imports and its cpu_adam op builds (ninja, a C++
compiler); otherwise its row says how to install it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.ops import host_optim

SIZES = {"124M": "gpt2", "355M": "gpt2-medium", "774M": "gpt2-large", "1.5B": "gpt2-xl"}
QUICK = ModelConfig(vocab_size=4099, n_positions=64, n_embd=128, n_layer=2, n_head=2)
DEEPSPEED_INSTALL = "pip install deepspeed  (its cpu_adam op builds with ninja and a C++ compiler)"
LR, BETAS, EPS, DECAY = 6e-4, (0.9, 0.999), 1e-8, 0.1


def model_shapes(config: ModelConfig) -> list[torch.Size]:
    """The trainable parameter shapes of a GPT-2 of `config` (tied head once), without allocating it."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return [p.shape for _, p in model.named_parameters()]


def triad_gbs(elements: int, repeats: int = 5) -> float:
    """STREAM-like triad a = b + 3c with all threads: best GB/s (3 arrays of 4-byte floats move)."""
    a, b, c = (torch.ones(elements) for _ in range(3))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t0)
    return 3 * elements * 4 / best / 1e9


def deepspeed_adam() -> Callable | str:
    """A factory of DeepSpeedCPUAdam (AdamW mode), or the reason it cannot run."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # why: optional, timed only when installed
    except ImportError as exc:
        return f"not installed ({exc.name}): {DEEPSPEED_INSTALL}"
    probe = [torch.nn.Parameter(torch.zeros(8))]
    try:
        DeepSpeedCPUAdam(probe, lr=LR)  # builds cpu_adam on first use
    except Exception as exc:  # noqa: BLE001 - any build or load failure only drops this row
        return f"cpu_adam did not build ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return lambda params: DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                                           adamw_mode=True)


class PerTensorHostAdamW(host_optim.HostAdamW):
    """HostAdamW calling `adamw_step_` once per tensor rather than `multi_tensor_adamw_` once per group."""

    def _kernel_step(self, group: dict, lists: list[list], steps: list[torch.Tensor]) -> None:
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = group["betas"]
        for p, g, m, v, copy, step in zip(*lists[:4], lists[4] or [None] * len(steps), steps):
            host_optim.adamw_step_(p, g, m, v, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                   weight_decay=group["weight_decay"], step=step.item(), device_copy=copy)


def contenders(with_copy: bool) -> dict[str, Callable | str]:
    """name -> optimizer factory over a parameter list, or why that row is skipped."""
    found: dict[str, Callable | str] = {}
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    if host_optim.kernel_available():
        found["C++ op (HostAdamW)"] = lambda params: host_optim.HostAdamW(params, **hyper)
        found["C++ op, per tensor"] = lambda params: PerTensorHostAdamW(params, **hyper)
    else:
        found["C++ op (HostAdamW)"] = found["C++ op, per tensor"] = "custom ops library not built: run `make`"
    found["torch AdamW foreach"] = lambda params: torch.optim.AdamW(params, **hyper, foreach=True)
    found["torch AdamW fused"] = lambda params: torch.optim.AdamW(params, **hyper, fused=True)
    found["DeepSpeedCPUAdam"] = "bf16 device copy not comparable" if with_copy else deepspeed_adam()
    return found


def time_steps(make: Callable, params: list[torch.nn.Parameter], steps: int, with_copy: bool) -> float:
    """Seconds per step of a fresh optimizer (one untimed step first allocates its state)."""
    opt = make(params)
    copies = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in params} if with_copy else {}
    if isinstance(opt, host_optim.HostAdamW):
        opt.device_copies.update(copies)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
        if copies and not isinstance(opt, host_optim.HostAdamW):  # the separate pass the op saves
            for p in params:
                copies[p].copy_(p)
    seconds = (time.perf_counter() - t0) / steps
    del opt
    gc.collect()
    return seconds


def bench(label: str, shapes: list[torch.Size], rounds: int, steps: int, with_copy: bool,
          triad: float) -> None:
    n = sum(s.numel() for s in shapes)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    rows = contenders(with_copy)
    times: dict[str, list[float]] = {name: [] for name, make in rows.items() if callable(make)}
    names = list(times)
    for r in range(rounds):  # each round starts one contender later: none always runs first
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_steps(rows[name], params, steps, with_copy))
    moved = n * (28 + (2 if with_copy else 0))
    print(f"\n{label}: {n / 1e6:.1f}M parameters in {len(shapes)} tensors, {moved / 1e9:.2f} GB moved per step"
          f"{' (with the bf16 device copy)' if with_copy else ''}; median of {rounds} rounds x {steps} steps\n"
          "  (speedup: the median over rounds of the ratio within a round, as the bandwidth drifts between rounds)")
    ours = times.get("C++ op (HostAdamW)")
    print(f"  {'optimizer':<22} {'ms/step':>9} {'GB/s':>7} {'of triad':>9} {'C++ op speedup':>15}")
    for name, make in rows.items():
        if not callable(make):
            print(f"  {name:<22} skipped: {make}")
            continue
        t = statistics.median(times[name])
        speedup = f"{statistics.median(x / y for x, y in zip(times[name], ours)):.2f}x" if ours else "-"
        print(f"  {name:<22} {t * 1e3:>9.1f} {moved / t / 1e9:>7.1f} {moved / t / 1e9 / triad:>8.0%} {speedup:>15}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="124M", help=f"comma-separated GPT-2 sizes, of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per optimizer and round (default 3)")
    parser.add_argument("--bf16-copy", action="store_true",
                        help="also write the bf16 device copy of the weights (the op: same pass; torch: copy_)")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 1 round: checks that it runs")
    args = parser.parse_args(argv)
    unknown = [s for s in args.params.split(",") if s not in SIZES]
    if unknown and not args.quick:
        print(f"error: --params {','.join(unknown)}: choose from {', '.join(SIZES)}", file=sys.stderr)
        return 2

    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, load average {load:.2f} on {os.cpu_count()} cores, "
          f"custom op ISA {torch.ops.gpt2forge.host_optim_isa() if host_optim.kernel_available() else 'n/a'}")
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.2f}: other work shares the CPU and memory bus; figures are low "
              "and noisy", file=sys.stderr)
    triad = triad_gbs(1 << (20 if args.quick else 26))
    print(f"memory bandwidth (triad, {torch.get_num_threads()} threads): {triad:.1f} GB/s")
    runs = [("quick", QUICK)] if args.quick else [(s, ModelConfig.preset(SIZES[s])) for s in args.params.split(",")]
    for label, config in runs:
        rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
        bench(label, model_shapes(config), rounds, steps, args.bf16_copy, triad)
    return 0


if __name__ == "__main__":
    sys.exit(main())
