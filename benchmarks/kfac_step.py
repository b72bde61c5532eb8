"""K-FAC step time against AdamW alone (issue 23): the overhead at factor/inverse intervals 5/50 and 1/10.

    .venv/bin/python benchmarks/kfac_step.py                 # the `make train` shape: config_mini, B=8, T=128
    .venv/bin/python benchmarks/kfac_step.py --model-config config/config.json --batch-size 8 --seq-len 256
    .venv/bin/python benchmarks/kfac_step.py --model-config config/config.json --seq-len 256 --components
    .venv/bin/python benchmarks/kfac_step.py --quick         # a tiny model, a few steps (the test's smoke run)

Each arm is the trainer's own update (`step.train_step`: forward/backward, K-FAC, clipping at 1.0,
AdamW) on its own copy of the same seeded model, in fp32 on the CPU, eager (K-FAC's hooks do not
change with compilation; eager keeps the comparison about K-FAC). The arms run interleaved in
blocks of --block updates, so a change of machine load falls on all of them, until each has done
--steps updates (a multiple of 50 by default, so the 5/50 arm's mean carries its share of
eigendecompositions). Reported per arm: the mean and median update time, and the mean over
AdamW's; the target is 5/50 <= 1.3x. Run it on an idle machine: the load average is printed.

--components, for shapes where whole 50-update cycles take too long (GPT-2 small: ~15 s an update
here), times the three kinds of K-FAC update one by one, each against AdamW updates interleaved
with it, and the decomposition on its own: t_pre (precondition only), t_fac (factor capture and
fold + precondition) and t_dec (one eigendecomposition of every factor). An f/i arm then costs
t_pre + (t_fac - t_pre) / f + t_dec / i per update on average, which is what the whole-cycle
measurement averages; run both modes on the `make train` shape to see how well they agree.
Why the blocks' preconditioning dominates at GPT-2 small: for a layer of n_in x n_out, the eigen
preconditioning costs 2 n_in n_out (n_in + n_out) multiply-adds per update and the layer's
forward/backward 3 n_in n_out tokens, so the ratio is 2 (n_in + n_out) / (3 tokens): 1.25 for the
MLP layers at 8 x 256 tokens, whatever the hardware (half that with --compute-method inverse, whose
preconditioning is two matmuls instead of four).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt2forge.core.loss_scaler import LossScaler  # noqa: E402
from gpt2forge.model.config import ModelConfig  # noqa: E402
from gpt2forge.model.gpt2 import GPT2LMHeadModel  # noqa: E402
from gpt2forge.parallel.strategy import ParallelRequest, build_strategy  # noqa: E402
from gpt2forge.train.config import TrainConfig  # noqa: E402
from gpt2forge.train.kfac import build_preconditioner  # noqa: E402
from gpt2forge.train.optim import build_lr_schedule, build_optimizer  # noqa: E402
from gpt2forge.train.step import Run, train_step  # noqa: E402

TARGET = 1.3  # K-FAC 5/50 update time / AdamW update time
ARMS = {"AdamW": None, "K-FAC 5/50": (5, 50), "K-FAC 1/10": (1, 10)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-config", default=str(ROOT / "config" / "config_mini.json"), help="model shape")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per update (B)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (T)")
    p.add_argument("--steps", type=int, default=100, help="timed updates per arm")
    p.add_argument("--block", type=int, default=10, help="updates an arm runs before the next arm's turn")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates per arm first")
    p.add_argument("--quick", action="store_true", help="a 2-layer 64-wide model, B=2, T=32, 10 updates per arm")
    p.add_argument("--compute-method", default="eigen", choices=("eigen", "inverse"),
                   help="K-FAC's --kfac-compute-method in the K-FAC arms")
    p.add_argument("--components", action="store_true",
                   help="time each kind of K-FAC update and the decomposition (--steps of each), and combine them "
                        "per interval pair instead of running whole cycles")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.seq_len, args.steps, args.block, args.warmup = 2, 32, 10, 5, 1
    if min(args.batch_size, args.seq_len, args.steps, args.block) < 1:
        p.error("--batch-size, --seq-len, --steps and --block must be >= 1")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.quick:
        return ModelConfig(vocab_size=512, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=2)
    return ModelConfig.from_json(args.model_config)


def build_run(args: argparse.Namespace, intervals: tuple[int, int] | None) -> Run:
    """One arm: the seeded model, AdamW (lr 1e-4, decay 0.01), clipping at 1.0, K-FAC at `intervals`."""
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(model_config(args))
    strategy = build_strategy(model, ParallelRequest(device=torch.device("cpu"), batch_size=args.batch_size))
    optimizer = build_optimizer(model, "AdamW", 1e-4, 0.01)
    flags = {"dataset": "generated", "max_grad_norm": 1.0}
    if intervals:
        flags.update(kfac=True, kfac_factor_update_steps=intervals[0], kfac_inv_update_steps=intervals[1],
                     kfac_compute_method=args.compute_method)
    cfg = TrainConfig.from_flat(flags)
    run = Run(cfg, strategy, optimizer, build_lr_schedule(optimizer, "constant", 1, 0), LossScaler(False, 1.0, False),
              torch.device("cpu"), "fp32", 1)
    run.kfac = build_preconditioner(cfg.kfac, strategy)
    return run


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def components(args: argparse.Namespace, batch: torch.Tensor) -> int:
    """--components: t_pre, t_fac against interleaved AdamW updates, t_dec alone, combined per arm."""
    adamw, kfac = build_run(args, None), build_run(args, ARMS["K-FAC 5/50"])
    f, i = ARMS["K-FAC 5/50"]
    for run in (adamw, kfac):  # K-FAC's first update folds its first factors and decomposes them
        for _ in range(args.warmup):
            train_step(run, [batch])
    times: dict[str, list[float]] = {"AdamW": [], "precondition only": [], "factors + precondition": []}
    for _ in range(args.steps):
        for name, counter in (("AdamW", None), ("precondition only", 1), ("factors + precondition", f)):
            if counter is not None:
                kfac.kfac.steps = counter  # 1: neither a factor update nor a decomposition; f: a factor update
            t0 = time.perf_counter()
            train_step(adamw if counter is None else kfac, [batch])
            times[name].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    kfac.kfac._decompose()
    t_dec = time.perf_counter() - t0
    base, t_pre, t_fac = (statistics.fmean(times[k]) for k in times)
    print(f"{'update kind':<24} {'mean ms':>9} {'median ms':>10} {'x AdamW':>8}")
    for name, t in times.items():
        print(f"{name:<24} {1000 * statistics.fmean(t):9.1f} {1000 * statistics.median(t):10.1f} "
              f"{statistics.fmean(t) / base:8.2f}")
    print(f"{'decomposition (alone)':<24} {1000 * t_dec:9.1f}")
    ratios = {name: (t_pre + (t_fac - t_pre) / fi[0] + t_dec / fi[1]) / base
              for name, fi in ARMS.items() if fi}
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x AdamW, combined from the parts")
    ratio = ratios["K-FAC 5/50"]
    print(f"K-FAC 5/50 / AdamW: {ratio:.2f}x (target <= {TARGET}x: {'met' if ratio <= TARGET else 'missed'}); "
          f"load average after: {load()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = model_config(args)
    print(f"model: {shape.n_layer} layers x {shape.n_embd} wide, vocab {shape.vocab_size}; B={args.batch_size}, "
          f"T={args.seq_len}; {torch.get_num_threads()} threads; load average before: {load()}")
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
    if args.components:
        return components(args, batch)
    runs = {name: build_run(args, intervals) for name, intervals in ARMS.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        for _ in range(args.warmup):
            train_step(run, [batch])
    while any(len(t) < args.steps for t in times.values()):
        for name, run in runs.items():
            for _ in range(min(args.block, args.steps - len(times[name]))):
                t0 = time.perf_counter()
                train_step(run, [batch])
                times[name].append(time.perf_counter() - t0)
    base = statistics.fmean(times["AdamW"])
    print(f"{'arm':<12} {'mean ms':>9} {'median ms':>10} {'x AdamW':>8}")
    for name, t in times.items():
        print(f"{name:<12} {1000 * statistics.fmean(t):9.1f} {1000 * statistics.median(t):10.1f} "
              f"{statistics.fmean(t) / base:8.2f}")
    ratio = statistics.fmean(times["K-FAC 5/50"]) / base
    print(f"K-FAC 5/50 / AdamW: {ratio:.2f}x (target <= {TARGET}x: {'met' if ratio <= TARGET else 'missed'}); "
          f"load average after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
