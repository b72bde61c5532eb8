"""The model shape: one typed config that reads and writes Hugging Face GPT-2 and GPT-Neo
`config.json` files (GPT-Neo is this GPT-2 with local attention layers, unscaled scores and no q/k/v
biases; gpt2forge.model.gpt_neo renames its keys).

`config/` holds the shipped sizes (`--model gpt2-test|gpt2|gpt2-medium|gpt2-large|gpt2-xl`);
`--model-config PATH` takes any HF GPT-2 `config.json`. Fields keep HF's names so a checkpoint's
`config.json` loads in `transformers.GPT2LMHeadModel.from_pretrained` unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gpt2forge.core.errors import UsageError
from gpt2forge.model.gpt_neo import config_from_neo, config_to_neo

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"

# --model choice -> file in config/ (the reference's file names).
MODEL_FILES = {
    "gpt2-test": "config_test.json",
    "gpt2": "config.json",
    "gpt2-medium": "config_medium.json",
    "gpt2-large": "config_large.json",
    "gpt2-xl": "config_xl.json",
}

MODEL_TYPES = ("gpt2", "gpt_neo")
ATTENTION_TYPES = ("global", "local")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "relu", "silu")


@dataclasses.dataclass
class ModelConfig:
    """GPT-2 hyper-parameters, named as in `transformers.GPT2Config`."""

    vocab_size: int = 50257
    """Real vocabulary size: token ids are in [0, vocab_size)."""
    n_positions: int = 1024
    """Longest sequence the position embedding covers."""
    n_embd: int = 768
    """Hidden size C."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads; n_embd must be divisible by it."""
    n_inner: int | None = None
    """MLP hidden size; None means 4 * n_embd."""
    activation_function: str = "gelu_new"
    """MLP non-linearity (HF names): gelu (exact erf), gelu_new (tanh approximation), ..."""
    resid_pdrop: float = 0.1
    """Dropout on each residual branch output."""
    embd_pdrop: float = 0.1
    """Dropout after the token + position embedding sum."""
    attn_pdrop: float = 0.1
    """Dropout on the attention probabilities."""
    layer_norm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    initializer_range: float = 0.02
    """Std of the normal initialisation of weights."""
    scale_attn_weights: bool = True
    """Divide attention scores by sqrt(head_dim)."""
    scale_attn_by_inverse_layer_idx: bool = False
    """Also divide attention scores of layer i by (i + 1)."""
    bos_token_id: int = 50256
    """Begin-of-text id (GPT-2 uses <|endoftext|>)."""
    eos_token_id: int = 50256
    """End-of-text id (<|endoftext|> = 50256 in the GPT-2 BPE)."""
    tie_word_embeddings: bool = True
    """LM head shares the token embedding matrix."""
    model_type: str = "gpt2"
    """The Hugging Face family the files are written as: 'gpt2' (GPT2LMHeadModel: Conv1D weights, q/k/v
    biases) or 'gpt_neo' (GPTNeoForCausalLM: nn.Linear weights, separate q/k/v projections without biases)."""
    attention_layers: list[str] | None = None
    """GPT-Neo: per layer 'global' (causal) or 'local' (causal over the last window_size positions);
    None: all global (GPT-2)."""
    window_size: int = 256
    """Keys a 'local' layer's query sees: itself and the window_size - 1 positions before it."""
    vocab_pad_multiple: int = 64
    """Embedding rows are padded up to a multiple of this for fast matmuls (not saved in HF files).
    Padded ids never receive probability mass and are never predicted."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "vocab_pad_multiple"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            problems.append(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation_function not in ACTIVATIONS:
            problems.append(f"activation_function {self.activation_function!r} is not supported; "
                            f"choose one of {', '.join(ACTIVATIONS)}")
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1)")
        if not self.tie_word_embeddings:
            problems.append("tie_word_embeddings must be true (GPT-2 ties the LM head to wte)")
        problems += self._attention_problems()
        if problems:
            raise UsageError("model config: " + "; ".join(problems))

    def _attention_problems(self) -> list[str]:
        """What is wrong with model_type and GPT-Neo's attention fields (a GPT-2 has none of them)."""
        if self.model_type not in MODEL_TYPES:
            return [f"model_type {self.model_type!r} is not supported; choose one of {', '.join(MODEL_TYPES)}"]
        if self.model_type == "gpt2":
            return [] if self.attention_layers is None else [
                "attention_layers needs model_type gpt_neo (a GPT-2 config.json cannot hold it)"]
        layers = self.attention_layers or []
        problems = [f"attention type {t!r} is unknown; choose global or local"
                    for t in sorted(set(layers) - set(ATTENTION_TYPES))]
        if len(layers) != self.n_layer:
            problems.append(f"attention_layers has {len(layers)} entries for {self.n_layer} layers")
        if self.window_size < 1:
            problems.append("window_size must be >= 1")
        if self.scale_attn_weights or self.scale_attn_by_inverse_layer_idx:
            problems.append("gpt_neo does not scale attention scores (scale_attn_weights must be false)")
        return problems

    def attention_window(self, layer_idx: int) -> int | None:
        """Keys a query of layer `layer_idx` sees back from itself (window_size for a 'local' layer), or
        None: all earlier positions."""
        local = self.attention_layers is not None and self.attention_layers[layer_idx] == "local"
        return self.window_size if local else None

    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projection (c_attn) has a bias: GPT-2's has, GPT-Neo's has not."""
        return self.model_type == "gpt2"

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding matrix: vocab_size rounded up to vocab_pad_multiple."""
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner else 4 * self.n_embd

    @property
    def block_params(self) -> int:
        """Parameters of one block: two LayerNorms, attention (qkv, proj) and MLP (fc, proj)."""
        C, F = self.n_embd, self.inner_dim
        return 2 * 2 * C + (C * 3 * C + 3 * C * self.qkv_bias) + (C * C + C) + (C * F + F) + (F * C + C)

    def num_params(self, include_wpe: bool = True) -> int:
        """Parameter count of the unpadded model (tied head counted once)."""
        C = self.n_embd
        total = self.vocab_size * C + self.n_layer * self.block_params + 2 * C
        return total + (self.n_positions * C if include_wpe else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 N + 12 L C T (PaLM appendix B),
        N = parameters taking part in matmuls (everything but the position embedding)."""
        return 6.0 * self.num_params(include_wpe=False) + 12.0 * self.n_layer * self.n_embd * seq_len

    # -- Hugging Face config.json ------------------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that `transformers.GPT2Config` (or GPTNeoConfig) / `from_pretrained` accept."""
        d = dataclasses.asdict(self)
        if self.model_type == "gpt_neo":
            return config_to_neo(d)
        for name in ("vocab_pad_multiple", "attention_layers", "window_size"):
            d.pop(name)
        d.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_ctx=self.n_positions)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config") -> ModelConfig:
        """Build from an HF GPT-2 or GPT-Neo config dict; unknown HF keys are ignored, other types refused."""
        model_type = d.get("model_type", "gpt2")
        if model_type not in MODEL_TYPES:
            raise UsageError(f"{source}: model_type is {model_type!r}; pass a GPT-2 (gpt2) or GPT-Neo (gpt_neo) "
                             "config.json")
        if model_type == "gpt_neo":
            d = config_from_neo(d)
        if d.get("reorder_and_upcast_attn"):
            raise UsageError(f"{source}: reorder_and_upcast_attn=true is not supported; set it to false")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"{path}: model config not found; pass an HF GPT-2 config.json "
                             f"or one of --model {', '.join(MODEL_FILES)}")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: not valid JSON ({exc}); pass an HF GPT-2 config.json") from None
        if not isinstance(d, dict):
            raise UsageError(f"{path}: expected a JSON object; pass an HF GPT-2 config.json")
        return cls.from_hf_dict(d, source=str(path))

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The shipped size for `--model NAME`."""
        if name not in MODEL_FILES:
            raise UsageError(f"--model {name} is unknown; choose one of {', '.join(MODEL_FILES)}")
        return cls.from_json(CONFIG_DIR / MODEL_FILES[name])


def hf_config_positions(d: dict[str, Any], source: str = "config") -> int:
    """The position-table length (n_positions) of an HF GPT-2 or GPT-Neo config dict (`ModelConfig.from_hf_dict`)."""
    return ModelConfig.from_hf_dict(d, source=source).n_positions
