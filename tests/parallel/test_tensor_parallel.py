"""Tensor parallelism (DTensor, gloo on CPU, launched with torchrun): the same step lines as one
process within fp32 rounding, with data parallelism and sequence parallelism too, checkpoints that
resume under another layout, Megatron's dropout streams, and the layout errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL
from test_distributed import ROOT, run  # the torchrun harness (pytest puts tests/parallel on the path)

from gpt2forge.core.errors import UsageError
from gpt2forge.parallel.distributed import DistEnv, check_world
from gpt2forge.parallel.strategy import ParallelRequest, select_strategy
from gpt2forge.parallel.tensor_parallel import head_order
from gpt2forge.parallel.topology import Layout, ParallelArgs, build_layout, check_tensor_parallel

TOLERANCE = 2e-5
"""Step-line losses vs one process: the same math, summed in another order over the vocabulary
shards and the all-reduces (fp32)."""


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    # 4 heads; vocab 96 pads to 128: rank 1 of 2 holds 32 real and 32 padded rows of the embedding.
    path = tmp_path_factory.mktemp("tp") / "tiny.json"
    path.write_text(json.dumps({**TINY_MODEL, "n_positions": 32, "n_head": 4, "resid_pdrop": 0.0,
                                "embd_pdrop": 0.0, "attn_pdrop": 0.0}))
    return path


@pytest.fixture(scope="module")
def single(tiny_config, tmp_path_factory) -> tuple[list[str], Path]:
    """One process's step lines (--replication-factor 2 becomes accumulation) and its checkpoint dir."""
    ckpt = tmp_path_factory.mktemp("single")
    return run(args(tiny_config, "--checkpoint-output-dir", str(ckpt), "--save-per-steps", "2")), ckpt


def args(cfg, *extra: str) -> list[str]:
    return ["train_gpt2.py", "--model-config", str(cfg), "--dataset", "generated", "--max-len", "16",
            "--batch-size", "2", "--gradient-accumulation", "2", "--device-iterations", "1", "--training-steps",
            "5", "--num-workers", "0", "--learning-rate", "3e-3", "--lr-schedule", "cosine", "--optimizer", "AdamW",
            "--weight-decay", "0.1", "--max-grad-norm", "0.5", "--replication-factor", "2", *extra]


def parsed(lines: list[str]) -> list[tuple[float, float, str]]:
    """(loss, accuracy, rest) of each step line."""
    out = []
    for line in lines:
        m = re.match(r"(step .*), loss: (\S+), acc: (\S+), (lr: \S+)", line)
        out.append((m.group(1), float(m.group(2)), float(m.group(3)), m.group(4)))
    return out


def assert_close(got: list[str], expected: list[str]) -> None:
    assert len(got) == len(expected) and expected
    for g, e in zip(parsed(got), parsed(expected)):
        assert (g[0], g[3]) == (e[0], e[3])
        assert g[1] == pytest.approx(e[1], abs=TOLERANCE) and g[2] == pytest.approx(e[2], abs=1e-3)


@pytest.mark.slow
def test_tp2_and_tp2_x_dp2_equal_one_process_and_checkpoints_move_between_layouts(tiny_config, single, tmp_path):
    lines, single_ckpt = single
    assert len(lines) == 5
    # TP=2 with sequence parallelism here; plain TP=2 below (TP x DP, and the resumed run)
    sp = run(args(tiny_config, "--tensor-model-parallel-size", "2", "--sequence-parallel", "true"), nproc=2)
    assert_close(sp, lines)
    ckpt = tmp_path / "tp_dp"
    tp_dp = run(args(tiny_config, "--tensor-model-parallel-size", "2", "--checkpoint-output-dir", str(ckpt),
                     "--save-per-steps", "2"), nproc=4)
    assert_close(tp_dp, lines)
    resume = ["--resume-training-from-checkpoint", "true", "--checkpoint-input-dir"]
    assert_close(run(args(tiny_config, *resume, str(ckpt / "step_2"))), lines[2:])  # TP x DP -> one process
    back = run(args(tiny_config, *resume, str(single_ckpt / "step_2"), "--tensor-model-parallel-size", "2"), nproc=2)
    assert_close(back, lines[2:])  # one process -> TP


