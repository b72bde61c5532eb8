"""Megatron-LM's zero-shot evaluation command line (seed 001's `scripts/run_gpt2_eval.py`) on our two tasks.

Megatron's script built the model from `--num-layers --hidden-size --num-attention-heads`, loaded
`--model-path`, downloaded the tokenizer into `--cache-dir` and started `evaluate_gpt2.py` (WikiText
perplexity with `--overlapping-eval 32`; LAMBADA with `--cloze-eval`) or `pretrain_gpt2.py --train-iters 0
--test-data PATH --eval-iters N` (`--webtext-eval`: loose JSON, windows of the sequence length, no overlap).
Here the checkpoint brings its shape and tokenizer: the shape flags are checked against it, nothing is
downloaded (`--cache-dir` is not needed), and the model runs whole in one process (`--model-parallel-size`
does not change the numbers). `tasks/run_gpt2_eval.py` takes the script's command line and runs
`evaluate_wiki.py` or `evaluate_lambada.py`, which take the same flags (`add_megatron_flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.evaluation.data import data_format

WIKITEXT_STRIDE = 32
"""run_gpt2_eval.py's `--overlapping-eval` for WikiText perplexity."""

SHAPE_FLAGS = (("--num-layers", "num_layers", "n_layer"), ("--hidden-size", "hidden_size", "n_embd"),
               ("--num-attention-heads", "num_attention_heads", "n_head"))
"""(Megatron flag, argparse dest, model config field)."""


def add_megatron_flags(parser: argparse.ArgumentParser, task: str) -> None:
    """run_gpt2_eval.py's flags on the `task` ("wiki" or "lambada") parser; `--model-path` and `--data-path`
    are aliases of `--checkpoint-input-dir` and `--valid-data`, added with them."""
    g = parser.add_argument_group("Megatron-LM's scripts/run_gpt2_eval.py flags (seed 001)")
    for name, dest, field in SHAPE_FLAGS:
        g.add_argument(name, dest=dest, type=int, default=None,
                       help=f"checked against the checkpoint's {field} (the checkpoint brings its shape)")
    g.add_argument("--model-parallel-size", type=int, default=1,
                   help="accepted: the whole model runs in this process (the numbers do not depend on it)")
    g.add_argument("--cache-dir", default=None,
                   help="accepted: the GPT-2 tokenizer ships with gpt2forge and nothing is downloaded")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="accepted: the checkpoint's vocabulary is read as saved (padded rows never get probability)")
    g.add_argument("--load-openai", action="store_true",
                   help="accepted: Hugging Face GPT-2 folders load directly through --model-path")
    g.add_argument("--cloze-eval", action="store_true",
                   help="LAMBADA cloze accuracy: this script's task" if task == "lambada" else argparse.SUPPRESS)
    if task == "wiki":
        g.add_argument("--webtext-eval", action="store_true",
                       help="large-corpora perplexity: --data-path is loose JSON (or a mmap prefix), windows of "
                            "--seq-length without overlap (Megatron's pretrain_gpt2.py --test-data)")
        g.add_argument("--eval-iters", type=int, default=None,
                       help="score at most N batches: --max-windows N x --batch-size")
    else:
        g.add_argument("--webtext-eval", action="store_true", help=argparse.SUPPRESS)


