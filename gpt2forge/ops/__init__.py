"""Custom operators: loading and building the C++/CUDA library from `custom_ops/` (`library`) and
the ops with their pure-PyTorch references (`lm_head_loss`: the fused chunked LM head + loss).

May import: gpt2forge.core.
"""
