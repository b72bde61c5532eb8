"""Run under torchrun (gloo, 2+ processes) by test_distributed: ZeRO-1 with the state offloaded to the
host (`build_optimizer(shard=True, offload=True)`) against a plain optimizer on every rank. Exits 0
when the updates, the consolidated checkpoint state and a resume from it all equal the plain run's."""

import sys

import torch
import torch.distributed as dist

from gpt2forge.config import ModelConfig
from gpt2forge.model import GPT2LMHeadModel
from gpt2forge.optim import OffloadedOptimizer, build_optimizer


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(ModelConfig(vocab_size=67, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def train(models, opts, steps: int, seed: int) -> None:
    """The same gradients on every rank (what DDP's average leaves), then one update each."""
    for step in range(steps):
        for m, o in zip(models, opts):
            torch.manual_seed(seed + step)
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            o.step()
            o.zero_grad()


def assert_equal_params(a, b, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=f"{what}: {name}")


def main(name: str) -> None:
    dist.init_process_group("gloo")
    plain, zero = model(), model()
    opts = [build_optimizer(plain, name, 1e-2, 0.1), build_optimizer(zero, name, 1e-2, 0.1, shard=True, offload=True)]
    assert isinstance(opts[1].optim, OffloadedOptimizer)  # this rank's shard, on the host
    shard = {p for g in opts[1].optim.param_groups for p in g["params"]}
    assert 0 < len(shard) < len(list(zero.parameters()))
    train([plain, zero], opts, 3, seed=1)
    assert_equal_params(plain, zero, "after 3 updates")
    # The checkpoint form: consolidated on rank 0, every state entry equal to the plain optimizer's.
    opts[1].consolidate_state_dict(to=0)
    state = [opts[1].state_dict() if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        expected = opts[0].state_dict()
        assert state[0]["state"].keys() == expected["state"].keys()
        for i, entry in expected["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(state[0]["state"][i][k], v, rtol=0, atol=0, msg=f"state {i} {k}")
    # Resume: every rank loads the whole state into a fresh ZeRO-1 + offload optimizer and continues.
    dist.broadcast_object_list(state, src=0)
    resumed_model = model()
    resumed_model.load_state_dict(zero.state_dict())
    resumed = build_optimizer(resumed_model, name, 1e-2, 0.1, shard=True, offload=True)
    resumed.load_state_dict(state[0])
    train([plain, resumed_model], [opts[0], resumed], 2, seed=10)
    assert_equal_params(plain, resumed_model, "resumed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
