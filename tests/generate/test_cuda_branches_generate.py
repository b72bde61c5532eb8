"""The CUDA-only branches of generation, run on the CPU under the fake CUDA runtime
(tests/fake_cuda.py): text_generate_gpt2.py's KV-cache size check, and the decode step's CUDA graph
(its warm-up, capture and replay, and which graphs a generator keeps)."""

import contextlib
import types

import pytest
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.core.memory import GiB
from gpt2forge.generate.cli import check_cache_fits
from gpt2forge.generate.decode_loop import cuda_graph
from gpt2forge.generate.generator import Generator
from gpt2forge.generate.sampling import SamplingConfig

CUDA1 = torch.device("cuda", 1)


def loaded_model(n_layer: int = 2, n_embd: int = 32):
    """What check_cache_fits reads of a loaded model: its config and its parameters' element size (fp32)."""
    return types.SimpleNamespace(config=types.SimpleNamespace(n_layer=n_layer, n_embd=n_embd),
                                 parameters=lambda: iter([torch.zeros(1)]))


def test_the_kv_cache_must_fit_what_the_gpu_has_left(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3"] * 2
    row = 2 * 2 * 64 * 32 * 4  # keys and values of 2 layers, 64 positions of 32 fp32 numbers
    # An 80 GiB GPU with 1 MiB free after the model (and other processes): its total would let 64 rows pass.
    fake_cuda.free_memory = 2**20
    check_cache_fits(loaded_model(), 2**20 // row, 64, CUDA1)  # exactly fits
    with pytest.raises(UsageError, match=r"--batch-size 33: the KV cache of 33 rows of 64 positions needs .* and "
                                         r"NVIDIA H100 80GB HBM3 \(0.0 of 80.0 GiB free\) has less"):
        check_cache_fits(loaded_model(), 2**20 // row + 1, 64, CUDA1)
    assert fake_cuda.called("mem_get_info")[-1] == ((CUDA1,), {})


def test_memory_the_allocator_holds_unused_counts_as_free(fake_cuda):
    # Casting the weights to fp16 after loading leaves their fp32 copies in the caching allocator.
    fake_cuda.free_memory, fake_cuda.reserved, fake_cuda.allocated = 1 * GiB, 4 * GiB, 1 * GiB
    check_cache_fits(loaded_model(n_layer=48, n_embd=1600), 4 * GiB // (2 * 48 * 1600 * 1024 * 4), 1024,
                     torch.device("cuda", 0))


class _FakeGraphs:
    """torch.cuda's graph capture as gpt2forge.generate.decode_loop.cuda_graph uses it, recorded: streams,
    a capture that records the step without running it, and replays that run it."""

    def __init__(self, monkeypatch, fake_cuda, step):
        self.capturing, self.events = False, []
        fakes = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                fakes.events.append(f"{self.name} waits for {other.name}")

        class CUDAGraph:
            def __init__(self):
                self.registered, self.replays = [], 0
                fakes.graph = self

            def register_generator_state(self, generator):
                self.registered.append(generator)

            def replay(self):
                self.replays += 1
                step()

        @contextlib.contextmanager
        def on_stream(stream):
            fakes.events.append(f"enter {stream.name}")
            yield
            fakes.events.append(f"leave {stream.name}")

        @contextlib.contextmanager
        def capture(graph):
            fakes.capturing = True
            fakes.events.append("capture")
            yield
            fakes.capturing = False

        main = Stream("main")
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("side"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: main)
        monkeypatch.setattr(torch.cuda, "stream", on_stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", capture)


def test_a_token_step_is_warmed_up_on_a_side_stream_captured_once_and_replayed(fake_cuda, monkeypatch):
    state = [torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.long)]
    rng = torch.Generator().manual_seed(0)
    ran = []

    def step():  # a token step: writes its buffers and draws from the generator
        if fakes.capturing:  # a real capture records the kernels and runs none
            ran.append("captured")
            return
        ran.append("ran")
        state[0] += torch.randint(0, 9, (3,), generator=rng)
        state[1] += 1

    fakes = _FakeGraphs(monkeypatch, fake_cuda, step)
    before = rng.get_state()
    replay = cuda_graph(step, CUDA1, rng, state)
    # Warm-up twice on the side stream, then the buffers and the generator as they were: capturing changed nothing.
    assert ran == ["ran", "ran", "captured"]
    assert fakes.events == ["side waits for main", "enter side", "leave side", "main waits for side", "capture"]
    assert state[1].item() == 0 and not state[0].any() and torch.equal(rng.get_state(), before)
    assert fakes.graph.registered == [rng]  # each replay draws fresh numbers from it
    for _ in range(3):
        replay()
    assert fakes.graph.replays == 3 and state[1].item() == 3


def test_the_generator_captures_one_graph_per_sampling_and_generator(fake_cuda, monkeypatch):
    from test_generation import make_model, tiny

    from gpt2forge.generate import generator as generator_module

    gen = Generator(make_model(tiny()), 2, 24)
    monkeypatch.setattr(gen, "device", CUDA1)
    monkeypatch.setattr(gen, "graph_decode", True)
    captured = []
    monkeypatch.setattr(generator_module, "cuda_graph", lambda step, device, generator, state: (
        captured.append((device, generator, state)) or (lambda: None)))
    on_gpu = types.SimpleNamespace(device=CUDA1)  # what _token_step reads of a generator
    greedy, top_k = SamplingConfig(greedy=True), SamplingConfig(top_k=4)
    first = gen._token_step(greedy, None)
    assert gen._token_step(greedy, None) is first and len(captured) == 1
    assert captured[0][0] == CUDA1 and captured[0][2] == gen.loop.buffers()
    gen._token_step(top_k, on_gpu)
    gen._token_step(top_k, on_gpu)
    assert len(captured) == 2 and captured[1][1] is on_gpu
    # A generator on the host draws there (a device-to-host copy per token): not capturable, eager.
    gen._token_step(top_k, torch.Generator())
    assert len(captured) == 2
    # More stop ids than the stop buffer holds: a new buffer, so the graphs over the old one go.
    gen.loop.start(torch.zeros(2, dtype=torch.long), torch.zeros(2, 101, dtype=torch.bool), range(9), 3)
    assert not gen.loop.graphs and gen.loop.stop.tolist() == list(range(9))
