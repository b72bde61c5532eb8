"""Learning per update in lockstep: ours' training components against nanoGPT's, from the same weights
on the same batches, so that only the implementations differ.

peer_nanogpt.py compares the two programs as users run them: each draws its own initial weights and
its own batches, so a difference in held-out loss mixes the implementations with those draws (seed
to seed, a paired difference at 300 updates spreads by about 0.15). This script removes the draws:

  - one nanoGPT GPT (DIR/model.py, its own initialisation seeded 1337 + seed, `make train`'s shape,
    vocabulary 50,304) and ours (gpt2forge.model.gpt2, the model config) holding a copy of its weights
    (ours' 47 padding rows zeroed: ours masks them out of the softmax);
  - every update, one batch of 8 x 128 tokens at uniform random starts in the training stream
    (nanoGPT's get_batch), the same for both;
  - nanoGPT: its configure_optimizers (AdamW, decay on parameters of 2 or more dimensions), its
    get_lr (warm-up (i + 1) / (W + 1), cosine to 0), clip_grad_norm_(1.0), fp32, eager;
  - ours: train.optim.build_optimizer, train.schedule.build_lr_schedule (warm-up i / W, cosine to 0),
    the host gradient clip, the fused LM head + loss, in `--precision` (bf16: CPU autocast) and
    optionally compiled as the trainer does (`--compile`);
  - both scored in fp32 on the held-out windows peer_nanogpt.py uses for that seed (token-weighted).

What remains between the two: GELU (ours' gelu_new, tanh; nanoGPT's exact), the warm-up's first
steps, the padding classes, and the precision asked for.

    .venv/bin/python benchmarks/nanogpt_lockstep.py --nanogpt ~/nanoGPT --seeds 0,1,2
    .venv/bin/python benchmarks/nanogpt_lockstep.py --nanogpt ~/nanoGPT --precision bf16 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import peer_nanogpt

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nanogpt", required=True, help="a karpathy/nanoGPT folder (its model.py is used)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (initial weights, batches, held-out windows)")
    p.add_argument("--steps", type=int, default=int(peer_nanogpt.train_flag("--training-steps")))
    p.add_argument("--warmup", type=int, default=int(peer_nanogpt.train_flag("--lr-warmup-steps")))
    p.add_argument("--val-num", type=int, default=int(peer_nanogpt.train_flag("--val-num")))
    p.add_argument("--corpus", default=str(ROOT / "build" / "stdlib_docs.pkl"))
    p.add_argument("--model-config", default=str(ROOT / "config" / "config_mini.json"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="ours' precision")
    p.add_argument("--compile", action="store_true", help="ours under torch.compile, as the trainer runs it")
    p.add_argument("--json", default=None, help="write the per-seed losses here")
    args = p.parse_args(argv)
    if not (Path(args.nanogpt) / "model.py").is_file():
        p.error(f"--nanogpt {args.nanogpt}: no model.py there (clone https://github.com/karpathy/nanoGPT)")
    return args


def nano_lr(it: int, lr: float, warmup: int, decay: int) -> float:
    """nanoGPT train.py's get_lr with min_lr 0."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (decay - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * ratio)) * lr


def run_seed(seed: int, args: argparse.Namespace) -> dict:
    import peer_nanogpt
    import torch

    from gpt2forge.core.graph_passes import compile_options
    from gpt2forge.data import DataRequest, load_datasets, split_batch
    from gpt2forge.data.args import DataArgs
    from gpt2forge.model.config import ModelConfig
    from gpt2forge.model.gpt2 import GPT2LMHeadModel
    from gpt2forge.ops.lm_head_loss import LossChunking
    from gpt2forge.parallel.data_parallel import clip_host_grads
    from gpt2forge.train.optim import build_optimizer
    from gpt2forge.train.schedule import build_lr_schedule

    GPT, GPTConfig = peer_nanogpt.nanogpt_gpt_class(args.nanogpt)
    cfg = ModelConfig.from_json(args.model_config)
    max_len = int(peer_nanogpt.train_flag("--max-len"))
    lr, wd = float(peer_nanogpt.train_flag("--learning-rate")), float(peer_nanogpt.train_flag("--weight-decay"))
    clip = float(peer_nanogpt.train_flag("--max-grad-norm"))
    batch = int(peer_nanogpt.train_flag("--batch-size"))
    corpus = DataArgs(dataset="pickle", input_files=[args.corpus], seed=seed,
                      stride=int(peer_nanogpt.train_flag("--stride")), val_num=args.val_num, windows="packed")
    data = load_datasets(DataRequest(corpus, max_len, cfg.vocab_size))
    train = data.train.stream.long()
    torch.manual_seed(1337 + seed)
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter count and groups
        nano = GPT(GPTConfig(block_size=max_len, vocab_size=50304, n_layer=cfg.n_layer, n_head=cfg.n_head,
                             n_embd=cfg.n_embd, dropout=0.0, bias=True))
        opt_n = nano.configure_optimizers(wd, lr, (0.9, 0.999), "cpu")
    ours = GPT2LMHeadModel(cfg)
    ours.load_state_dict({k: v for k, v in nano.state_dict().items() if not k.endswith(".attn.bias")})
    with torch.no_grad():
        ours.transformer.wte.weight[cfg.vocab_size:].zero_()
    ours.fused_loss = LossChunking()
    forward = torch.compile(ours, options=compile_options()) if args.compile else ours
    opt_o = build_optimizer(ours, "AdamW", lr, wd)
    schedule = build_lr_schedule(opt_o, "cosine", args.steps, args.warmup)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for it in range(args.steps):
        starts = torch.randint(len(train) - max_len - 1, (batch,), generator=gen)
        x = torch.stack([train[s:s + max_len] for s in starts])
        y = torch.stack([train[s + 1:s + max_len + 1] for s in starts])
        for group in opt_n.param_groups:
            group["lr"] = nano_lr(it, lr, args.warmup, args.steps)
        _, loss_n = nano(x, y)
        loss_n.backward()
        torch.nn.utils.clip_grad_norm_(nano.parameters(), clip)
        opt_n.step()
        opt_n.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            out = forward(x, y)
        loss_o = out.loss_sum / out.tokens
        loss_o.backward()
        clip_host_grads([p.grad for p in ours.parameters()], clip)
        opt_o.step()
        schedule.step()
        opt_o.zero_grad(set_to_none=True)
        curve.append((round(loss_n.item(), 4), round(loss_o.item(), 4)))
    held_n = peer_nanogpt.held_out_loss(nano, data.val)
    ours.eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(data.val), 8):
            rows = torch.stack([data.val[j] for j in range(i, min(i + 8, len(data.val)))])
            out = ours(*split_batch(rows))
            total, count = total + out.loss_sum.item(), count + out.tokens.item()
    return {"seed": seed, "nanogpt": held_n, "ours": total / count, "train_loss_curve": curve}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"lockstep, {args.steps} updates, ours in {args.precision}{' compiled' if args.compile else ' eager'}, "
          f"seeds {seeds}", flush=True)
    runs = []
    for seed in seeds:
        r = run_seed(seed, args)
        runs.append(r)
        print(f"seed {seed}: held-out loss nanoGPT {r['nanogpt']:.4f}, ours {r['ours']:.4f}, ours - nanoGPT "
              f"{r['ours'] - r['nanogpt']:+.4f}", flush=True)
    diffs = [r["ours"] - r["nanogpt"] for r in runs]
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    print(f"mean ours - nanoGPT: {statistics.mean(diffs):+.4f} (stdev {spread:.4f}, {len(diffs)} seed(s))")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
