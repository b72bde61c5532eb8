"""The label value that marks a position as not scored: padding in dataset items and labels, and
the positions evaluation leaves out. Every loss (the model's, the fused LM head's, evaluation's)
skips it; -100 is PyTorch's `cross_entropy` default `ignore_index` and Hugging Face's."""

IGNORE_INDEX = -100
