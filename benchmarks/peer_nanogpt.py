"""Learning per second: `make train` against karpathy/nanoGPT's own `train.py`, unmodified, as the peer.

`--nanogpt DIR` names a nanoGPT checkout (its train.py, model.py and configurator.py; nothing of it is
copied or changed). Both arms train `make train`'s model (config/config_mini.json, or `--model-config`:
its n_layer, n_head, n_embd and dropout; `--max-len` 128 of context; GPT-2 BPE) for `--steps` updates
of 8 x 128 tokens with the Makefile's TRAIN_ARGS schedule and regularisation (weight decay 0.1 on
parameters of 2 or more dimensions, clip 1.0, 20 warm-up updates, cosine to 0 at the last update) and
ours' defaults where TRAIN_ARGS is silent (AdamW's betas (0.9, 0.999), eps 1e-8, which nanoGPT's AdamW
also has), each with its own optimizer and peak learning rate (below), on the same corpus
(build/stdlib_docs.pkl, made by `make train`), and are scored on the same
held-out windows (ours' `--val-num`, the first of the windows shuffled by the seed; token-weighted mean
loss) at every `--eval-every` updates:

  ours     `train_gpt2.py` with the Makefile's TRAIN_ARGS (its PRECISION: auto, the measured choice;
           `--torch-compile true`, the fused LM head + loss, Muon and fused AdamW), `--seed S`, checkpoints to a
           temporary folder at each evaluation, no sample, plus `--ours-flags` (ablations)
  nanogpt  `python DIR/train.py seed_offset.py --dataset=stdlib_docs --out_dir=out --device=cpu
           --dtype=float32 --compile=False ...` run in a temporary folder (printed in full at start):
           eager fp32, what nanoGPT gives on a CPU (`--nanogpt-flags=--compile=True` tries its
           torch.compile), plus `--nanogpt-flags` (key=value overrides, applied last)

The temporary folder holds what nanoGPT reads from its working directory: a link to DIR/configurator.py
(train.py opens it from there), data/stdlib_docs/train.bin (uint16: every corpus token outside the
held-out windows, documents end to end with their <|endoftext|>: the stream of ours' `--windows
packed`/`random`, which nanoGPT's get_batch samples as `--ours-flags "--windows random"` does), val.bin
(the held-out windows' tokens) and meta.pkl, whose vocab_size is how train.py takes a vocabulary size
(its configurator refuses `--vocab_size`): `--nanogpt-vocab-size`, default 50304, nanoGPT's own default
for GPT-2 BPE and the rows of ours' embedding (50257 padded to a multiple of 64; ours masks the padding
out of the softmax, nanoGPT learns to push its 47 extra classes down).

Seeds: train.py seeds torch with 1337 + seed_offset, and seed_offset is the DDP rank (0 here). The
config file `seed_offset.py` that the benchmark writes is executed by nanoGPT's configurator inside
train.py before that call; it wraps torch.manual_seed once, so seed S draws 1337 + S (seed 0: nanoGPT's
own draw). The seed also picks the held-out windows, as ours' `--seed` does.

Scoring: nanoGPT's estimate_loss draws random windows, so it cannot score a fixed set. It runs with
`eval_interval` = `--eval-every`, `eval_iters` = val-num / batch size (its own estimate, printed beside,
costs what ours' evaluation does, plus its train-split pass) and `always_save_checkpoint=True`; the
parent moves out/ckpt.pt aside after each save (once the next step's line shows the save is done) and,
after the run, scores each checkpoint on the held-out windows with DIR/model.py's GPT class.

What differs, besides the implementations: the optimizer and its learning rates (ours: TRAIN_ARGS', Muon
for the blocks' matrices and AdamW for the rest; nanoGPT: AdamW as it ships, at `--nanogpt-lr`, by default
the best of its own sweep for this job, `NANOGPT_LR`), the training windows (ours: the shuffled windows of
each document; nanoGPT: uniform random starts across documents), the initial draw
(same distributions), ours' MLP non-linearity (the config's gelu_new, tanh) against nanoGPT's exact GELU,
nanoGPT's evaluation at update 0 and the extra update its loop makes after the last evaluation (both in
its wall time).

Each run is its own process; the parent stamps every line with the time since the process started.
Seeds alternate the arms (ours, nanogpt, nanogpt, ours, ...) so drifting load hits both; `--arms ours` or
`--arms nanogpt` runs one arm alone (a learning-rate sweep). Prints per seed and as mean +- stdev over
seeds: the held-out loss at each evaluation, the median step time, the first step's time (ours':
torch.compile included), the wall time; with both arms, ours minus nanoGPT paired by seed at each
evaluation (mean, standard error, seeds where ours is lower; targets: at most 0 at every evaluation and
at most -0.1 at the last) and the wall time ours needs to reach nanoGPT's final held-out loss as a
fraction of nanoGPT's wall time (target <= 0.5), per seed and for the means (ours' mean curve against
nanoGPT's mean final loss and mean wall time).

    .venv/bin/python benchmarks/peer_nanogpt.py --nanogpt ~/nanoGPT                  # 5 seeds, 300 updates
    .venv/bin/python benchmarks/peer_nanogpt.py --nanogpt ~/nanoGPT --ours-flags "--windows random"
    .venv/bin/python benchmarks/peer_nanogpt.py --nanogpt ~/nanoGPT --arms nanogpt --seeds 0,1,2 \\
        --nanogpt-lr 3e-3 --json nanogpt_lr3e-3.json                                   # nanoGPT's LR sweep
    .venv/bin/python benchmarks/peer_nanogpt.py --nanogpt ~/nanoGPT --steps 4 --warmup 1 --eval-every 2 \\
        --seeds 0 --val-num 8 --ours-flags "--torch-compile false" --wait-quiet 0      # smoke

A second job (docs/benchmarks.md's second shape): `--model-config`, `--max-len` and `--batch-size` set both
arms' model and window (ours' --stride follows --max-len), `--corpus` any token pickle, here LAMBADA's
passages (`make eval-data` fetches them), one per line, through data/wikipedia_preprocess.py:

    .venv/bin/python -c "import json, sys; [print(' '.join(json.loads(l)['text'].split())) for l in sys.stdin]" \\
        < ~/.cache/gpt2forge/eval-data/lambada/lambada_test.jsonl > lambada.txt
    .venv/bin/python data/wikipedia_preprocess.py --input-file-path lambada.txt --output-file-path lambada
    .venv/bin/python benchmarks/peer_nanogpt.py --nanogpt ~/nanoGPT --model-config benchmarks/config_6x192.json \\
        --max-len 256 --batch-size 4 --steps 200 --eval-every 50 --nanogpt-lr 1.06e-3 \\
        --corpus lambada/wikicorpus_en_one_article_per_line.pkl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import os
import pickle
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quality_parity import make_train_args, time_to, with_flags

from gpt2forge.tools.machine_report import wait_for_quiet

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
TARGET_WALL_RATIO = 0.5  # ours' wall time to nanoGPT's final loss / nanoGPT's wall time
NANOGPT_LR = 7.5e-4
"""nanoGPT's best peak LR for `make train`'s job among 3.75e-4, 7.5e-4, 1.5e-3 and 3e-3 (its sweep, seeds 0-2:
held-out loss 5.911, 5.710, 5.740 and 6.092 at the last update; docs/benchmarks.md, learning per second against
nanoGPT); TRAIN_ARGS' own LR is ours' (Muon's). Another job has its own best: `--nanogpt-lr`."""
TARGET_FINAL_LEAD = -0.1  # ours minus nanoGPT, held-out loss at the last update (mean over seeds, paired)
OURS_VALIDATION = re.compile(r"validation after step (\d+): loss ([0-9.]+)")
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")
NANOGPT_ITER = re.compile(r"^iter (\d+): loss ([0-9.]+), time ([0-9.]+)ms")
SEED_OFFSET = '''\
# Written by gpt2forge's benchmarks/peer_nanogpt.py. nanoGPT's configurator runs this config file inside
# train.py, before train.py seeds torch with 1337 + seed_offset (0 on one process): wrap that one call
# so the run draws 1337 + {seed}.
def _offset_seed(seed, _manual_seed=torch.manual_seed):
    torch.manual_seed = _manual_seed
    return _manual_seed(seed + {seed})
torch.manual_seed = _offset_seed
'''


def train_flag(name: str) -> str | None:
    """The value of `name` in the Makefile's TRAIN_ARGS, None when it is not there."""
    args = make_train_args()
    return args[args.index(name) + 1] if name in args else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nanogpt", required=True, help="a karpathy/nanoGPT folder (train.py, model.py, configurator.py)")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (weights, held-out windows, order)")
    p.add_argument("--steps", type=int, default=int(train_flag("--training-steps")), help="optimizer updates")
    p.add_argument("--warmup", type=int, default=int(train_flag("--lr-warmup-steps")), help="warm-up updates")
    p.add_argument("--eval-every", type=int, default=int(train_flag("--eval-every-steps")),
                   help="score the held-out windows every N updates (a divisor of --steps)")
    p.add_argument("--val-num", type=int, default=int(train_flag("--val-num")), help="held-out windows")
    p.add_argument("--max-len", type=int, default=int(train_flag("--max-len")),
                   help="tokens of context of both arms (ours' --max-len and --stride, nanoGPT's block_size)")
    p.add_argument("--batch-size", type=int, default=int(train_flag("--batch-size")),
                   help="windows per update of both arms (ours' --batch-size, nanoGPT's batch_size)")
    p.add_argument("--corpus", default=str(ROOT / "build" / "stdlib_docs.pkl"), help="token-id pickle")
    p.add_argument("--model-config", default=str(ROOT / "config" / "config_mini.json"),
                   help="Hugging Face GPT-2 config.json of the model both arms train")
    p.add_argument("--nanogpt-vocab-size", type=int, default=50304,
                   help="nanoGPT's vocabulary (meta.pkl): 50304 its default, 50257 the classes of ours")
    p.add_argument("--nanogpt-lr", type=float, default=NANOGPT_LR,
                   help="nanoGPT's peak learning rate (default: the best of its own sweep at make train's shape)")
    p.add_argument("--ours-flags", default="", help="extra train_gpt2.py flags for ours (ablations)")
    p.add_argument("--nanogpt-flags", default="", help="extra --key=value overrides for nanoGPT's train.py")
    p.add_argument("--wait-quiet", type=float, default=120.0,
                   help="seconds to wait for a 1-minute load below 0.5 before the first run (then warn)")
    p.add_argument("--arms", default="ours,nanogpt", choices=("ours,nanogpt", "ours", "nanogpt"),
                   help="which arms run (one arm alone: a learning-rate sweep of that arm, summarized alone)")
    p.add_argument("--json", default=None, help="write every run's numbers and the summary here")
    p.add_argument("--nanogpt-runs", default=None, metavar="JSON",
                   help="take the nanoGPT arm's runs from an earlier --json of this benchmark with the same seeds, "
                        "steps, evaluations, held-out windows, corpus and nanoGPT settings, and run ours only (an "
                        "ablation of --ours-flags against the same peer runs; the wall-time ratios then compare "
                        "runs of different times: check the load of both)")
    return p.parse_args(argv)


