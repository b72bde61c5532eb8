"""The model section of the run's configuration (`--model`, `--max-len`, the shape and dropout
overrides): the flags live with the code that takes them (gpt2forge.model.build), as DataArgs lives in
gpt2forge.data.args.
"""

from __future__ import annotations

import dataclasses

from gpt2forge.core.errors import collect
from gpt2forge.core.flags import flag, opt, positive


@dataclasses.dataclass
class ModelArgs:
    """Model: its size or shape and the sequence length."""

    model: str = opt("gpt2", choices=("gpt2-test", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"))
    """Model size, a file in config/."""
    model_config: str | None = opt(None)
    """any Hugging Face GPT-2 config.json as the model shape; overrides --model."""
    max_len: int = opt(128)
    """Sequence length in tokens; sets n_positions of a fresh model."""
    hidden_dropout: float | None = opt(None)
    """override the model's residual and embedding dropout (Megatron's --hidden-dropout; fine-tuning often uses
    0.0 or 0.1)"""
    attention_dropout: float | None = opt(None)
    """override the model's attention dropout (Megatron's --attention-dropout)"""
    num_layers: int | None = opt(None)
    """override the model's number of blocks (Megatron's --num-layers)"""
    hidden_size: int | None = opt(None)
    """override the model's width (Megatron's --hidden-size)"""
    num_attention_heads: int | None = opt(None)
    """override the model's attention heads (Megatron's --num-attention-heads)"""
    ffn_hidden_size: int | None = opt(None)
    """override the MLP width (Megatron's --ffn-hidden-size; default 4 x width)"""
    max_position_embeddings: int | None = opt(None)
    """position-table size of a fresh model (Megatron's --max-position-embeddings; default: --max-len)"""
    init_method_std: float | None = opt(None)
    """standard deviation of a fresh model's weight initialisation (Megatron's --init-method-std; GPT-2: 0.02)"""

    def __post_init__(self) -> None:
        problems = positive(self, "max_len", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                            "max_position_embeddings", optional=True)
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.max_len:
            problems.append(f"--max-position-embeddings {self.max_position_embeddings} is smaller than --max-len "
                            f"{self.max_len}; the position table must cover the sequence")
        if self.init_method_std is not None and self.init_method_std <= 0:
            problems.append("--init-method-std must be > 0")
        problems += [f"--{flag(name)} must be in [0, 1) (got {value})"
                     for name in ("hidden_dropout", "attention_dropout")
                     if (value := getattr(self, name)) is not None and not 0 <= value < 1]
        collect(problems)
