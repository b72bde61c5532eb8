"""Tensor parallelism (DTensor, gloo on CPU, launched with torchrun): the same step lines as one
process within fp32 rounding, with data parallelism, sequence parallelism and pipeline stages too,
checkpoints that resume under another layout, Megatron's dropout streams, and the layout errors."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL
from safetensors.torch import load_file
from test_distributed import ROOT, run  # the torchrun harness (pytest puts tests/parallel on the path)

from gpt2forge.core.errors import UsageError
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.distributed import DistEnv, check_world
from gpt2forge.parallel.strategy import ParallelRequest, build_strategy, select_strategy
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


def assert_same_checkpoint(got: Path, expected: Path) -> None:
    """The weights and the optimizer state saved by two layouts agree within fp32 rounding (each
    optimizer state tensor to 1e-3 of its largest value: Adam's second moments are ~1e-6 here)."""
    weights, reference = load_file(got / "model.safetensors"), load_file(expected / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=TOLERANCE, rtol=0, msg=name)
    state, reference = (torch.load(d / "training_state.pt", weights_only=False)["optimizer"] for d in (got, expected))
    assert state["param_groups"] == reference["param_groups"] and state["state"].keys() == reference["state"].keys()
    for i, entry in reference["state"].items():
        for key, tensor in entry.items():
            scale = float(tensor.abs().max()) if tensor.numel() else 0.0
            torch.testing.assert_close(state["state"][i][key], tensor, atol=1e-3 * scale, rtol=0, msg=f"{i} {key}")


PIPELINE = ["--layers-per-ipu", "1", "1", "--ipus-per-replica", "2"]
"""Two pipeline stages of one block each."""


@pytest.mark.slow
def test_tp2_with_dp2_or_pp2_equals_one_process_and_checkpoints_move_between_layouts(tiny_config, single, tmp_path):
    lines, single_ckpt = single
    assert len(lines) == 5
    # TP=2 with sequence parallelism here; plain TP=2 below (TP x DP, and the resumed runs)
    sp = run(args(tiny_config, "--tensor-model-parallel-size", "2", "--sequence-parallel", "true"), nproc=2)
    assert_close(sp, lines)
    ckpt = tmp_path / "tp_dp"
    tp_dp = run(args(tiny_config, "--tensor-model-parallel-size", "2", "--checkpoint-output-dir", str(ckpt),
                     "--save-per-steps", "2"), nproc=4)
    assert_close(tp_dp, lines)
    resume = ["--resume-training-from-checkpoint", "true", "--checkpoint-input-dir"]
    assert_close(run(args(tiny_config, *resume, str(ckpt / "step_2"))), lines[2:])  # TP x DP -> one process
    assert_close(run(args(tiny_config, *resume, str(ckpt / "step_2"), *PIPELINE), nproc=2), lines[2:])  # -> PP=2
    # TP=2 x PP=2: each stage split over 2 processes, the sequence shards passed between the stages'
    # corresponding tp ranks, the vocabulary-parallel embedding (stage 0) tied to the last stage's
    # vocabulary-parallel head copy. Its checkpoint is one process's, and resumes as TP=2 x DP=2.
    tp_pp_ckpt = tmp_path / "tp_pp"
    tp_pp = run(args(tiny_config, *PIPELINE, "--tensor-model-parallel-size", "2", "--sequence-parallel", "true",
                     "--checkpoint-output-dir", str(tp_pp_ckpt), "--save-per-steps", "2"), nproc=4)
    assert_close(tp_pp, lines)
    assert_same_checkpoint(tp_pp_ckpt / "step_2", single_ckpt / "step_2")
    back = run(args(tiny_config, *resume, str(tp_pp_ckpt / "step_2"), "--tensor-model-parallel-size", "2"), nproc=4)
    assert_close(back, lines[2:])  # PP -> TP x DP


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
    # 2 stages x 2 tp ranks: the pipeline strategy, one replica (1F1B: a micro-batch per stage); in 2
    # processes the stages are co-located (no schedule: one micro-batch will do).
    cfg = ParallelArgs(layers_per_ipu=[1, 1], ipus_per_replica=2, tensor_model_parallel_size=2)
    staged = build_layout(dataclasses.replace(cfg, gradient_accumulation=2), 2, 4)
    assert staged.pipelined and staged.data_parallel == 1
    assert select_strategy(ParallelRequest(torch.device("cpu"), DistEnv(0, 0, 4), staged)) == "pipeline"
    assert select_strategy(ParallelRequest(torch.device("cpu"), DistEnv(0, 0, 2), build_layout(cfg, 2, 2))) \
        == "tensor_parallel"
    model = GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    for request in ParallelRequest(torch.device("cpu"), DistEnv(0, 0, 4), staged, zero=1), \
            ParallelRequest(torch.device("cpu"), DistEnv(0, 0, 4), Layout((2,), 2, 4, tensor_parallel=2), zero=1):
        with pytest.raises(UsageError, match=r"^--tensor-model-parallel-size 2 runs without ZeRO and offload for "
                                             r"now; drop --zero-stage / --replicated-tensor-sharding / --offload$"):
            build_strategy(model, request)
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
