"""Custom operators: loading the C++/CUDA library and its ops' pure-PyTorch references (`library`),
building it from `custom_ops/` (`build`: toolchain detection, compile, clean; `make` runs it, nothing
at run time imports it) and the fused chunked LM head + loss with its reference (`lm_head_loss`).

May import: gpt2forge.core.
"""
