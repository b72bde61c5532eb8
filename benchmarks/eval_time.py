"""Zero-shot evaluation time of gpt2forge vs `transformers.GPT2LMHeadModel`, side by side in one run.

Both compute the same protocol on the same GPT-2 small-shaped model (random init, the same weights
copied into HF's layout), on the real test sets (`make eval-data` caches them; --data-dir overrides):

  LAMBADA   5,153 passages, non-strict, --seq-length 1024 (no passage is that long)
  WikiText  wiki.test.tokens, detokenized, windows of --seq-length with --stride (overlapping-eval)

  ours          gpt2forge.evaluation: batches of --batch-size (LAMBADA sorted by length), the LM head
                and the log-softmax only at the scored positions
  transformers  one window / passage at a time, `model(ids).logits` for every position, the
                cross-entropy of the scored ones (what the HF perplexity guide does)

Work is split into chunks (same chunks for both) and timed interleaved ours, transformers, ours, ...
so load from other processes hits both alike (the median of the per-chunk ratios is printed too: a
burst of load during one chunk skews the totals); the loss sums of both are printed and must agree.
fp32 on CPU (the project's CPU default). The target is a ratio (>= 2x), reported, never asserted.

    .venv/bin/python benchmarks/eval_time.py                 # full sets (long on 2 cores)
    .venv/bin/python benchmarks/eval_time.py --limit 200     # 200 passages over all lengths / first 200 windows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.evaluation.data import read_json_lines, read_text  # noqa: E402
from gpt2forge.evaluation.detokenizer import wikitext_detokenizer  # noqa: E402
from gpt2forge.evaluation.fetch import cache_dir, missing_message  # noqa: E402
from gpt2forge.evaluation.protocol import Window, WindowPlan, build_cloze_examples  # noqa: E402
from gpt2forge.evaluation.scoring import evaluate_cloze, score_windows  # noqa: E402
from gpt2forge.model.checkpoint import to_hf_state_dict  # noqa: E402
from gpt2forge.model.config import ModelConfig  # noqa: E402
from gpt2forge.model.gpt2 import GPT2LMHeadModel  # noqa: E402
from gpt2forge.text.tokenizer import load_tokenizer  # noqa: E402

TARGET = 2.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", default=str(cache_dir()),
                   help="folder with wikitext/ and lambada/ (default: the cache `make eval-data` fills)")
    p.add_argument("--tasks", nargs="+", default=["lambada", "wikitext"], choices=("lambada", "wikitext"))
    p.add_argument("--limit", type=int, default=None,
                   help="N passages spread over all lengths / the first N windows only (a quick variant)")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--stride", type=int, default=1024, help="WikiText --overlapping-eval")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk", type=int, default=64, help="passages / windows per interleaved timing chunk")
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args(argv)


def build_models(seq_len: int):
    cfg = ModelConfig.preset("gpt2")
    cfg.n_positions = max(seq_len, 1024)
    ours = GPT2LMHeadModel(cfg)
    ours.init_weights(torch.Generator().manual_seed(0))
    ours.eval()
    import transformers

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg.to_hf_dict())).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    hf.tie_weights()
    return ours, hf


@torch.no_grad()
def hf_windows(hf, tokens: np.ndarray, windows: list[Window]) -> float:
    total = 0.0
    for w in windows:
        x = torch.from_numpy(tokens[w.start:w.start + w.length])[None]
        y = torch.from_numpy(tokens[w.start + 1:w.start + w.length + 1])[-w.scored:]
        logits = hf(x).logits[0]  # (T, V): every position
        total += float(F.cross_entropy(logits[-w.scored:].float(), y, reduction="sum"))
    return total


@torch.no_grad()
def hf_cloze(hf, examples) -> tuple[float, int]:
    total, correct = 0.0, 0
    for ex in examples:
        seq = torch.tensor(ex.context + ex.target)
        k = len(ex.target)
        logits = hf(seq[None, :-1]).logits[0, -k:].float()
        total += float(F.cross_entropy(logits, seq[-k:], reduction="sum"))
        correct += int(bool((logits.argmax(-1) == seq[-k:]).all()))
    return total, correct


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def run_lambada(args, ours, hf, tok) -> dict:
    texts = read_json_lines(Path(args.data_dir) / "lambada" / "lambada_test.jsonl", "text", "--data-dir")
    examples = build_cloze_examples(texts, tok.encode, False, args.seq_length)
    examples.sort(key=lambda e: len(e.context) + len(e.target))  # ours batches by length anyway
    if args.limit:
        examples = examples[:: max(1, len(examples) // args.limit)][: args.limit]  # spread over all lengths
    t_ours = t_hf = loss_ours = loss_hf = 0.0
    ratios = []
    for i in range(0, len(examples), args.chunk):
        part = examples[i:i + args.chunk]
        res, dt_ours = timed(lambda part=part: evaluate_cloze(ours, part, False, batch_size=args.batch_size,
                                                              progress=False))
        t_ours += dt_ours
        loss_ours += res.loss_sum
        (loss, _), dt = timed(hf_cloze, hf, part)
        t_hf += dt
        loss_hf += loss
        ratios.append(dt / dt_ours)
        print(f"  lambada {min(i + args.chunk, len(examples))}/{len(examples)}: ours {t_ours:.1f} s, "
              f"transformers {t_hf:.1f} s", flush=True)
    tokens = sum(len(e.context) + len(e.target) - 1 for e in examples)
    return {"task": "lambada", "examples": len(examples), "tokens": tokens, "ours_s": t_ours, "transformers_s": t_hf,
            "speedup": t_hf / t_ours, "median_chunk_speedup": statistics.median(ratios),
            "loss_sum_ours": loss_ours, "loss_sum_transformers": loss_hf}


def run_wikitext(args, ours, hf, tok) -> dict:
    text = read_text(Path(args.data_dir) / "wikitext" / "wiki.test.tokens", "--data-dir")
    tokens = np.asarray(tok.encode(wikitext_detokenizer(text)), dtype=np.int64)
    plan = WindowPlan(len(tokens), args.seq_length, args.stride)
    n = len(plan) if not args.limit else min(len(plan), args.limit)
    t_ours = t_hf = loss_ours = loss_hf = 0.0
    ratios = []
    for first in range(0, n, args.chunk):
        ids = range(first, min(first + args.chunk, n))
        windows = [plan[i] for i in ids]
        res, dt_ours = timed(_ours_windows, ours, tokens, windows, args.batch_size)
        t_ours += dt_ours
        loss_ours += res
        loss, dt = timed(hf_windows, hf, tokens, windows)
        t_hf += dt
        loss_hf += loss
        ratios.append(dt / dt_ours)
        print(f"  wikitext {ids[-1] + 1}/{n} windows: ours {t_ours:.1f} s, transformers {t_hf:.1f} s", flush=True)
    return {"task": "wikitext", "windows": n, "seq_length": args.seq_length, "stride": args.stride,
            "tokens_scored": sum(plan[i].scored for i in range(n)), "ours_s": t_ours, "transformers_s": t_hf,
            "speedup": t_hf / t_ours, "median_chunk_speedup": statistics.median(ratios),
            "loss_sum_ours": loss_ours, "loss_sum_transformers": loss_hf}


def _ours_windows(model, tokens: np.ndarray, windows: list[Window], batch_size: int) -> float:
    """The same windows through gpt2forge's batched scoring (what evaluate_stream runs per batch)."""
    return sum(float(score_windows(model, tokens, windows[b:b + batch_size]).nll.sum())
               for b in range(0, len(windows), batch_size))


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = [t for t in args.tasks if not (Path(args.data_dir) / t).is_dir()]
    if missing:
        print(f"error: --data-dir: {missing_message(missing, Path(args.data_dir))}", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.2f} at start "
          f"({'contended' if load > 0.5 else 'quiet'} machine)", flush=True)
    ours, hf = build_models(args.seq_length)
    tok = load_tokenizer()
    # Warm-up both (first-call allocations, kernel selection), untimed.
    warm = torch.randint(0, 50257, (1, 64))
    with torch.no_grad():
        ours(warm), hf(warm)
    results = []
    for task in args.tasks:
        res = (run_lambada if task == "lambada" else run_wikitext)(args, ours, hf, tok)
        rel = abs(res["loss_sum_ours"] - res["loss_sum_transformers"]) / abs(res["loss_sum_transformers"])
        res["loss_rel_diff"] = rel
        res["load_average_end"] = os.getloadavg()[0]
        results.append(res)
        verdict = "meets" if min(res["speedup"], res["median_chunk_speedup"]) >= TARGET else "MISSES"
        print(f"{task}: ours {res['ours_s']:.1f} s, transformers {res['transformers_s']:.1f} s, "
              f"speedup {res['speedup']:.2f}x (median over chunks {res['median_chunk_speedup']:.2f}x; {verdict} "
              f"the {TARGET}x target); loss sums agree to {rel:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
