"""The decode loop keeps its tokens on the device and syncs the host every `sync_every` tokens
(gpt2forge.generate.decode_loop): it must choose exactly the tokens, stop at exactly the step and
leave a shared sampling generator in exactly the state the per-token loop it replaced did
(`per_token_reference` below is that loop, transcribed), for greedy and seeded sampling, with and
without stop ids, on the eager and the graph_decode (CUDA's) path."""

from __future__ import annotations

import time

import pytest
import torch
from test_generation import PROMPTS, make_model, tiny

from gpt2forge.core.capability import forced
from gpt2forge.generate.generator import GenerationResult, Generator
from gpt2forge.generate.sampling import SamplingConfig, next_token

SAMPLINGS = {
    "greedy": SamplingConfig(greedy=True),
    "greedy_penalty": SamplingConfig(greedy=True, repetition_penalty=1.7),
    "top_k": SamplingConfig(top_k=8),
    "top_p_temperature_penalty": SamplingConfig(temperature=0.7, top_p=0.8, repetition_penalty=1.3),
}


@torch.no_grad()
def per_token_reference(gen: Generator, prompts, max_new_tokens: int, sampling: SamplingConfig, stop_ids=(),
                        generator: torch.Generator | None = None, on_token=None) -> list[list[int]]:
    """The generate loop as it was before the device-side loop: one host sync (`tolist`) per token,
    eager forward passes (the decode step's logits are the prefill's computation on one token)."""
    stop_ids = frozenset(stop_ids)
    n, P = len(prompts), max(len(p) for p in prompts)
    ids, pad, seen = gen._prefill_inputs(list(prompts) + [prompts[-1]] * (gen.batch_size - n))
    slots = torch.arange(gen.max_len, device=gen.device)
    track_seen = sampling.repetition_penalty != 1.0
    out: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * gen.batch_size
    tok = next_token(gen.lm(ids, slots[:P], pad), sampling, gen.vocab_size, seen, generator)
    for t in range(max_new_tokens):
        if t > 0:
            logits = gen.lm(tok[:, None], slots[P + t - 1:P + t], pad)
            tok = next_token(logits, sampling, gen.vocab_size, seen, generator)
        row_ids = tok.tolist()
        for b, i in enumerate(row_ids[:n]):
            if not finished[b]:
                finished[b] = i in stop_ids
                if not finished[b]:
                    out[b].append(i)
        if on_token is not None:
            on_token(t, row_ids[:n], finished[:n])
        if all(finished[:n]):
            break
        if track_seen:
            seen.scatter_(1, tok[:, None], True)
    return out


class Calls(list):
    """The on_token calls of one generation, in order."""

    def append_call(self, *args) -> None:
        self.append(args)


