"""Custom operators: loading the C++/CUDA library and its ops' pure-PyTorch references (`library`),
building it from `custom_ops/` (`build`: toolchain detection, compile, clean; `make` runs it, nothing
at run time imports it), the fused chunked LM head + loss with its reference (`lm_head_loss`), the
host optimizer step (`host_optim`) and the CPU threads' floating-point modes (`fp_mode`).

May import: gpt2forge.core.
"""
