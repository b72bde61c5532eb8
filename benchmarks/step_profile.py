"""Where one training step's time goes: GPT-2 small as `make train` trains it, profiled by category.

Builds ours exactly as `benchmarks/train_throughput.py` does (GPT-2 small shape, dropout 0.1,
`torch.compile`, the fused LM head + loss, fused AdamW, `step.train_step`) in `--precision` (bf16:
autocast over fp32 master weights, as the trainer), measures this CPU's matmul peak in that precision
in the same run (an n x n x n matmul, best of several, before and after the
steps: the best is kept), times the compile step and `--steps` steady steps, then profiles
`--profile-steps` steps with `torch.profiler` and sorts every operator's own time into:

  matmul: qkv / attention out / MLP / LM head   dense matmuls (aten::mm, addmm(_), bmm), by the weight
                                                 they multiply (read from the shapes; inside the
                                                 fused LM head op: LM head), forward and backward
  attention                                      the fused scaled-dot-product attention and its backward
  LM head + loss (other than its matmuls)        the custom op's own work (softmax, loss, gradients)
  dropout masks                                  drawing the keep-masks (gpt2forge::dropout_keep_mask)
  optimizer                                      everything under the optimizer step
  fused elementwise (inductor)                   torch.compile's generated kernels (layer norm, GELU,
                                                 dropout, residual adds)
  other operators                                the rest
  framework overhead                             the step's wall time not spent in any operator

and prints ms/step and the share of the step for each, tokens/s and MFU against the peak measured
here (`ModelConfig.flops_per_token`: 6N + the attention term); `--top N` lists each category's N
largest operators. Profiled steps run slower than unprofiled ones, and the memory-bound operators
(copies, big elementwise kernels) take most of the difference: a single operator's time can read
several times its unprofiled cost. The table says where to look; whether a change helps is decided
by an interleaved A/B of whole steps (train_throughput.py), not by this table.

    .venv/bin/python benchmarks/step_profile.py                          # B=4, T=256, as train_throughput
    .venv/bin/python benchmarks/step_profile.py --model gpt2-test --batch-size 2 --seq-len 32 --steps 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import _build_ours, _model_config  # noqa: E402

from gpt2forge.tools.machine_report import wait_for_quiet  # noqa: E402
from gpt2forge.train.metrics.peak_flops import measure_cpu_peak_flops  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")
ORDER = ("matmul: qkv", "matmul: attention out", "matmul: MLP", "matmul: LM head", "attention",
         "LM head + loss (other than its matmuls)", "dropout masks", "optimizer", "fused elementwise (inductor)",
         "other operators")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt2", help="gpt2forge model preset (config/)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steady steps (median reported)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for a 1-minute load below 0.5 before starting (0: report "
                        "the load at once, with a warning when the machine is not quiet)")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps (averaged)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="the step's precision and the peak's (bf16: autocast, as --precision bf16 trains)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--lm-loss", default="fused", choices=("fused", "plain"))
    p.add_argument("--json", default=None, help="write the breakdown here")
    p.add_argument("--top", type=int, default=0, help="also list each category's N largest operators")
    return p.parse_args(argv)


def matmul_kind(shapes: list[list[int]], C: int, vocab: int) -> str:
    """Which weight a dense matmul multiplies, from its operands' shapes (forward or backward)."""
    dims = {d for s in shapes for d in s}
    if vocab in dims:
        return "matmul: LM head"
    if 3 * C in dims:
        return "matmul: qkv"
    if 4 * C in dims:
        return "matmul: MLP"
    return "matmul: attention out"


def category(event, parents: list[str], C: int, vocab: int) -> str:
    name = event.name
    if any(p.startswith("Optimizer.step") for p in parents) or "adam" in name.lower():
        return "optimizer"
    if name in MATMULS:  # the fused head multiplies vocabulary tiles, so its shapes do not show the vocabulary
        in_head = any(p.startswith("gpt2forge::") for p in parents)
        return "matmul: LM head" if in_head else matmul_kind(event.input_shapes, C, vocab)
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if "dropout" in name or any("dropout" in p for p in parents):
        return "dropout masks"
    if name.startswith("gpt2forge::") or any(p.startswith("gpt2forge::") for p in parents):
        return "LM head + loss (other than its matmuls)"
    if "cpp_fused" in name or name.startswith("graph_"):
        return "fused elementwise (inductor)"
    return "other operators"


