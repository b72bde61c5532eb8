"""The device-dependent choices: today's defaults on the CPU and on CUDA, and `forced` overriding
them within its block only. The forced paths themselves run in tests/model/test_cuda_paths_on_cpu.py,
tests/ops/test_compiled_xent_rows.py and tests/generate/test_graph_decode.py."""

import dataclasses

import pytest
import torch

from gpt2forge.core.capability import Capabilities, capabilities, forced

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU


def test_defaults_are_the_cuda_paths_on_cuda_only():
    assert capabilities(CUDA) == Capabilities(flex_attention=True, compiled_xent_rows=True, graph_decode=True,
                                              sdpa_dropout=True)
    assert capabilities(CPU) == Capabilities(flex_attention=False, compiled_xent_rows=False, graph_decode=False,
                                             sdpa_dropout=False)
    assert capabilities(torch.device("meta")).sdpa_dropout  # only the CPU has the chunked dropout path


def test_forced_overrides_within_its_block_and_nests():
    with forced(flex_attention=True):
        assert capabilities(CPU) == dataclasses.replace(capabilities(CUDA), compiled_xent_rows=False,
                                                        graph_decode=False, sdpa_dropout=False)
        with forced(graph_decode=True, flex_attention=False):
            assert not capabilities(CPU).flex_attention and capabilities(CPU).graph_decode
            assert not capabilities(CUDA).flex_attention  # forced on every device
        assert capabilities(CPU).flex_attention and not capabilities(CPU).graph_decode
    assert capabilities(CPU) == Capabilities(False, False, False, False)


def test_forced_restores_after_an_error_and_refuses_unknown_names():
    with pytest.raises(RuntimeError), forced(sdpa_dropout=True):
        raise RuntimeError("inside")
    assert not capabilities(CPU).sdpa_dropout
    with pytest.raises(TypeError, match=r"forced\(flex\): not a capability; choose from flex_attention, "):
        with forced(flex=True):
            pass
