"""The quick zero-shot check the trainer runs next to its validation loss (`--eval-wikitext`,
`--eval-lambada`): the same protocols as the tasks, capped so it costs seconds, not minutes.

WikiText: the first `QUICK_WINDOWS` non-overlapping windows of --max-len tokens (token-level
perplexity of those tokens; the word-level adjustment needs the whole file). LAMBADA: the first
`QUICK_EXAMPLES` passages, non-strict. Files are read and tokenized once, when training starts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpt2forge.core.errors import UsageError
from gpt2forge.evaluation.data import read_json_lines, read_text
from gpt2forge.evaluation.detokenizer import detokenizer_name_for, get_detokenizer, sample_of
from gpt2forge.evaluation.protocol import build_cloze_examples
from gpt2forge.evaluation.scoring import evaluate_cloze, evaluate_stream
from gpt2forge.text.tokenizer import load_tokenizer

QUICK_WINDOWS = 16
QUICK_EXAMPLES = 128


class QuickEval:
    """Built once from the files; `run(model, precision)` returns the log line."""

    def __init__(self, wikitext: str | None, lambada: str | None, seq_len: int, vocab_size: int,
                 batch_size: int = 8):
        tok = load_tokenizer()
        if vocab_size != tok.vocab_size:
            raise UsageError(f"--eval-wikitext/--eval-lambada need a model with the GPT-2 vocabulary "
                             f"({tok.vocab_size} ids; this one has {vocab_size}); drop those flags")
        self.seq_len, self.batch_size, self.pad_id = seq_len, batch_size, tok.eot_id
        self.tokens = self.examples = None
        if wikitext:
            detok = get_detokenizer(detokenizer_name_for(wikitext, sample_of(wikitext)))
            text = read_text(Path(wikitext), "--eval-wikitext")
            # Only the characters the capped windows can reach are tokenized (~4 characters per token).
            need = QUICK_WINDOWS * seq_len + 1
            ids = tok.encode(detok(text[: need * 8]))[:need]
            self.tokens = np.asarray(ids, dtype=np.int64)
            if len(self.tokens) < 2:
                raise UsageError(f"--eval-wikitext {wikitext}: fewer than 2 tokens")
        if lambada:
            texts = read_json_lines(Path(lambada), "text", "--eval-lambada")[:QUICK_EXAMPLES]
            self.examples = build_cloze_examples(texts, tok.encode, False, seq_len)

    @torch.no_grad()
    def run(self, model: torch.nn.Module, precision: str) -> dict[str, float]:
        """Metrics of `model` (put in eval mode for the call, then restored)."""
        was_training = model.training
        model.eval()
        out: dict[str, float] = {}
        try:
            if self.tokens is not None:
                res = evaluate_stream(model, self.tokens, self.seq_len, self.seq_len, batch_size=self.batch_size,
                                      precision=precision, pad_id=self.pad_id, progress=False)
                out.update(wikitext_ppl=res.ppl, wikitext_tokens=res.scored_tokens)
            if self.examples is not None:
                res = evaluate_cloze(model, self.examples, False, batch_size=self.batch_size, precision=precision,
                                     pad_id=self.pad_id, progress=False)
                out.update(lambada_acc=res.accuracy, lambada_ppl=res.ppl, lambada_examples=res.examples)
        finally:
            model.train(was_training)
        return out

    @staticmethod
    def describe(metrics: dict[str, float]) -> str:
        parts = []
        if "wikitext_ppl" in metrics:
            parts.append(f"wikitext ppl {metrics['wikitext_ppl']:.2f} ({metrics['wikitext_tokens']} tokens)")
        if "lambada_acc" in metrics:
            parts.append(f"lambada acc {metrics['lambada_acc']:.4f}, ppl {metrics['lambada_ppl']:.2f} "
                         f"({metrics['lambada_examples']} examples)")
        return ", ".join(parts)