def apply_megatron_flags(args: argparse.Namespace, task: str) -> None:
    """Turn the run_gpt2_eval.py flags in `args` into ours, before the model is loaded.

    Raises:
        UsageError: the other task's flag, or a bad value.
    """
    other = {"wiki": ("LAMBADA", "tasks/evaluate_lambada.py"), "lambada": ("WIKITEXT103", "tasks/evaluate_wiki.py")}
    if other[task][0] in [t.upper() for t in args.task or ()]:  # the reference's (and Megatron tasks/main.py's)
        raise UsageError(f"--task {other[task][0]} is {other[task][1]}'s task: run that script with the same flags")
    if task == "wiki" and args.cloze_eval:
        raise UsageError("--cloze-eval is LAMBADA: run tasks/evaluate_lambada.py (or tasks/run_gpt2_eval.py "
                         "--cloze-eval) with the same flags")
    if task == "lambada" and args.webtext_eval:
        raise UsageError("--webtext-eval is corpus perplexity: run tasks/evaluate_wiki.py (or "
                         "tasks/run_gpt2_eval.py --webtext-eval) with the same flags")
    if args.model_parallel_size < 1:
        raise UsageError(f"--model-parallel-size {args.model_parallel_size}: must be >= 1")
    if args.model_parallel_size > 1:
        log.notice(f"--model-parallel-size {args.model_parallel_size}: evaluation runs the whole model in this "
                   "process (the numbers are the same)")
    if task != "wiki":
        return
    if args.eval_iters is not None:
        if args.eval_iters < 1:
            raise UsageError(f"--eval-iters must be >= 1 (got {args.eval_iters})")
        if args.max_windows is None:
            args.max_windows = args.eval_iters * args.batch_size
    if args.webtext_eval and args.data_format == "auto":  # loose JSON whatever its name, or a mmap prefix
        args.data_format = "mmap" if data_format(args.valid_data[0], "auto") == "mmap" else "jsonl"


def check_shape(args: argparse.Namespace, config) -> None:
    """The shape flags that were given must equal the loaded model's.

    Raises:
        UsageError: naming each flag that differs, both values and the fix.
    """
    wrong = [f"{name} {getattr(args, dest)} (the checkpoint has {field} {getattr(config, field)})"
             for name, dest, field in SHAPE_FLAGS
             if getattr(args, dest) is not None and getattr(args, dest) != getattr(config, field)]
    if wrong:
        raise UsageError(f"{'; '.join(wrong)}: the model's shape comes from {args.checkpoint}; drop these flags or "
                         "give that checkpoint's values")


def dispatch(argv: Sequence[str]) -> tuple[str, list[str]]:
    """run_gpt2_eval.py's argv -> ("wiki" | "lambada", the argv of that task): `--cloze-eval` is LAMBADA,
    `--webtext-eval` corpus perplexity, anything else WikiText with `--overlapping-eval 32` unless given.
    `--eval-iters` counts only with `--webtext-eval` and `--strict-lambada` only with `--cloze-eval`, as in
    Megatron (a notice says when one is ignored)."""
    p = argparse.ArgumentParser(
        prog="run_gpt2_eval.py",
        description="Megatron-LM's zero-shot GPT-2 evaluation command line: WikiText perplexity (default, "
                    f"--overlapping-eval {WIKITEXT_STRIDE}), LAMBADA (--cloze-eval) or large-corpora perplexity "
                    "(--webtext-eval). Every other flag is that of tasks/evaluate_wiki.py or "
                    "tasks/evaluate_lambada.py (see their --help), run_gpt2_eval.py's own included.")
    p.add_argument("--cloze-eval", action="store_true", help="LAMBADA cloze accuracy (tasks/evaluate_lambada.py)")
    p.add_argument("--webtext-eval", action="store_true",
                   help="perplexity of a loose-JSON corpus, --eval-iters batches (tasks/evaluate_wiki.py)")
    p.add_argument("--eval-iters", type=int, default=None, help="batches scored with --webtext-eval")
    known, _ = p.parse_known_args(list(argv))
    if known.cloze_eval and known.webtext_eval:
        raise UsageError("--cloze-eval and --webtext-eval exclude each other (one evaluation per run)")
    argv = list(argv)
    if not known.cloze_eval and "--strict-lambada" in argv:
        log.notice("--strict-lambada counts only with --cloze-eval (as in Megatron); ignored")
        argv = [a for a in argv if a != "--strict-lambada"]
    if known.webtext_eval:
        return "wiki", argv
    if known.eval_iters is not None:
        log.notice("--eval-iters counts only with --webtext-eval (as in Megatron); ignored")
        argv = _without(argv, "--eval-iters")
    if known.cloze_eval:
        return "lambada", argv
    if not any(a.split("=", 1)[0] == "--overlapping-eval" for a in argv):
        argv += ["--overlapping-eval", str(WIKITEXT_STRIDE)]
    return "wiki", argv


def _without(argv: list[str], name: str) -> list[str]:
    """`argv` minus every `name VALUE` and `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out
