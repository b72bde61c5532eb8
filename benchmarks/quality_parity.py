"""Learning per update: `make train` against transformers' own `Trainer`, held-out loss at equal updates.

Both arms train `make train`'s model (config/config_mini.json, or `--model-config`) on the same
training windows of the same corpus (build/stdlib_docs.pkl, made by `make train`) with the same
hyper-parameters (8 x 128 tokens per update, AdamW, peak LR 1.5e-3, cosine after 20 warm-up
updates, weight decay 0.1 on matrices, clip 1.0, eps 1e-8), and are scored on the same 64 held-out
windows every `--eval-every` updates (token-weighted mean loss):

  ours     `train_gpt2.py` with the Makefile's TRAIN_ARGS (`--torch-compile true`, the fused LM head
           + loss; its optimizer: Muon for the blocks' matrices and AdamW for the rest since issue 53,
           so `--ours-flags "--optimizer AdamW --learning-rate 1.5e-3"` compares the Trainer's own
           optimizer), `--seed S`, plus `--ours-flags` (for ablations)
  trainer  `transformers.Trainer` on `GPT2LMHeadModel(GPT2Config(config_mini.json))` seeded with S,
           `TrainingArguments` with the same settings, the windows from our pickle reader
           (`--trainer-windows`: the reference's per-document windows unless told otherwise), the
           loss over the same labels (`shift_labels`), a callback scoring the held-out windows

Each run is its own process; the parent stamps every validation line with the time since the
process started (imports, data loading and ours' torch.compile included), so wall times compare
whole runs. Seeds alternate the arms (ours, trainer, ours, ...) so drifting background load hits
both. Prints per arm the held-out loss at each scored update (mean and spread over seeds), the
final gap per seed, and per seed the wall time ours needs to reach that seed's Trainer final loss
as a fraction of the Trainer's wall time (target 0.7), and the same for the means over seeds. Waits
up to `--wait-quiet` seconds for a 1-minute load below 0.5 before the first run (later runs find the
load of the run before them), and records each run's starting load.

    .venv/bin/python benchmarks/quality_parity.py                                  # 3 seeds, 300 updates
    .venv/bin/python benchmarks/quality_parity.py --arms ours --ours-flags "--adam-eps 1e-6" --label eps1e-6
    .venv/bin/python benchmarks/quality_parity.py --steps 4 --warmup 1 --eval-every 2 --seeds 0 --val-num 8  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpt2forge.tools.machine_report import wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
VALIDATION = re.compile(r"validation after step (\d+): loss ([0-9.]+)")
TARGET_WALL_RATIO = 0.7  # ours' wall time to the Trainer's final loss / the Trainer's wall time


def make_train_args() -> list[str]:
    """The Makefile's TRAIN_ARGS (what `make train` runs) with its default PRECISION, other variables left
    to `with_flags` below."""
    text = (ROOT / "Makefile").read_text()
    args = re.search(r"TRAIN_ARGS \?= (.*?)\n\n", text, re.S).group(1).replace("\\\n", " ")
    precision = re.search(r"^PRECISION\s*\?=\s*(\S+)", text, re.M).group(1)
    return shlex.split(args.replace("$(PRECISION)", precision))


def with_flags(args: list[str], overrides: dict[str, str | None]) -> list[str]:
    """`args` with each `--flag value` of `overrides` replaced (None drops the flag and its value)."""
    out, i = [], 0
    while i < len(args):
        name = args[i]
        j = i + 1
        while j < len(args) and not args[j].startswith("--"):
            j += 1
        if name not in overrides:
            out += args[i:j]
        i = j
    for name, value in overrides.items():
        if value is not None:
            out += [name, value]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arms", default="ours,trainer", help="comma-separated: ours, trainer")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (weights, window order)")
    p.add_argument("--steps", type=int, default=300, help="optimizer updates per run")
    p.add_argument("--warmup", type=int, default=20, help="warm-up updates (make train: 20)")
    p.add_argument("--eval-every", type=int, default=25, help="score the held-out windows every N updates")
    p.add_argument("--val-num", type=int, default=64, help="held-out windows (--val-num)")
    p.add_argument("--corpus", default=str(ROOT / "build" / "stdlib_docs.pkl"), help="token-id pickle")
    p.add_argument("--model-config", default=str(ROOT / "config" / "config_mini.json"),
                   help="Hugging Face GPT-2 config.json of the model both arms train")
    p.add_argument("--init", default="own", choices=("own", "shared"),
                   help="own: each arm draws its initial weights from the seed (ours: model.init_weights; the "
                        "Trainer: transformers' GPT-2 init); shared: both start from transformers' draw, saved as "
                        "a Hugging Face directory that ours loads with --checkpoint-input-dir")
    p.add_argument("--init-dir", default=None, help=argparse.SUPPRESS)  # internal: the shared weights
    p.add_argument("--ours-flags", default="", help="extra train_gpt2.py flags for ours (ablations)")
    p.add_argument("--trainer-windows", default="document", choices=("document", "packed"),
                   help="training windows given to the Trainer (our pickle reader's --windows)")
    p.add_argument("--label", default="", help="name of this configuration in the output")
    p.add_argument("--wait-quiet", type=float, default=120.0,
                   help="seconds to wait for a 1-minute load below 0.5 before each run (then warn)")
    p.add_argument("--json", default=None, help="write every run's curve and the summary here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run the Trainer arm
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------- the Trainer arm


def trainer_worker(args: argparse.Namespace) -> None:
    """Train with transformers' Trainer and print our validation line at every scored update."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from gpt2forge.data import DataRequest, load_datasets, split_batch
    from gpt2forge.data.args import DataArgs

    config = GPT2Config.from_json_file(args.model_config)
    train_args = make_train_args()
    max_len = int(train_args[train_args.index("--max-len") + 1])
    config.n_positions = max_len  # as our trainer sizes a fresh model's position table to --max-len
    corpus = DataArgs(dataset="pickle", input_files=[args.corpus], seed=args.seed, stride=128, val_num=args.val_num,
                      windows=args.trainer_windows)
    data = load_datasets(DataRequest(corpus, max_len, config.vocab_size))
    eot = config.eos_token_id

    def collate(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        input_ids, labels = split_batch(torch.stack(items))  # (B, T) each; padding labels are -100
        input_ids = torch.where(labels == -100, torch.full_like(input_ids, eot), input_ids)
        return {"input_ids": input_ids, "labels": labels, "shift_labels": labels}  # already shifted

    val = [data.val[i] for i in range(len(data.val))]

    def held_out_loss(model) -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(val), 8):
                batch = collate(val[i:i + 8])
                logits = model(input_ids=batch["input_ids"]).logits.float()  # (B, T, V)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                         ignore_index=-100, reduction="sum")
                total += loss.item()
                count += int((batch["labels"] != -100).sum())
        model.train()
        return total / count

    class Score(TrainerCallback):
        def on_step_end(self, targs, state, control, model=None, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                print(f"validation after step {state.global_step}: loss {held_out_loss(model):.4f}", flush=True)

    if args.init_dir:
        model = GPT2LMHeadModel.from_pretrained(args.init_dir, local_files_only=True)
    else:
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=1,
            learning_rate=1.5e-3, lr_scheduler_type="cosine", warmup_steps=args.warmup, weight_decay=0.1,
            max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, seed=args.seed,
            data_seed=args.seed, logging_steps=20, save_strategy="no", eval_strategy="no", report_to="none",
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
        Trainer(model=model, args=targs, train_dataset=data.train, data_collator=collate,
                callbacks=[Score()]).train()


# ------------------------------------------------------------------------------- the parent


def shared_init(seed: int, args: argparse.Namespace, tmp: str) -> str:
    """transformers' GPT-2 initial weights for `seed`, saved as a Hugging Face directory (once per seed)."""
    folder = os.path.join(tmp, f"init_{seed}")
    if not os.path.isdir(folder):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config.from_json_file(args.model_config)
        train_args = make_train_args()
        config.n_positions = int(train_args[train_args.index("--max-len") + 1])
        torch.manual_seed(seed)
        GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def run_arm(arm: str, seed: int, args: argparse.Namespace, tmp: str, first: bool) -> dict:
    """One run in its own process: [(update, held-out loss, seconds since the process started)]."""
    init = ["--checkpoint-input-dir" if arm == "ours" else "--init-dir", shared_init(seed, args, tmp)] \
        if args.init == "shared" else []
    if arm == "ours":
        flags = with_flags(make_train_args(), {
            "--input-files": args.corpus, "--model-config": args.model_config, "--seed": str(seed),
            "--training-steps": str(args.steps), "--lr-warmup-steps": str(args.warmup),
            "--eval-every-steps": str(args.eval_every),
            "--val-num": str(args.val_num), "--checkpoint-output-dir": None, "--save-per-steps": None,
            "--sample-tokens": "0", "--sample-prompt": None, "--log-steps": str(args.eval_every),
            "--metrics-file": os.path.join(tmp, f"metrics_{seed}.jsonl")})
        cmd = [sys.executable, str(ROOT / "train_gpt2.py"), *flags, *init, *shlex.split(args.ours_flags)]
    else:
        cmd = [sys.executable, __file__, "--worker", "trainer", "--seed", str(seed), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--eval-every", str(args.eval_every), "--val-num", str(args.val_num),
               "--corpus", args.corpus,
               "--model-config", args.model_config, "--trainer-windows", args.trainer_windows, *init]
    load = wait_for_quiet(args.wait_quiet) if first else os.getloadavg()[0]  # later: our own last run's load
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    curve, tail = [], []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if (m := VALIDATION.search(line)) and int(m.group(1)) not in {s for s, _, _ in curve}:
            curve.append((int(m.group(1)), float(m.group(2)), round(time.monotonic() - start, 2)))
    wall = time.monotonic() - start
    if proc.wait() != 0:
        sys.exit(f"error: the {arm} run (seed {seed}) failed:\n{''.join(tail)}")
    print(f"{arm:8s} seed {seed}: " + ", ".join(f"{s}: {loss:.3f}" for s, loss, _ in curve)
          + f"  ({wall:.0f} s, load {load:.2f})", flush=True)
    return {"arm": arm, "seed": seed, "curve": curve, "wall_s": round(wall, 2), "load_at_start": load}


def time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Seconds until the held-out loss first reaches `target`, interpolated between scored updates."""
    previous = None
    for _, loss, t in curve:
        if loss <= target:
            if previous is None or previous[0] == loss:
                return t
            return previous[1] + (t - previous[1]) * (previous[0] - target) / (previous[0] - loss)
        previous = (loss, t)
    return None


def summarize(runs: list[dict], label: str) -> dict:
    """Mean and spread per arm at each scored update, the final gap and the wall-time ratio."""
    arms = sorted({r["arm"] for r in runs})
    summary = {"label": label, "arms": {}}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        steps = sorted({s for r in mine for s, _, _ in r["curve"]})
        at = {s: [loss for r in mine for step, loss, _ in r["curve"] if step == s] for s in steps}
        summary["arms"][arm] = {
            "loss": {s: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0) for s, v in at.items()},
            "wall_s": statistics.mean(r["wall_s"] for r in mine)}
    print(f"\nheld-out loss, mean +- stdev over seeds {sorted({r['seed'] for r in runs})} {label}")
    steps = sorted({s for a in summary["arms"].values() for s in a["loss"]})
    print("update  " + "  ".join(f"{arm:>16s}" for arm in arms))
    for s in steps:
        cells = [summary["arms"][a]["loss"].get(s) for a in arms]
        print(f"{s:6d}  " + "  ".join(f"{c[0]:9.4f} +- {c[1]:.3f}" if c else f"{'':16s}" for c in cells))
    print("wall s  " + "  ".join(f"{summary['arms'][a]['wall_s']:16.1f}" for a in arms)
          + (f"  (ours {summary['arms']['ours']['wall_s'] / summary['arms']['trainer']['wall_s']:.2f}x)"
             if {"ours", "trainer"} <= set(arms) else ""))
    if {"ours", "trainer"} <= set(arms):
        ours, trainer = summary["arms"]["ours"], summary["arms"]["trainer"]
        last = max(set(ours["loss"]) & set(trainer["loss"]))
        gap = ours["loss"][last][0] - trainer["loss"][last][0]
        noise = max(ours["loss"][last][1], trainer["loss"][last][1])
        # Per seed: the time ours takes to reach that seed's Trainer final loss / that Trainer run's wall time.
        by = {(r["arm"], r["seed"]): r for r in runs}
        ratios = {s: (lambda t: None if t is None else t / by["trainer", s]["wall_s"])(
                      time_to(by["ours", s]["curve"], by["trainer", s]["curve"][-1][1]))
                  for s in sorted({r["seed"] for r in runs}) if ("ours", s) in by and ("trainer", s) in by}
        # Paired by seed: a seed fixes the held-out windows and the window order for both arms.
        final = {(r["arm"], r["seed"]): dict((s, loss) for s, loss, _ in r["curve"])[last] for r in runs}
        paired = [final["ours", s] - final["trainer", s] for s in sorted({r["seed"] for r in runs})
                  if ("ours", s) in final and ("trainer", s) in final]
        summary.update(final_update=last, gap=gap, seed_stdev=noise, wall_ratios=ratios, paired_gaps=paired)
        print(f"\nat update {last}: ours - trainer = {gap:+.4f} (seed stdev up to {noise:.4f}): "
              f"{'no worse beyond seed noise' if gap <= noise else 'WORSE beyond seed noise'}; per seed "
              + ", ".join(f"{g:+.4f}" for g in paired))
        for s, ratio in ratios.items():
            reached = (f"in {ratio:.2f}x the Trainer's wall time (target <= {TARGET_WALL_RATIO}): "
                       f"{'met' if ratio <= TARGET_WALL_RATIO else 'MISSED'}") if ratio is not None else \
                f"not within {last} updates: MISSED"
            print(f"seed {s}: ours reaches the Trainer's final held-out loss {reached}")
        # Over seeds: ours' mean curve (mean loss and mean time at each update) against the Trainer's mean
        # final loss and mean wall time; with own inits the per-seed lines above also compare the draws.
        if len(paired) > 1:
            mean_curve = [(s, ours["loss"][s][0], statistics.mean(t for r in runs if r["arm"] == "ours"
                                                                  for step, _, t in r["curve"] if step == s))
                          for s in sorted(ours["loss"])]
            t = time_to(mean_curve, trainer["loss"][last][0])
            ratio = summary["mean_wall_ratio"] = None if t is None else t / trainer["wall_s"]
            reached = (f"in {ratio:.2f}x the Trainer's mean wall time (target <= {TARGET_WALL_RATIO}): "
                       f"{'met' if ratio <= TARGET_WALL_RATIO else 'MISSED'}") if ratio is not None else \
                f"not within {last} updates: MISSED"
            print(f"mean over seeds: ours reaches the Trainer's mean final held-out loss {reached}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "trainer":
        trainer_worker(args)
        return 0
    if not Path(args.corpus).is_file():
        sys.exit(f"error: {args.corpus} is missing; `make train` (or `make build/stdlib_docs.pkl`) builds it")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - {"ours", "trainer"}:
        sys.exit(f"error: --arms {args.arms}: choose from ours, trainer")
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{args.steps} updates, held-out every {args.eval_every}, seeds {seeds}, init {args.init}, ours flags: "
          f"{args.ours_flags or '(Makefile TRAIN_ARGS)'}, trainer windows: {args.trainer_windows}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, seed in enumerate(seeds):
            for arm in (arms if k % 2 == 0 else arms[::-1]):  # alternate the order: load drift hits both
                runs.append(run_arm(arm, seed, args, tmp, first=not runs))
    summary = summarize(runs, args.label)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
