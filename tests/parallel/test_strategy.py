"""The strategy registry: which implementation runs which layout, and the single-process strategy
against the plain model (CPU, no process group)."""

import inspect
import types

import pytest
import torch
from torch import nn

from gpt2forge.core.errors import UsageError
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.parallel.data_parallel import DataParallelStrategy
from gpt2forge.parallel.distributed import DistEnv
from gpt2forge.parallel.strategy import (
    REGISTRY,
    ParallelRequest,
    Strategy,
    build_strategy,
    select_strategy,
    strategy_class,
)
from gpt2forge.parallel.topology import Layout

CPU = torch.device("cpu")


def request(world: int, zero: int = 0, stages: tuple[int, ...] = (2,)) -> ParallelRequest:
    return ParallelRequest(CPU, env=DistEnv(0, 0, world), layout=Layout(stages, world, world), zero=zero)


@pytest.mark.parametrize("world, zero, stages, expected", [
    (1, 0, (2,), "data_parallel"),  # one process
    (1, 0, (1, 1), "data_parallel"),  # stages co-located in one process
    (2, 0, (2,), "data_parallel"),  # DDP
    (2, 1, (2,), "data_parallel"),  # DDP + ZeRO-1
    (2, 2, (2,), "fsdp"),
    (4, 3, (2,), "fsdp"),
    (3, 2, (1, 1), "fsdp"),  # 3 processes cannot hold 2 stages: co-located, sharded
    (2, 0, (1, 1), "pipeline"),  # a stage per process
    (4, 1, (1, 1), "pipeline"),  # ZeRO-1 inside the stages
    (4, 3, (1, 1), "pipeline"),  # FSDP2 inside the stages
])
def test_layout_picks_strategy(world, zero, stages, expected):
    assert select_strategy(request(world, zero, stages)) == expected


def test_no_layout_is_data_parallel():
    assert select_strategy(ParallelRequest(CPU)) == "data_parallel"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registered_strategies_implement_the_interface(name):
    cls = strategy_class(name)
    assert issubclass(cls, Strategy) and not inspect.isabstract(cls)


def test_sharding_with_fp16_is_refused():
    half = ParallelRequest(CPU, env=DistEnv(0, 0, 2), zero=2, param_dtype=torch.float16)
    with pytest.raises(UsageError, match="--zero-stage 2 with --precision fp16"):
        build_strategy(GPT2LMHeadModel(ModelConfig(vocab_size=67, n_positions=16, n_embd=16, n_layer=2, n_head=2)),
                       half)


def test_single_process_matches_the_model():
    """Forward/backward of two micro-batches through the strategy: the model's summed loss and
    gradients; the norm is the gradients' global norm; evaluation scores a batch as the model does."""
    cfg = ModelConfig(vocab_size=67, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    reference = GPT2LMHeadModel(cfg)
    reference.load_state_dict(model.state_dict())
    strategy = build_strategy(model, ParallelRequest(CPU, batch_size=2))
    assert isinstance(strategy, DataParallelStrategy) and strategy.processes_per_replica == 1
    assert strategy.optimizer_placement().module is model and not strategy.optimizer_placement().shard
    ids = torch.randint(0, 67, (2, 2, 13), generator=torch.Generator().manual_seed(1))
    pairs = [(b[:, :-1], b[:, 1:]) for b in ids]
    totals = strategy.forward_backward(pairs, torch.tensor(0.5))
    loss_sum = sum(reference(x, y).loss_sum for x, y in pairs)
    (loss_sum * 0.5).backward()
    torch.testing.assert_close(totals[0], loss_sum.detach())
    assert int(totals[2]) == 2 * 2 * 12
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    norm = torch.nn.utils.get_total_norm([q.grad for q in reference.parameters()])
    assert strategy.clip_grad_norm(None) == pytest.approx(float(norm))
    strategy.set_training(False)
    with torch.no_grad():
        scored = strategy.evaluate_batch(*pairs[0])
        torch.testing.assert_close(scored[0], reference(*pairs[0]).loss_sum)
    assert strategy.whole_model() is model and strategy.evaluation_env() == DistEnv()


@pytest.mark.parametrize("max_norm", [None, 1e3, 0.5])
def test_host_clipping_is_torchs_rule_with_a_float64_norm(monkeypatch, max_norm):
    # clip_host_grads: the norm from BLAS dots of chunks summed in float64 (chunks of 100 values here,
    # so tensors cross chunk boundaries), the gradients scaled by min(max_norm / (norm + 1e-6), 1)
    # as torch.nn.utils.clip_grad_norm_ does; within the bound they are left as they are.
    import gpt2forge.parallel.data_parallel as dp
    monkeypatch.setattr(dp, "HOST_NORM_CHUNK", 100)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in ((37, 11), (250,), (3, 4, 5))]
    theirs = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(theirs, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm is not None else float("inf"))
    exact = sum(float((g.double() ** 2).sum()) for g in grads) ** 0.5
    before = [g.clone() for g in grads]
    got = dp.clip_host_grads(grads, max_norm)
    assert got == pytest.approx(exact, rel=1e-6) and got == pytest.approx(float(want), rel=1e-5)
    for g, p, b in zip(grads, theirs, before):
        torch.testing.assert_close(g, p.grad)
        if max_norm != 0.5:
            assert torch.equal(g, b)  # within the bound: untouched, bit for bit


def test_host_clipping_of_non_finite_gradients_follows_torch():
    import gpt2forge.parallel.data_parallel as dp
    for bad in (float("inf"), float("nan")):
        grads = [torch.ones(4), torch.tensor([1.0, bad])]
        theirs = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        dp.clip_host_grads(grads, 1.0)
        for g, p in zip(grads, theirs):
            torch.testing.assert_close(g, p.grad, equal_nan=True)


def test_fsdp2_placement_runs_the_update_on_the_host_exactly_when_its_shards_are_offloaded():
    from gpt2forge.parallel.fsdp import ShardedStrategy  # why: only this test needs the FSDP2 strategy

    for offload in (False, True):
        placement = ShardedStrategy.optimizer_placement(types.SimpleNamespace(model=torch.nn.Linear(2, 2),
                                                                              offload=offload))
        assert placement.host_update is offload and not placement.offload and not placement.shard
