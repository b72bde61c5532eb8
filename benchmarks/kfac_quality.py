"""K-FAC against AdamW alone: held-out loss against updates and against training wall time (issue 23).

    gpt2forge-fetch-data wikitext                                    # once: the WikiText test articles
    .venv/bin/python benchmarks/kfac_quality.py                      # the `make train` shape, 300 updates
    .venv/bin/python benchmarks/kfac_quality.py --model-config config/config.json --seq-len 256 --steps 60

Each arm is seed 002's run_clm job (`train_clm.py`'s flags: `--dataset_name` a local `datasets`
dataset of the WikiText test articles' lines, 5% of them held out, blocks of --seq-len tokens,
--batch-size sequences per update, linear decay from --lr without warm-up), the one difference being
`--kfac --kfac-factor-update-steps F --kfac-inv-update-steps I`. The runs start from the same seeded
weights and read the same blocks in the same order; they run one after another (a whole run cannot
be interleaved), so run this on an idle machine: the load average is printed before and after each
arm. The run is `train_clm.py`'s, translated to `train_gpt2.py` flags with validation every
--eval-every updates added (run_clm itself validates once per epoch). Training wall time is the sum of the
step times the trainer records (validation excluded).

Prints, per arm, the held-out loss at every validation, the training seconds to reach it and the mean
update time over AdamW's; writes the chart (loss against updates and against seconds) to --chart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt2forge.evaluation.fetch import default_file  # noqa: E402
from gpt2forge.frontends.flag_table import equivalent_command  # noqa: E402
from gpt2forge.frontends.run_clm import translate  # noqa: E402

ARMS = {"AdamW": None, "K-FAC 5/50": (5, 50), "K-FAC 1/10": (1, 10)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-file", default=None, help="training text, one record per line (default: the WikiText "
                   "test articles `gpt2forge-fetch-data wikitext` fetched)")
    p.add_argument("--model-config", default=str(ROOT / "config" / "config_mini.json"), help="model shape")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per update (B)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per block (T)")
    p.add_argument("--steps", type=int, default=300, help="updates per arm")
    p.add_argument("--eval-every", type=int, default=25, help="updates between validations")
    p.add_argument("--eval-iters", type=int, default=None, help="validation batches each time (default: all)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (linear decay to 0)")
    p.add_argument("--arms", default="AdamW,K-FAC 5/50", help=f"comma-separated, of: {', '.join(ARMS)}")
    p.add_argument("--chart", default=str(ROOT / "docs" / "images" / "kfac_quality.png"), help="PNG to write")
    p.add_argument("--json", default=None, help="also write the curves here")
    return p.parse_args(argv)


def local_dataset(train_file: str | None, work: Path) -> Path:
    """The text as a local `datasets` dataset (save_to_disk), one record per line with its line break,
    as the docs' worked example makes it."""
    import datasets  # lazy: only for the benchmark's data

    path = Path(train_file) if train_file else default_file("wikitext").with_name("wiki.test.raw")
    if not path.is_file():
        raise SystemExit(f"error: {path}: not found; run `gpt2forge-fetch-data wikitext` or pass --train-file")
    folder = work / "dataset"
    datasets.load_dataset("text", data_files={"train": str(path)}, keep_linebreaks=True).save_to_disk(str(folder))
    return folder


def run_arm(args: argparse.Namespace, arm: str, work: Path, dataset: Path) -> list[dict]:
    """The arm's metrics records (train and validation) of one run."""
    argv = ["--dataset_name", str(dataset), "--config_name", args.model_config, "--block_size", str(args.seq_len),
            "--per_device_train_batch_size", str(args.batch_size), "--max_train_steps", str(args.steps),
            "--learning_rate", str(args.lr), "--seed", "0"]
    if ARMS[arm] is not None:
        factor, inverse = ARMS[arm]
        argv += ["--kfac", "--kfac-factor-update-steps", str(factor), "--kfac-inv-update-steps", str(inverse)]
    values = translate(argv, world_size=1)
    metrics = work / f"{arm.replace(' ', '_').replace('/', '-')}.jsonl"
    values.update(metrics_file=str(metrics), eval_every_steps=args.eval_every, log_steps=args.eval_every,
                  num_workers=0, data_cache_dir=str(work / "cache"))
    if args.eval_iters:
        values["eval_iters"] = args.eval_iters
    cmd = [sys.executable, str(ROOT / "train_gpt2.py"), *equivalent_command(values)]
    print(f"{arm}: load {os.getloadavg()[0]:.2f}; {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def curves(records: list[dict]) -> dict:
    """Validation losses with their update, the training seconds before it, and the mean update time."""
    seconds, elapsed, points = {}, 0.0, []
    for r in records:
        if r["kind"] == "train":
            elapsed += r["step_seconds"]
            seconds[r["step"]] = elapsed
        elif r["kind"] == "validation" and "val_loss" in r:
            points.append({"step": r["step"], "seconds": seconds[r["step"]], "val_loss": r["val_loss"]})
    steps = max(seconds)
    return {"points": points, "mean_update_s": seconds[steps] / steps}


def chart(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib  # lazy: only for the chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm, result in results.items():
        xs = [p["step"] for p in result["points"]]
        ts = [p["seconds"] for p in result["points"]]
        ys = [p["val_loss"] for p in result["points"]]
        by_step.plot(xs, ys, marker="o", markersize=3, label=arm)
        by_time.plot(ts, ys, marker="o", markersize=3, label=arm)
    by_step.set_xlabel("updates")
    by_time.set_xlabel("training seconds (validation excluded)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        print(f"error: --arms {', '.join(unknown)}: choose from {', '.join(ARMS)}", file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = local_dataset(args.train_file, Path(tmp))
        for arm in arms:
            results[arm] = curves(run_arm(args, arm, Path(tmp), dataset))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    base = results[arms[0]]["mean_update_s"]
    for arm, result in results.items():
        print(f"\n{arm}: mean update {result['mean_update_s']:.3f} s ({result['mean_update_s'] / base:.2f}x "
              f"{arms[0]})")
        print("  update  seconds  held-out loss")
        for p in result["points"]:
            print(f"  {p['step']:6d}  {p['seconds']:7.1f}  {p['val_loss']:.4f}")
    name = Path(args.model_config).stem
    chart(results, Path(args.chart), f"{name}, B={args.batch_size}, T={args.seq_len}, lr {args.lr:g} linear decay, "
                                     f"{args.steps} updates: K-FAC against AdamW (benchmarks/kfac_quality.py)")
    print(f"\nchart: {args.chart}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