def stop_ids_of(gen: Generator, sampling: SamplingConfig, prompts, n: int) -> tuple[int, ...]:
    """Two ids the reference's rows actually produce early on: stops that end rows mid-run."""
    first = per_token_reference(gen, prompts, n, sampling, (), torch.Generator().manual_seed(5))
    return tuple(sorted({row[len(row) // 3] for row in first[:2]}))


@pytest.mark.parametrize("sync_every", [1, 5])
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_tokens_stops_and_the_generators_state_equal_the_per_token_loop(name, sync_every):
    sampling = SAMPLINGS[name]
    model = make_model(tiny(), seed=4)
    gen = Generator(model, batch_size=4, max_len=40)
    gen.sync_every = sync_every
    for prompts in (PROMPTS, PROMPTS[::-1] + [[3]]):
        stops = stop_ids_of(gen, sampling, prompts, 20)
        for stop in ((), stops):
            ours, ref = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
            for _ in range(2):  # the same generator for two calls: the second starts where the first left it
                seen_ours, seen_ref = Calls(), Calls()
                got = gen.generate(prompts, 20, sampling, stop, ours, on_token=seen_ours.append_call)
                want = per_token_reference(gen, prompts, 20, sampling, stop, ref, on_token=seen_ref.append_call)
                assert got.tokens == want, (prompts, stop)
                assert seen_ours == seen_ref
                assert len(got.step_s) == len(seen_ref) - 1  # one time per decode step run for the result
                assert torch.equal(ours.get_state(), ref.get_state())
        if stops:  # the stops did end rows early: the test would see a wrong stop step
            assert any(len(row) < 20 for row in per_token_reference(gen, prompts, 20, sampling, stops,
                                                                     torch.Generator().manual_seed(11)))


def test_the_host_reads_the_tokens_every_sync_every_steps_and_stops_within_one_chunk(monkeypatch):
    model = make_model(tiny(), seed=4)
    gen = Generator(model, batch_size=2, max_len=40)
    gen.sync_every = 4
    reads = []
    read = gen.loop.read
    monkeypatch.setattr(gen.loop, "read", lambda *a: reads.append(a) or read(*a))
    res = gen.generate(PROMPTS[:2], 22, SAMPLINGS["greedy"])
    assert reads == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 22)]
    assert len(res.step_s) == 21 and all(len(row) == 22 for row in res.tokens)
    # A stop in the first chunk: the host sees it at the first read and runs no further chunk.
    first = gen.generate(PROMPTS[:2], 22, SAMPLINGS["greedy"]).tokens
    reads.clear()
    res = gen.generate(PROMPTS[:2], 22, SAMPLINGS["greedy"], stop_ids={first[0][1], first[1][1]})
    assert reads == [(0, 4)] and res.tokens == [first[0][:1], first[1][:1]] and len(res.step_s) == 1


def test_the_step_times_share_each_chunks_time():
    gen = Generator(make_model(tiny(), seed=4), batch_size=1, max_len=40)
    gen.sync_every = 5
    t0 = time.perf_counter()
    res = gen.generate(PROMPTS[:1], 12, SAMPLINGS["greedy"])
    assert isinstance(res, GenerationResult) and len(res.step_s) == 11
    assert 0 < res.total_s <= time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["greedy", "top_p_temperature_penalty"])
def test_the_graph_decode_step_over_the_aligned_head_equals_the_per_token_loop(name):
    # CUDA's path on the CPU: the forward compiled (inductor, static shapes) and called for one whole
    # token step over static buffers, the LM head over all padded_vocab rows with the padding masked.
    sampling = SAMPLINGS[name]
    model = make_model(tiny(vocab_size=101), seed=4)  # padded to 112 rows
    eager = Generator(model, 3, 40)
    with forced(graph_decode=True):
        graphs = Generator(model, 3, 40, compile=True)
        assert graphs.graph_decode and graphs.lm.full_head and graphs.sync_every > 1
        graphs.warm_up()
        stops = stop_ids_of(eager, sampling, PROMPTS, 16)
        for prompts in (PROMPTS, PROMPTS[1:]):
            for stop in ((), stops):
                ours, ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
                got = graphs.generate(prompts, 16, sampling, stop, ours).tokens
                assert got == per_token_reference(eager, prompts, 16, sampling, stop, ref)
                assert torch.equal(ours.get_state(), ref.get_state())


@pytest.mark.slow
def test_padding_rows_of_the_aligned_head_are_never_chosen():
    # Padding rows whose logits are the largest: the aligned head computes them and they must lose.
    model = make_model(tiny(vocab_size=101), seed=4)
    with torch.no_grad():
        model.lm_head.weight[101:] = model.lm_head.weight[:101].abs().max() * 50
    with forced(graph_decode=True):
        gen = Generator(model, 3, 40, compile=True)
        assert gen.lm.full_head
        logits = gen.lm(torch.tensor([[5], [6], [7]]), torch.tensor([0]), torch.zeros(3, dtype=torch.long))
        assert logits.shape == (3, model.config.padded_vocab_size) and logits[:, 101:].isneginf().all()
        for sampling in SAMPLINGS.values():
            tokens = gen.generate(PROMPTS, 10, sampling, generator=torch.Generator().manual_seed(0)).tokens
            assert all(0 <= i < 101 for row in tokens for i in row)