def breakdown(prof, steps: int, C: int, vocab: int) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """category -> ms per step of the operators' own (self) time, and (category, operator) -> ms."""
    ms, by_op = defaultdict(float), defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        parents, p = [], event.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        kind = category(event, parents, C, vocab)
        ms[kind] += event.self_cpu_time_total / 1e3 / steps
        by_op[kind, event.name] += event.self_cpu_time_total / 1e3 / steps
    return ms, by_op


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wait_for_quiet(args.wait_quiet)
    torch._inductor.config.cpp.enable_kernel_profile = True  # name inductor's kernels in the profile
    peak_flops = measure_cpu_peak_flops(args.precision)
    cfg = _model_config(args.model, args.seq_len)
    torch.manual_seed(args.seed)
    from gpt2forge.model.gpt2 import GPT2LMHeadModel

    model = GPT2LMHeadModel(cfg)
    # GPT-2's initialisation, as train_throughput and the trainer do: the constructor's default init
    # gives logits hundreds of nats apart, whose softmax is denormal, and on an Intel CPU the LM head's
    # matmuls over denormals ran an order of magnitude slower (docs/benchmarks.md, Design measurements).
    model.init_weights(torch.Generator().manual_seed(args.seed))
    step, info = _build_ours(args, torch.device("cpu"), args.precision, cfg, model)
    vocab = model.transformer.wte.weight.shape[0]  # padded rows: what the head multiplies
    gen = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)

    t0 = time.perf_counter()
    step(batch)
    compile_s = time.perf_counter() - t0
    step(batch)  # warm-up after compiling
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            step(batch)
        profiled_s = (time.perf_counter() - t0) / args.profile_steps
    peak_flops = max(peak_flops, measure_cpu_peak_flops(args.precision))

    ms, by_op = breakdown(prof, args.profile_steps, cfg.n_embd, vocab)
    ms["framework overhead"] = max(profiled_s * 1e3 - sum(ms.values()), 0.0)
    tokens = args.batch_size * args.seq_len
    fpt = cfg.flops_per_token(args.seq_len)
    print(f"{args.model}, B={args.batch_size}, T={args.seq_len}, {args.precision}, {torch.get_num_threads()} threads; "
          f"{info['optimizer']}, compiled {info['compiled']}, LM loss {info['lm_loss']}")
    print(f"{args.precision} matmul peak measured in this run: {peak_flops / 1e9:.1f} GFLOP/s")
    print(f"compile step {compile_s:.1f} s; steady step {step_s:.3f} s (median of {args.steps}), "
          f"profiled step {profiled_s:.3f} s (the profiler's own cost included)")
    print(f"\n{'category':42s} {'ms/step':>9s} {'share':>7s}")
    total = sum(ms.values())
    for kind in (*ORDER, "framework overhead"):
        print(f"{kind:42s} {ms[kind]:9.1f} {ms[kind] / total:7.1%}")
        ops = sorted(((v, name) for (k, name), v in by_op.items() if k == kind), reverse=True)
        for v, name in ops[:args.top]:
            print(f"    {name[:38]:38s} {v:9.1f}")
    matmul_ms = sum(v for k, v in ms.items() if k.startswith("matmul"))
    print(f"{'all matmuls':42s} {matmul_ms:9.1f} {matmul_ms / total:7.1%}")
    mfu = tokens / step_s * fpt / peak_flops
    print(f"\ntokens/s {tokens / step_s:.1f}; MFU {mfu:.1%} of the peak measured here ({fpt / 1e6:.0f} MFLOP/token)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "peak_flops": peak_flops, "compile_s": compile_s, "step_s": step_s,
            "profiled_step_s": profiled_s, "ms_per_step": dict(ms),
            "tokens_per_s": tokens / step_s, "mfu": mfu}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
