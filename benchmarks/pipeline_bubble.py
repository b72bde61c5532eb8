"""Pipeline bubble and communication: step time for 1, 2 and 4 stages at the same global batch.

Each layout runs `train_gpt2.py` on generated data (launched with torchrun for more than one
stage), one thread per process, the blocks split evenly over the stages (stage 0 also holds the
embeddings). From the median step time T_S (first step skipped: it includes shape inference):

  speedup      T_1 / T_S
  efficiency   T_1 / (P * T_S), P = min(S, CPU cores): the share of the P usable cores doing work
  waiting      1 - efficiency: pipeline bubble + communication + load imbalance, measured
  bubble       (S - 1) / (M + S - 1): the schedule's theoretical idle share (GPipe and 1F1B) for M
               micro-batches per update

    .venv/bin/python benchmarks/pipeline_bubble.py                 # 1, 2, 4 stages, 1F1B, M=8
    .venv/bin/python benchmarks/pipeline_bubble.py --schedule GPipe --micro-batches 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THROUGHPUT = re.compile(r"^step \d+ of epoch \d+, .*throughput: ([\d.]+) samples/sec")


def run_layout(stages: int, args: argparse.Namespace, config: Path) -> float:
    """Median seconds per update of `stages` pipeline stages."""
    per_stage, rest = divmod(args.n_layer, stages)
    if rest:
        raise SystemExit(f"error: --n-layer {args.n_layer} does not split into {stages} equal stages")
    argv = ["train_gpt2.py", "--model-config", str(config), "--dataset", "generated", "--max-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--gradient-accumulation", str(args.micro_batches),
            "--device-iterations", "1", "--training-steps", str(args.steps + 1), "--num-workers", "0",
            "--pipeline-schedule", args.schedule, "--learning-rate", "1e-4"]
    launcher: list[str] = []
    if stages > 1:
        argv += ["--layers-per-ipu", *[str(per_stage)] * stages, "--ipus-per-replica", str(stages)]
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(stages)]
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *launcher, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: the {stages}-stage run failed:\n{proc.stderr[-2000:]}")
    rates = [float(m.group(1)) for line in proc.stdout.splitlines() if (m := THROUGHPUT.match(line))]
    samples = args.batch_size * args.micro_batches
    return statistics.median(samples / r for r in rates[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="1,2,4", help="comma-separated stage counts (default 1,2,4)")
    p.add_argument("--schedule", default="1F1B", choices=("GPipe", "1F1B"))
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per update M (default 8)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=512, help="small, so the blocks dominate every stage")
    p.add_argument("--steps", type=int, default=4, help="timed updates per layout (default 4)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    stage_counts = [int(s) for s in args.stages.split(",")]
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": args.vocab_size, "n_positions": args.seq_len,
                                      "n_embd": args.n_embd, "n_layer": args.n_layer, "n_head": 4,
                                      "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
        times = {s: run_layout(s, args, config) for s in stage_counts}
    base = times.get(1)
    rows = []
    print(f"{args.schedule}, M={args.micro_batches} micro-batches of {args.batch_size} x {args.seq_len}, "
          f"{args.n_layer} blocks of {args.n_embd}, {cores} CPU cores, gloo, 1 thread per process")
    print(f"{'stages':>6} {'s/update':>9} {'speedup':>8} {'efficiency':>10} {'waiting':>8} {'bubble (theory)':>15}")
    for s, t in times.items():
        usable = min(s, cores)
        speedup = base / t if base else float("nan")
        efficiency = speedup / usable
        bubble = (s - 1) / (args.micro_batches + s - 1)
        rows.append({"stages": s, "seconds_per_update": t, "speedup": speedup, "efficiency": efficiency,
                     "waiting": 1 - efficiency, "bubble_theory": bubble, "usable_cores": usable})
        print(f"{s:>6} {t:>9.3f} {speedup:>8.2f} {efficiency:>10.2f} {1 - efficiency:>8.2f} {bubble:>15.2f}")
    if any(s > cores for s in stage_counts):
        print(f"note: more stages than the {cores} cores: those processes share cores, so efficiency counts "
              "only the usable cores")
    if args.json:
        Path(args.json).write_text(json.dumps({"schedule": args.schedule, "micro_batches": args.micro_batches,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
