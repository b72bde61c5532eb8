"""Training tokens/s with --reset-attention-mask (block-causal attention over packed documents)
against plain causal attention, in the same process, steps interleaved.

    .venv/bin/python benchmarks/document_mask_speed.py            # GPT-2 small, T=1024 (minutes on CPU)
    .venv/bin/python benchmarks/document_mask_speed.py --tiny     # a quick check of the script

Rows are packed as the mmap reader packs them: documents end to end, each ended by EOD (50256),
lengths drawn from an exponential distribution of mean `--doc-len` (one run per mean; short
documents let the attention skip most of the causal triangle). Each repeat times one training
step (forward, backward, AdamW update, as train_step does with the flags: document ids and
positions from `document_layout`, then the model) without the mask and one with it, alternating,
after a warm-up step of each; tokens/s is B*T / step time, the median over repeats. The target
(issue 17): with/without >= 0.9x, higher where documents are short. The machine's load average is
printed, with a warning when other work shares the cores (the ratio is then unreliable).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpt2forge.model.config import ModelConfig  # noqa: E402
from gpt2forge.model.documents import document_layout  # noqa: E402
from gpt2forge.model.gpt2 import GPT2LMHeadModel  # noqa: E402

EOD = 50256


def packed_rows(B: int, T: int, mean_len: float, vocab: int, seed: int) -> torch.Tensor:
    """(B, T + 1) ids: documents of exponential lengths (mean `mean_len`, at least 2), each ending in EOD."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row: list[int] = []
        while len(row) < T + 1:
            n = max(2, int(torch.empty(1).exponential_(1.0 / mean_len, generator=g)))
            row += torch.randint(0, min(vocab, EOD), (n - 1,), generator=g).tolist() + [EOD]
        rows.append(row[:T + 1])
    return torch.tensor(rows)


def step_seconds(model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer, batch: torch.Tensor, masked: bool) -> float:
    """One training step's wall time: ids (when `masked`), forward + backward, the update."""
    start = time.perf_counter()
    x, y = batch[:, :-1], batch[:, 1:]
    layout = document_layout(x, EOD, masked, masked)
    out = model(x, y, *layout)
    (out.loss_sum / out.tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def warn_if_loaded(own_threads: int = 0) -> None:
    """Print the load average; warn when work other than this run's `own_threads` shares the cores."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    print(f"load average (1 min): {load:.2f} on {cores} cores ({own_threads} of it this run's own threads)")
    if load - own_threads > 0.5 * cores:
        print(f"WARNING: load {load:.2f} > this run's {own_threads} threads + half of {cores} cores: other work "
              "shares the CPU, the ratio is unreliable")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer model, T=128: checks the script in seconds")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per step (default 4, tiny 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="T (default 1024, tiny 128)")
    parser.add_argument("--doc-len", type=float, nargs="+", default=None,
                        help="mean document lengths, one run each (default: 400 64; tiny: 40)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each kind (default 3, tiny 2)")
    args = parser.parse_args()
    tiny = args.tiny
    B = args.batch_size or (2 if tiny else 4)
    T = args.seq_len or (128 if tiny else 1024)
    doc_lens = args.doc_len or ([40.0] if tiny else [400.0, 64.0])
    repeats = args.repeats or (2 if tiny else 3)
    shape = dict(n_layer=2, n_embd=64, n_head=2) if tiny else {}  # default ModelConfig: GPT-2 small
    cfg = ModelConfig(n_positions=max(T, 1024), **shape)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.init_weights()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    warn_if_loaded()
    print(f"model n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head} attn_pdrop={cfg.attn_pdrop}, "
          f"B={B}, T={T}, torch threads {torch.get_num_threads()}")
    for i, mean_len in enumerate(doc_lens):
        batch = packed_rows(B, T, mean_len, cfg.vocab_size, seed=i)
        docs = int((batch[:, :-1] == EOD).sum()) + B
        times: dict[bool, list[float]] = {False: [], True: []}
        for masked in (False, True):  # warm-up: allocator, first-call costs
            step_seconds(model, optimizer, batch, masked)
        for _ in range(repeats):
            for masked in (False, True):
                times[masked].append(step_seconds(model, optimizer, batch, masked))
        plain, masked = (B * T / statistics.median(times[k]) for k in (False, True))
        print(f"mean document length {mean_len:.0f} ({docs} documents in {B} rows): causal {plain:.0f} tokens/s, "
              f"--reset-attention-mask {masked:.0f} tokens/s, ratio {masked / plain:.3f}")
    warn_if_loaded(torch.get_num_threads())
    return 0


if __name__ == "__main__":
    sys.exit(main())
