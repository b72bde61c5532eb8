"""Text in and out: tokenizers (`tokenizer`: the GPT-2 BPE via tiktoken, local Hugging Face
tokenizers), the vocabulary fetch from a pinned registry package (`vocab`) and the embedded default
corpus (`corpus`).

May import: gpt2forge.core.
"""
