"""The memory plan (--plan): measured block activations, the per-stage accounting of weights,
gradients, optimizer state and activations under ZeRO, offload, recomputation and the schedules."""

import re

import pytest
import torch

from gpt2forge.cli import train_main
from gpt2forge.frontends.graphcore import parse_args
from gpt2forge.model.config import ModelConfig
from gpt2forge.parallel.memory_plan import block_activation_bytes, build_plan, stage_params

SMALL = ModelConfig.preset("gpt2")
ACT = 10 * 2**20  # a fixed per-block activation size for the accounting tests


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_fake_tensor_measurement_equals_a_real_forward(dropout, dtype):
    cfg = ModelConfig(vocab_size=96, n_positions=64, n_embd=64, n_layer=1, n_head=4, resid_pdrop=dropout,
                      embd_pdrop=dropout, attn_pdrop=dropout)
    cpu = torch.device("cpu")
    real = block_activation_bytes(cfg, 2, 64, cpu, dtype, fake=False)
    assert block_activation_bytes(cfg, 2, 64, cpu, dtype, fake=True) == real
    # Linear in the batch in fp32 (autocast adds the block's bf16 weight copies once per forward);
    # dropout keeps its masks.
    if dtype is None:
        assert block_activation_bytes(cfg, 4, 64, cpu, dtype) == 2 * real
    if dropout:
        assert real > block_activation_bytes(ModelConfig(vocab_size=96, n_positions=64, n_embd=64, n_layer=1,
                                                         n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                                             2, 64, cpu, dtype)


def test_stage_parameters_add_up_to_the_model_plus_the_head_copy():
    counts = stage_params(SMALL, (0, 4, 4, 4))
    assert sum(counts) == sum(stage_params(SMALL, (12,))) + SMALL.padded_vocab_size * SMALL.n_embd
    model_params = SMALL.num_params() + (SMALL.padded_vocab_size - SMALL.vocab_size) * SMALL.n_embd
    assert stage_params(SMALL, (12,))[0] == model_params


def plan(*flags: str, zero: int = 0):
    cfg = parse_args(["--dataset", "generated", "--model", "gpt2", "--max-len", "1024", "--batch-size", "2", *flags])
    return build_plan(cfg.parallel, cfg.memory, SMALL, cfg.arch.max_len, torch.device("cpu"), None, zero,
                      activation_bytes=ACT)


def test_sharding_offload_and_recompute_move_what_they_should():
    base = plan("--replication-factor", "4")[0]
    P = base.params
    assert (base.weights, base.grads, base.optimizer, base.host) == (4 * P, 4 * P, 8 * P, 0)
    z1 = plan("--replication-factor", "4", zero=1)[0]
    assert (z1.weights, z1.grads, z1.optimizer) == (4 * P, 4 * P, 2 * P)
    z3 = plan("--replication-factor", "4", zero=3)[0]
    # ZeRO-3: a quarter of the fp32 weights, plus the gathered root unit (embeddings, ln_f: gathered
    # through forward and backward) and two gathered blocks.
    root = P - 12 * SMALL.block_params
    assert z3.grads == P and z3.optimizer == 2 * P and z3.weights == P + 4 * (root + 2 * SMALL.block_params)
    off = plan("--replication-factor", "4", "--optimizer-state-offchip", "true", zero=1)[0]
    assert off.optimizer == 0 and off.host == 3 * P  # moments + fp32 copy of the shard
    assert base.activations == 12 * ACT + 2 * 2 * 1024 * 768 * 4  # one micro-batch, plus the embedding
    rc = plan("--replication-factor", "4", "--recompute-checkpoint-every-layer", "true")[0]
    assert rc.activations == 12 * 2 * 1024 * 768 * 4 + 2 * 2 * 1024 * 768 * 4 + ACT
    plain = plan("--lm-loss", "plain")[0]
    assert plain.head == 3 * 4 * 2 * 1024 * SMALL.padded_vocab_size and base.head < plain.head / 4


def test_schedules_keep_their_micro_batches_in_flight():
    layout = ("--layers-per-ipu", "0", "4", "4", "4", "--ipus-per-replica", "4", "--gradient-accumulation", "8")
    gpipe = plan(*layout, "--pipeline-schedule", "GPipe")
    one_f_one_b = plan(*layout, "--pipeline-schedule", "1F1B")
    assert [p.activations for p in gpipe[1:]] == [8 * 4 * ACT] * 3
    assert [p.activations for p in one_f_one_b[1:]] == [3 * 4 * ACT, 2 * 4 * ACT, 1 * 4 * ACT]
    assert gpipe[0].head == 0 and gpipe[-1].head > 0


def test_plan_flag_prints_the_table_and_trains_nothing(capsys):
    assert train_main(["--plan", "--model", "gpt2", "--max-len", "1024", "--batch-size", "8",
                       "--layers-per-ipu", "0", "4", "4", "4", "--ipus-per-replica", "4", "--replication-factor", "2",
                       "--gradient-accumulation", "8", "--replicated-tensor-sharding", "true"]) == 0
    out = capsys.readouterr().out
    assert "4 stage(s) x 2 replica(s) = 8 process(es)" in out and "ZeRO 1" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+M", line)]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3] and [int(r[1]) for r in rows] == [0, 4, 4, 4]
    assert re.search(r"All 8 process\(es\) on this host: [\d.]+ GiB of host memory .*: (fits|does not fit)", out)
    whole = 4 * 124_475_904 / 2**30  # the whole gpt2 (padded vocabulary) in fp32, kept by rank 0 of a pipeline
    assert f"+{whole:.2f} GiB" in out
    assert "step 0" not in out


def test_balanced_split_minimizes_the_slowest_stage():
    from itertools import product

    from gpt2forge.parallel.memory_plan import balanced_layers, stage_flops

    # GPT-2 small: the LM head (6 V C per token) weighs about 4.4 blocks, so the reference's
    # `0 4 4 4` (its IPU layout, which ran the head on stage 0) leaves the last stage twice as slow.
    assert balanced_layers(SMALL, 4, 1024) == (4, 4, 4, 0)
    cfg = ModelConfig(vocab_size=5000, n_positions=128, n_embd=64, n_layer=7, n_head=4)
    splits = [s for s in product(range(8), repeat=3) if sum(s) == 7]
    best = min(max(stage_flops(cfg, s, 128)) for s in splits)
    got = balanced_layers(cfg, 3, 128)
    assert sum(got) == 7 and max(stage_flops(cfg, got, 128)) == best


def test_plan_suggests_the_balanced_split(capsys):
    assert train_main(["--plan", "--model", "gpt2", "--max-len", "1024", "--layers-per-ipu", "0", "4", "4", "4",
                       "--ipus-per-replica", "4", "--gradient-accumulation", "8"]) == 0
    out = capsys.readouterr().out
    assert "Compute per stage (share of the step): stage 0 0%, stage 1 24%, stage 2 24%, stage 3 51%" in out
    assert "Balanced compute: --layers-per-ipu 4 4 4 0 (slowest stage 27% of the step instead of 51%)" in out


def test_full_offload_keeps_only_gathered_copies_on_the_device():
    """One process, ZeRO-3 with FSDP2's CPU offload: the fp32 weights, gradients and moments (16 P)
    on the host; on the device the gathered root unit and two blocks, and one unit's gradient."""
    full = plan("--offload", "full", zero=3)[0]
    P, block = full.params, SMALL.block_params
    root = P - 12 * block
    assert (full.host, full.optimizer) == (16 * P, 0)
    assert (full.weights, full.grads) == (4 * (root + 2 * block), 4 * root)
    optimizer = plan("--offload", "optimizer")[0]
    assert (optimizer.host, optimizer.optimizer, optimizer.weights) == (12 * P, 0, 4 * P)


def test_plan_answers_which_sizes_fit_one_device(capsys, monkeypatch):
    import gpt2forge.parallel.memory_plan as memory_plan

    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: 2.0**40)  # a 1 TiB host: the device decides
    assert train_main(["--plan", "--model", "gpt2", "--max-len", "1024", "--device-memory-gib", "16"]) == 0
    out = capsys.readouterr().out
    assert "One device: 16.0 GiB (--device-memory-gib), micro-batch 1 x 1024, fp32" in out
    cells = {}  # (model, recompute) -> [(device GiB, host GiB, verdict)] for no, optimizer, full offload
    for m in re.finditer(r"^  (gpt2\S*)\s+[\d.]+M  (no|yes)\s+(.*)$", out, re.M):
        cells[m[1], m[2]] = [(float(d), float(h), v) for d, h, v in re.findall(r"([\d.]+) / +([\d.]+) (\w+)", m[3])]
    assert len(cells) == 8 and all(len(c) == 3 for c in cells.values())
    xl = ModelConfig.preset("gpt2-xl")
    P = stage_params(xl, (xl.n_layer,))[0]
    for recompute in ("no", "yes"):
        none, optimizer, full = cells["gpt2-xl", recompute]
        assert none[2] == "no" and none[0] > 16 * P / 2**30 - 0.01  # 16 bytes a parameter on the device
        assert full[1] == pytest.approx(16 * P / 2**30, abs=0.01) and optimizer[1] == pytest.approx(12 * P / 2**30,
                                                                                                    abs=0.01)
        assert full[0] < optimizer[0] < none[0]
    assert cells["gpt2-xl", "yes"][2][2] == "fits"  # full offload with recomputation: 1.5B parameters on 16 GiB
    assert all(c[0][2] == "fits" for (name, _), c in cells.items() if name == "gpt2")
    assert re.search(r"^Largest that fits: no offload: \S+.*, full offload: gpt2-xl", out, re.M)
