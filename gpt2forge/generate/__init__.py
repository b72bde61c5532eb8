"""Text generation: the sampling rules (`sampling`), the KV cache (`kv_cache`), the CPU decode kernel's
model view (`gemv`) and fused step (`fused_step`), the decode loop's device-side state and CUDA graph
(`decode_loop`), the generator (`generator`) and the text_generate_gpt2.py command (`cli`).

May import: gpt2forge.core, gpt2forge.ops, gpt2forge.text, gpt2forge.model.
"""
