"""The generator's CUDA decode step, forced on the CPU (gpt2forge.core.capability): the forward
compiled with fullgraph=True and dynamic=False, called inside the token step that CUDA captures as
one graph (gpt2forge.generate.decode_loop). The CPU has no CUDA graphs to replay, but the graph
inductor compiles for the capture is traced, compiled and run here, once per token."""

import pytest
import torch
from test_generation import GREEDY, PROMPTS, make_model, tiny

from gpt2forge.core.capability import forced
from gpt2forge.generate.generator import Generator


@pytest.mark.slow
def test_graph_decode_compiles_the_step_once_and_decodes_what_eager_does():
    torch._dynamo.reset()  # another test's graph of the same code would serve this one
    model = make_model(tiny())
    eager = Generator(model, 3, 40)
    with forced(graph_decode=True):
        graphs = Generator(model, 3, 40, compile=True)
    assert graphs.graph_decode and graphs.fused is None and graphs.step is not graphs.lm
    assert not Generator(model, 3, 40, compile=True).graph_decode  # the CPU's default
    compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    graphs.warm_up()
    for prompts in (PROMPTS, PROMPTS[1:], PROMPTS[::-1]):
        assert graphs.generate(prompts, 12, GREEDY).tokens == eager.generate(prompts, 12, GREEDY).tokens
    # One static-shape graph (B, 1) serves every step of every call: what the CUDA graph captures.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiled_before == 1
