"""Zero-shot evaluation: WikiText perplexity and LAMBADA cloze accuracy (Megatron-LM's protocols).

- `protocol`: which tokens are scored with which context (windows, cloze examples) and the formulas.
- `scoring`: batched model runs that compute log-probs only at the scored positions.
- `data`: reading WikiText files, loose-JSON corpora, Megatron mmap prefixes and LAMBADA.
- `detokenizer`: WikiText / PTB / LAMBADA detokenizers.
- `cli`: `tasks/evaluate_wiki.py` and `tasks/evaluate_lambada.py`.
- `quick`: the capped version the trainer runs next to its validation loss.

May import: gpt2forge.core, gpt2forge.ops, gpt2forge.text, gpt2forge.model, gpt2forge.data.
"""

from gpt2forge.evaluation.protocol import (
    ClozeExample,
    ClozeResult,
    PerplexityResult,
    Window,
    WindowPlan,
    count_original_tokens,
)
from gpt2forge.evaluation.scoring import evaluate_cloze, evaluate_stream, score_batch

__all__ = ["ClozeExample", "ClozeResult", "PerplexityResult", "Window", "WindowPlan", "count_original_tokens",
           "evaluate_cloze", "evaluate_stream", "score_batch"]
