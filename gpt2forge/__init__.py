"""gpt2forge: GPT-2 pretraining, evaluation and generation on PyTorch devices.

A re-creation of the Graphcore GPT-2 application: the reference's flags keep working and are given
their meaning on CPUs and CUDA GPUs (see README.md).
"""

__version__ = "0.1.0"