def test_head_order_gives_each_rank_its_q_k_v_heads():
    # n_embd 8 over 2 ranks: rank 0 holds rows q0..3, k8..11, v16..19, rank 1 the others.
    order = head_order(8, 2).tolist()
    assert order[:12] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert sorted(order) == list(range(24))


def test_tensor_parallel_layout_is_picked_and_its_sizes_checked():
    layout = Layout((2,), 2, 4, tensor_parallel=2)
    assert layout.data_parallel == 2 and not layout.pipelined
    assert select_strategy(ParallelRequest(torch.device("cpu"), DistEnv(0, 0, 4), layout)) == "tensor_parallel"
    with pytest.raises(UsageError, match=r"^--tensor-model-parallel-size 3 must divide n_head 4, the padded "
                                         r"vocabulary 128, the world size 4; pick a divisor of each$"):
        check_tensor_parallel(3, 4, 128, 4)
    with pytest.raises(UsageError, match="--tensor-model-parallel-size 2 does not divide the 3 processes"):
        check_world(DistEnv(0, 0, 3), 1, tensor_parallel=2)
    check_world(DistEnv(0, 0, 4), 2, tensor_parallel=2)  # 2 replicas x 2
    with pytest.raises(UsageError, match="--tensor-model-parallel-size 2 with --layers-per-ipu stages"):
        build_layout(ParallelArgs(layers_per_ipu=[1, 1], ipus_per_replica=2, tensor_model_parallel_size=2), 2, 4)
    with pytest.raises(UsageError, match="--sequence-parallel needs --tensor-model-parallel-size > 1"):
        ParallelArgs(sequence_parallel=True)


RNG_WORKER = """
import torch, torch.distributed as dist
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.distributed import DistEnv, env_from_launcher, init_process_group
from gpt2forge.parallel.strategy import ParallelRequest, build_strategy
from gpt2forge.parallel.topology import Layout

env, cpu = env_from_launcher(), torch.device("cpu")
init_process_group(env, cpu)
torch.manual_seed(0)
model = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                    resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3))
model.init_weights()
torch.manual_seed(1 + env.rank)  # as the trainer seeds: a stream per rank
strategy = build_strategy(model, ParallelRequest(cpu, env, Layout((2,), 1, 2, tensor_parallel=2)))
draws = {"sharded": [], "replicated": []}
attn = model.transformer.h["0"].attn  # hooks after the strategy's: inside / after the attention's region
attn.c_attn.register_forward_hook(lambda *_: draws["sharded"].append(torch.rand(4)))
attn.c_proj.register_forward_hook(lambda *_: draws["replicated"].append(torch.rand(4)))
ids = torch.arange(32).view(2, 16) % 96
with torch.no_grad():
    model.eval()
    plain = model.transformer(ids)
    model.train()
    hidden = model.transformer(ids)
def gathered(t):
    out = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(out, t.contiguous())
    return out
h0, h1 = gathered(hidden.detach())
assert torch.equal(h0, h1), "replicated regions drew different dropout masks"
assert not torch.allclose(hidden, plain), "no dropout"
s0, s1 = gathered(draws["sharded"][0])
assert not torch.equal(s0, s1), "the ranks' sharded regions drew the same numbers"
r0, r1 = gathered(draws["replicated"][0])
assert torch.equal(r0, r1), "the default stream differs after the attention"
dist.destroy_process_group()
print("rng ok")
"""


@pytest.mark.slow
def test_dropout_streams_agree_as_megatron_makes_them(tmp_path):
    """Replicated regions (embedding, residual dropouts) draw the same masks on both ranks, so the
    hidden states agree; the attention's region draws from a per-rank stream; after it the shared
    default stream continues the same on both ranks."""
    worker = tmp_path / "rng_worker.py"
    worker.write_text(RNG_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker)], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "rng ok" in proc.stdout, proc.stderr[-3000:]
