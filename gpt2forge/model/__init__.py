"""GPT-2 itself: the shape (`config`), the network (`gpt2`), its CPU attention dropout (`dropout`),
packed documents' flags, ids and attention masks (`documents`), checkpoint directories in Hugging Face's
layout (`checkpoint`) and loading a trained model with its tokenizer (`pretrained`); a run's model
flags (`args`) and building its model from them (`build`: shape, overrides, initialisation, loading),
the one place a model's shape is decided. The network knows nothing about devices, distribution or
data.

May import: gpt2forge.core, gpt2forge.ops, gpt2forge.text.
"""