SAME_PEER = ("steps", "warmup", "eval_every", "val_num", "max_len", "batch_size", "corpus", "model_config",
             "nanogpt_vocab_size", "nanogpt_lr", "nanogpt_flags")
"""The arguments an earlier run's nanoGPT arm must share for --nanogpt-runs to reuse it."""


def reused_nanogpt_runs(args: argparse.Namespace, seeds: list[int]) -> dict[int, dict] | str:
    """--nanogpt-runs: the earlier nanoGPT runs by seed, or why they cannot stand in (one line)."""
    try:
        earlier = json.loads(Path(args.nanogpt_runs).read_text())
        runs = {r["seed"]: r for r in earlier["runs"] if r["arm"] == "nanogpt"}
        before = earlier["args"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"--nanogpt-runs {args.nanogpt_runs}: not a --json of this benchmark ({e})"
    differ = [k for k in SAME_PEER if before.get(k) != getattr(args, k)]
    if differ:
        flags = ", ".join("--" + k.replace("_", "-") for k in differ)
        return f"--nanogpt-runs {args.nanogpt_runs}: its runs had other {flags}; run both arms again"
    if missing := [s for s in seeds if s not in runs]:
        return f"--nanogpt-runs {args.nanogpt_runs}: no nanoGPT run of seed(s) {', '.join(map(str, missing))}"
    return runs


def usage_problem(args: argparse.Namespace) -> str | None:
    """Why the benchmark cannot run as asked (one line), or None."""
    missing = [name for name in NANOGPT_FILES if not (Path(args.nanogpt) / name).is_file()]
    if missing:
        return (f"--nanogpt {args.nanogpt} is not a nanoGPT folder: it lacks {', '.join(missing)} "
                "(clone https://github.com/karpathy/nanoGPT and name its folder)")
    if not Path(args.corpus).is_file():
        return (f"--corpus {args.corpus} is missing; `make train` (or `make build/stdlib_docs.pkl`) builds the "
                "default one")
    if args.steps < 1 or args.eval_every < 1 or args.steps % args.eval_every:
        return f"--eval-every {args.eval_every} must divide --steps {args.steps} (nanoGPT scores its multiples)"
    return None


# ------------------------------------------------------------------------------- the nanoGPT arm


def stride_for(args: argparse.Namespace) -> int:
    """TRAIN_ARGS' --stride at its own --max-len, else --max-len: windows that do not overlap."""
    return int(train_flag("--stride")) if args.max_len == int(train_flag("--max-len")) else args.max_len


def nanogpt_settings(args: argparse.Namespace) -> dict[str, object]:
    """train.py's config keys for this benchmark: the model config's shape, TRAIN_ARGS' optimizer and
    schedule, ours' defaults for what TRAIN_ARGS leaves out. Values keep the types train.py declares."""
    from gpt2forge.train.config import OptimizerArgs

    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerArgs)}

    def ours(flag: str) -> float:
        value = train_flag(flag)
        return float(defaults[flag[2:].replace("-", "_")] if value is None else value)

    model = json.loads(Path(args.model_config).read_text())
    dropouts = {float(model.get(k, 0.1)) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}  # HF defaults
    if len(dropouts) != 1:
        raise SystemExit(f"error: {args.model_config}: nanoGPT has one dropout, the config has {sorted(dropouts)}")
    if ours("--adam-eps") != 1e-8:
        raise SystemExit("error: nanoGPT's AdamW has torch's eps 1e-8; TRAIN_ARGS asks for another")
    batch = args.batch_size
    return {
        "dataset": Path(args.corpus).stem, "out_dir": "out", "device": "cpu", "dtype": "float32", "compile": False,
        "init_from": "scratch", "wandb_log": False, "n_layer": int(model["n_layer"]), "n_head": int(model["n_head"]),
        "n_embd": int(model["n_embd"]), "block_size": args.max_len, "bias": True,
        "dropout": dropouts.pop(), "batch_size": batch,
        "gradient_accumulation_steps": int(train_flag("--gradient-accumulation")), "max_iters": args.steps,
        "learning_rate": args.nanogpt_lr, "weight_decay": ours("--weight-decay"),
        "beta1": ours("--adam-beta1"), "beta2": ours("--adam-beta2"), "grad_clip": ours("--max-grad-norm"),
        "decay_lr": True, "warmup_iters": args.warmup, "lr_decay_iters": args.steps, "min_lr": ours("--min-lr"),
        "eval_interval": args.eval_every, "eval_iters": -(-args.val_num // batch), "log_interval": 1,
        "always_save_checkpoint": True}


def nanogpt_command(args: argparse.Namespace) -> list[str]:
    """The command line, run in the seed's folder (`--key=value`: train.py's configurator overrides)."""
    overrides = [f"--{key}={value}" for key, value in nanogpt_settings(args).items()]
    return [sys.executable, str(Path(args.nanogpt).resolve() / "train.py"), "seed_offset.py", *overrides,
            *shlex.split(args.nanogpt_flags)]


def write_nanogpt_folder(folder: Path, seed: int, args: argparse.Namespace):
    """nanoGPT's working directory for `seed`; returns the held-out windows (our pickle reader's)."""
    import numpy as np

    from gpt2forge.data import DataRequest, load_datasets
    from gpt2forge.data.args import DataArgs

    max_len, stride = args.max_len, stride_for(args)
    vocab = int(json.loads(Path(args.model_config).read_text())["vocab_size"])
    corpus = DataArgs(dataset="pickle", input_files=[args.corpus], seed=seed, stride=stride, val_num=args.val_num,
                      windows="packed")
    data = load_datasets(DataRequest(corpus, max_len, vocab))
    held_out = np.concatenate([data.val.tokens[s:s + n].numpy() for s, n in data.val.windows.tolist()])
    if held_out.size <= max_len + 1:
        raise SystemExit(f"error: the {args.val_num} held-out windows hold {held_out.size} tokens; nanoGPT's "
                         f"get_batch needs more than {max_len + 1}: raise --val-num")
    data_dir = folder / "data" / Path(args.corpus).stem
    data_dir.mkdir(parents=True)
    data.train.stream.numpy().astype(np.uint16).tofile(data_dir / "train.bin")  # ids < vocab <= 65536: checked
    held_out.astype(np.uint16).tofile(data_dir / "val.bin")
    (data_dir / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": args.nanogpt_vocab_size}))
    (folder / "configurator.py").symlink_to(Path(args.nanogpt).resolve() / "configurator.py")
    (folder / "seed_offset.py").write_text(SEED_OFFSET.format(seed=seed))
    return data.val


@functools.cache
def nanogpt_gpt_class(folder: str):
    """The GPT and GPTConfig classes of `folder`/model.py, imported once under their own module name."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(folder) / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while GPTConfig is built
    spec.loader.exec_module(module)
    return module.GPT, module.GPTConfig


def held_out_loss(model, windows, batch_size: int = 8) -> float:
    """Token-weighted mean loss of a nanoGPT GPT over `windows` (items of max_len + 1 ids, padded with
    IGNORE_INDEX), as ours' evaluation computes it."""
    import torch
    import torch.nn.functional as F

    from gpt2forge.data import IGNORE_INDEX, split_batch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            input_ids, labels = split_batch(torch.stack([windows[j] for j in range(i, min(i + batch_size,
                                                                                          len(windows)))]))
            targets = torch.where(labels == IGNORE_INDEX, -1, labels)  # nanoGPT's ignore_index
            logits, _ = model(input_ids, targets)  # (B, T, V): with targets, every position's logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                     reduction="sum").item()
            count += int((labels != IGNORE_INDEX).sum())
    return total / count


def score_checkpoint(path: Path, windows, nanogpt_dir: str) -> float:
    """`held_out_loss` of the model in a nanoGPT checkpoint (out_dir/ckpt.pt), built by its own GPT class."""
    import torch

    GPT, GPTConfig = nanogpt_gpt_class(nanogpt_dir)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    with contextlib.redirect_stdout(io.StringIO()):  # GPT() prints its parameter count
        model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    return held_out_loss(model, windows)


# ------------------------------------------------------------------------------- runs


def stream(cmd: list[str], cwd: Path, on_line) -> float:
    """Run `cmd`, calling on_line(line, seconds since start) per output line; returns the wall time."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # nanoGPT prints without flushing: stamp lines as they come
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        on_line(line, time.monotonic() - start)
    wall = time.monotonic() - start
    if proc.wait() != 0:
        raise SystemExit(f"error: {shlex.join(cmd[:3])} ... failed (exit {proc.returncode}):\n{''.join(tail)}")
    return wall


def metrics_file(seed: int, tmp: Path) -> Path:
    """Where ours' run of `seed` writes its metrics."""
    return tmp / f"metrics_{seed}.jsonl"


def ours_flags(seed: int, args: argparse.Namespace, tmp: Path) -> list[str]:
    """train_gpt2.py's flags for ours' run of `seed`: TRAIN_ARGS with this benchmark's job, then --ours-flags."""
    flags = with_flags(make_train_args(), {
        "--input-files": args.corpus, "--model-config": args.model_config, "--seed": str(seed),
        "--max-len": str(args.max_len), "--stride": str(stride_for(args)), "--batch-size": str(args.batch_size),
        "--training-steps": str(args.steps), "--lr-warmup-steps": str(args.warmup),
        "--eval-every-steps": str(args.eval_every), "--val-num": str(args.val_num),
        "--checkpoint-output-dir": str(tmp / f"ours_{seed}"), "--save-per-steps": str(args.eval_every),
        "--sample-tokens": "0", "--sample-prompt": None, "--metrics-file": str(metrics_file(seed, tmp)),
        "--device": "cpu"})
    return flags + shlex.split(args.ours_flags)


def run_ours(seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    metrics = metrics_file(seed, tmp)
    curve = []

    def on_line(line: str, t: float) -> None:
        if (m := OURS_VALIDATION.search(line)) and int(m.group(1)) not in {s for s, _, _ in curve}:
            curve.append((int(m.group(1)), float(m.group(2)), round(t, 2)))

    wall = stream([sys.executable, str(ROOT / "train_gpt2.py"), *ours_flags(seed, args, tmp)], ROOT, on_line)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step_seconds"] for r in sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])]
    shutil.rmtree(tmp / f"ours_{seed}", ignore_errors=True)
    return {"curve": curve, "wall_s": round(wall, 2), "step_s": steps, "first_step_s": steps[0]}


def run_nanogpt(seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    folder = tmp / f"nanogpt_{seed}"
    windows = write_nanogpt_folder(folder, seed, args)
    saved, evals, steps, stamps = {}, [], {}, {}

    def on_line(line: str, t: float) -> None:
        if m := NANOGPT_EVAL.match(line):
            evals.append((int(m.group(1)), float(m.group(3)), round(t, 2)))
            stamps[f"eval {m.group(1)}"] = t
        elif m := NANOGPT_ITER.match(line):
            step = int(m.group(1))
            steps[step] = float(m.group(3)) / 1000
            stamps.setdefault(f"iter {step}", t)
            # A step's line follows the checkpoint its evaluation saved: move it aside before the next save.
            if step > 0 and step % args.eval_every == 0 and (folder / "out" / "ckpt.pt").is_file():
                os.replace(folder / "out" / "ckpt.pt", folder / f"ckpt_{step}.pt")
                saved[step] = folder / f"ckpt_{step}.pt"

    wall = stream(nanogpt_command(args), folder, on_line)
    last = max(s for s, _, _ in evals)
    if last not in saved:  # the loop stops after the update following its last evaluation
        saved[last] = folder / "out" / "ckpt.pt"
    t_of = {s: t for s, _, t in evals}
    curve = [(s, round(score_checkpoint(saved[s], windows, args.nanogpt), 4), t_of[s]) for s in sorted(saved)]
    shutil.rmtree(folder)
    timed = [steps[s] for s in sorted(steps)]
    return {"curve": curve, "wall_s": round(wall, 2), "step_s": timed,
            "first_step_s": round(stamps["iter 0"] - stamps["eval 0"], 3),  # its step 0 follows an evaluation
            "own_val_estimate": [(s, loss) for s, loss, _ in evals]}


def run_arm(arm: str, seed: int, args: argparse.Namespace, tmp: Path, first: bool) -> dict:
    load = wait_for_quiet(args.wait_quiet) if first else os.getloadavg()[0]  # later: our own last run's load
    run = (run_ours if arm == "ours" else run_nanogpt)(seed, args, tmp)
    run.update(arm=arm, seed=seed, load_at_start=load, step_s_median=statistics.median(run["step_s"][1:] or
                                                                                          run["step_s"]))
    print_run(run)
    return run


def print_run(run: dict, source: str = "") -> None:
    """One run's line: its held-out losses, median and first step, wall time, load (and `source`)."""
    arm, seed, load = run["arm"], run["seed"], run["load_at_start"]
    own = "".join(f", its own estimate {s}: {loss:.3f}" for s, loss in run.get("own_val_estimate", [])[-1:])
    print(f"{arm:8s} seed {seed}: " + ", ".join(f"{s}: {loss:.4f}" for s, loss, _ in run["curve"])
          + f"; step {run['step_s_median']:.3f} s, first {run['first_step_s']:.2f} s, wall {run['wall_s']:.1f} s "
          f"(load {load:.2f}{own}){source}", flush=True)


# ------------------------------------------------------------------------------- summary


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: list[dict]) -> dict:
    """Mean and stdev over seeds per arm that ran; with both arms, ours minus nanoGPT paired by seed at each
    evaluation (mean, standard error, seeds where ours is lower) and ours' wall time to nanoGPT's final loss
    over nanoGPT's wall time: per seed (None: not reached) and for the means (ours' mean curve: mean loss
    at mean time)."""
    summary: dict = {"arms": {}}
    for arm in ("ours", "nanogpt"):
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        steps = sorted({s for r in mine for s, _, _ in r["curve"]})
        summary["arms"][arm] = {
            "loss": {s: mean_std([loss for r in mine for step, loss, _ in r["curve"] if step == s]) for s in steps},
            "time": {s: statistics.mean(t for r in mine for step, _, t in r["curve"] if step == s) for s in steps},
            **{key: mean_std([r[key] for r in mine]) for key in ("step_s_median", "first_step_s", "wall_s")}}
    if len(summary["arms"]) < 2:
        return summary
    by = {(r["arm"], r["seed"]): r for r in runs}
    seeds = sorted({s for a, s in by if ("ours", s) in by and ("nanogpt", s) in by})
    paired = {}
    for step in summary["arms"]["ours"]["loss"]:
        diffs = [dict((s, x) for s, x, _ in by["ours", seed]["curve"])[step]
                 - dict((s, x) for s, x, _ in by["nanogpt", seed]["curve"])[step] for seed in seeds]
        mean, std = mean_std(diffs)
        paired[step] = {"mean": mean, "se": std / len(diffs) ** 0.5, "lower": sum(d < 0 for d in diffs),
                        "n": len(diffs)}
    ratios = {}
    for s in seeds:
        t = time_to(by["ours", s]["curve"], by["nanogpt", s]["curve"][-1][1])
        ratios[s] = None if t is None else t / by["nanogpt", s]["wall_s"]
    ours, peer = summary["arms"]["ours"], summary["arms"]["nanogpt"]
    final = peer["loss"][max(peer["loss"])][0]
    t = time_to([(s, ours["loss"][s][0], ours["time"][s]) for s in sorted(ours["loss"])], final)
    summary.update(paired=paired, wall_ratios=ratios, mean_wall_ratio=None if t is None else t / peer["wall_s"][0])
    return summary


def verdict(ratio: float | None, what: str) -> str:
    if ratio is None:
        return f"not within the run: MISSED (target <= {TARGET_WALL_RATIO})"
    met = "met" if ratio <= TARGET_WALL_RATIO else "MISSED"
    return f"in {ratio:.2f}x {what} (target <= {TARGET_WALL_RATIO}): {met}"


def report(summary: dict, seeds: list[int]) -> None:
    arms = summary["arms"]
    names = [a for a in ("ours", "nanogpt") if a in arms]
    print(f"\nmean +- stdev over seeds {seeds}{'':10s}" + "".join(f"{a:>20s}" for a in names))
    steps = sorted({s for a in names for s in arms[a]["loss"]})
    rows = [(f"held-out loss at {s}", "loss", s, "{:.4f}") for s in steps]
    rows += [("step s (median)", "step_s_median", None, "{:.3f}"), ("first step s", "first_step_s", None, "{:.2f}"),
             ("wall s", "wall_s", None, "{:.1f}")]
    for name, key, step, fmt in rows:
        cells = [arms[a][key].get(step) if step is not None else arms[a][key] for a in names]
        print(f"{name:40s}" + "".join(f"{fmt.format(c[0]) + ' +- ' + fmt.format(c[1]):>20s}" if c else f"{'':20s}"
                                      for c in cells))
    if "paired" not in summary:
        return
    last = max(summary["paired"])
    for step, d in sorted(summary["paired"].items()):
        target = (f"target <= {TARGET_FINAL_LEAD}: {'met' if d['mean'] <= TARGET_FINAL_LEAD else 'MISSED'}"
                  if step == last else f"target <= 0: {'met' if d['mean'] <= 0 else 'MISSED'}")
        print(f"ours minus nanoGPT at {step}, paired over {d['n']} seeds: {d['mean']:+.4f} (SE {d['se']:.4f}; "
              f"ours lower in {d['lower']} of {d['n']}; {target})")
    for s, ratio in summary["wall_ratios"].items():
        print(f"seed {s}: ours reaches nanoGPT's final held-out loss {verdict(ratio, 'its wall time')}")
    print(f"mean over seeds: ours reaches nanoGPT's mean final held-out loss "
          f"{verdict(summary['mean_wall_ratio'], 'its mean wall time')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if problem := usage_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    command = nanogpt_command(args)
    print(f"{args.steps} updates, held-out every {args.eval_every} ({args.val_num} windows), seeds {seeds}, "
          f"ours flags: {args.ours_flags or '(Makefile TRAIN_ARGS)'}\nnanoGPT, in a folder per seed: "
          f"{shlex.join(command[1:])}", flush=True)
    reused = {}
    if args.nanogpt_runs:
        reused = reused_nanogpt_runs(args, seeds)
        if isinstance(reused, str):
            print(f"error: {reused}", file=sys.stderr)
            return 2
        print(f"nanoGPT's runs: from {args.nanogpt_runs} (ours only runs now)")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, seed in enumerate(seeds):
            for arm in ("ours", "nanogpt") if k % 2 == 0 else ("nanogpt", "ours"):  # load drift hits both
                if arm not in args.arms.split(","):
                    continue
                if arm == "nanogpt" and reused:
                    runs.append(reused[seed])
                    print_run(reused[seed], f" [from {args.nanogpt_runs}]")
                    continue
                runs.append(run_arm(arm, seed, args, Path(tmp), first=not runs))
    summary = summarize(runs)
    report(summary, seeds)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "nanogpt_command": command[1:], "runs": runs,
                                               "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
