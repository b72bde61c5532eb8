"""`tasks/evaluate_wiki.py` and `tasks/evaluate_lambada.py`: flags, model loading, summary, JSON.

The reference's flags keep working (`--valid-data`, `--checkpoint-input-dir`, `--seq-length`,
`--overlapping-eval`, `--strict-lambada [BOOL]`, `--tokenizer-type`, `--batch-size`, `--fp16`,
`--log-interval`); its IPU-only flags are accepted and ignored with a notice. Megatron-LM's
`scripts/run_gpt2_eval.py` flags work on both (`megatron_eval`), and `tasks/run_gpt2_eval.py` takes that
script's command line whole (`run_gpt2_eval_main`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gpt2forge.core import log
from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.device import resolve_device
from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError, cli_main, naming_gpu_failures
from gpt2forge.core.flags import str_to_bool
from gpt2forge.core.precision import configure_matmul, resolve_precision
from gpt2forge.evaluation.data import data_format, load_stream, read_json_lines, read_text
from gpt2forge.evaluation.detokenizer import DETOKENIZERS, detokenizer_name_for, get_detokenizer, sample_of
from gpt2forge.evaluation.megatron_eval import add_megatron_flags, apply_megatron_flags, check_shape, dispatch
from gpt2forge.evaluation.protocol import LAMBADA_TARGETS, build_cloze_examples, lm_eval_pages
from gpt2forge.evaluation.scoring import evaluate_cloze, evaluate_pages, evaluate_stream
from gpt2forge.model.pretrained import load_pretrained, resolve_model_dir

IPU_FLAGS = ("--layers-per-ipu", "--device-iterations", "--matmul-proportion", "--executable-cache-dir",
             "--eod-mask-loss", "--task")


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--checkpoint-input-dir", "--model-name-or-path", "--pretrained-checkpoint", "--model-path",
                   dest="checkpoint", required=True,
                   help="our checkpoint (step_N/, epoch_N/ or a root with `latest`), a Megatron-LM checkpoint or a "
                        "Hugging Face GPT-2 directory (--model-path: Megatron's name)")
    p.add_argument("--valid-data", "--data-path", dest="valid_data", nargs="+", required=True, metavar="PATH",
                   help="the evaluation file (exactly one)")
    p.add_argument("--tokenizer-type", type=int, choices=(0, 1), default=None,
                   help="0: HF GPT-2 files (vocab.json + merges.txt), 1: Megatron gpt2-vocab.json + "
                        "gpt2-merges.txt; a tokenizer saved with the checkpoint wins (default: its own or GPT-2)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens the model reads per window (default: the model's n_positions)")
    p.add_argument("--batch-size", type=int, default=8, help="windows/examples per forward pass (default: 8)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="autocast precision; auto: bf16 on CUDA, fp32 on CPU (default: auto)")
    p.add_argument("--fp16", dest="precision", action="store_const", const="fp16", help="= --precision fp16")
    p.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="= --precision bf16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--output-json", default=None, metavar="PATH",
                   help="write every number and every protocol setting here (atomically)")
    p.add_argument("--detokenizer", choices=("auto", *DETOKENIZERS), default="auto",
                   help="auto: from the content (WikiText's marks ' @-@ ', ' = Heading = ' -> wikitext, raw files "
                        "included), else the name (ptb -> ptb, lambada -> lambada); none opts out")
    p.add_argument("--log-interval", type=int, default=10,
                   help="(reference) kept for compatibility; progress is the tqdm bar")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name in IPU_FLAGS:
        p.add_argument(name, nargs="*", default=None, help=argparse.SUPPRESS)
    return p


def wiki_parser() -> argparse.ArgumentParser:
    p = _parser("evaluate_wiki.py", "Perplexity with overlapping windows (Megatron-LM protocol) over a "
                "WikiText file, a loose-JSON corpus or a Megatron mmap prefix.")
    p.add_argument("--overlapping-eval", type=int, default=None, metavar="STRIDE",
                   help="tokens between window starts; each window scores its last STRIDE tokens, so every "
                        "token is scored once with >= seq_length - STRIDE tokens of context "
                        "(default: --seq-length, no overlap)")
    p.add_argument("--data-format", choices=("auto", "text", "jsonl", "mmap"), default="auto",
                   help="auto: PATH.bin/.idx -> mmap, *.json/*.jsonl -> jsonl (large corpora), else text")
    p.add_argument("--json-key", default="text", help="jsonl: the key holding each document (default: text)")
    p.add_argument("--max-windows", type=int, default=None,
                   help="score only the first N windows (a partial, quick result; marked in the JSON)")
    add_megatron_flags(p, "wiki")
    p.add_argument("--protocol", choices=("megatron", "lm-eval"), default="megatron",
                   help="megatron: one token stream, overlapping windows, per-original-token perplexity; "
                        "lm-eval: lm-evaluation-harness's wikitext task (pages after <|endoftext|>, rolling "
                        "windows, word and byte perplexity, bits per byte) (default: megatron)")
    return p


def lambada_parser() -> argparse.ArgumentParser:
    p = _parser("evaluate_lambada.py", "LAMBADA cloze accuracy (Megatron-LM protocol) over JSON lines "
                "{\"text\": passage}; the target is the passage's last word.")
    p.add_argument("--strict-lambada", type=str_to_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="score the whole last word (all its tokens greedy-correct) instead of its last BPE "
                        "token (default: False)")
    p.add_argument("--max-examples", type=int, default=None,
                   help="score only the first N passages (a partial result; marked in the JSON)")
    p.add_argument("--lambada-target", choices=LAMBADA_TARGETS, default="megatron",
                   help="megatron: the last whitespace-separated word (the reference's and Megatron-LM's, "
                        "the default so figures compare with theirs); lm-eval: everything after the last space, "
                        "scored whole (lm-evaluation-harness's lambada_openai; implies --strict-lambada)")
    add_megatron_flags(p, "lambada")
    return p


class Session:
    """What both tasks set up the same way: device, precision, model, tokenizer, window length."""

    def __init__(self, args: argparse.Namespace, task: str):
        problems = []
        if len(args.valid_data) != 1:
            problems.append(f"--valid-data takes exactly one path (got {len(args.valid_data)})")
        if args.batch_size < 1:
            problems.append(f"--batch-size must be >= 1 (got {args.batch_size})")
        if args.seq_length is not None and args.seq_length < 1:
            problems.append(f"--seq-length must be >= 1 (got {args.seq_length})")
        if problems:
            raise UsageError("; ".join(problems))
        apply_megatron_flags(args, task)
        for name in IPU_FLAGS:
            if getattr(args, name.lstrip("-").replace("-", "_")) is not None:
                log.notice(f"{name} is an IPU/reference flag with no effect here; ignored")
        self.args = args
        self.data_path = args.valid_data[0]
        self.device = resolve_device(args.device)
        self.precision = resolve_precision(args.precision, self.device)
        configure_matmul(self.device, self.precision, False)
        self.ckpt_dir = resolve_model_dir(args.checkpoint)
        self.model, self.tokenizer = load_pretrained(args.checkpoint, self.device, args.tokenizer_type)
        check_shape(args, self.model.config)
        n_pos = self.model.config.n_positions
        self.seq_len = args.seq_length or n_pos
        if self.seq_len > n_pos:
            raise UsageError(f"--seq-length {self.seq_len} exceeds the model's n_positions ({n_pos}); "
                             f"use --seq-length {n_pos} or less")
        self.detokenizer = (detokenizer_name_for(self.data_path, sample_of(self.data_path))
                            if args.detokenizer == "auto" else args.detokenizer)
        # Right padding never reaches a scored position (causal attention): any valid id will do.
        self.pad_id = self.tokenizer.eot_id if self.tokenizer.eot_id is not None else 0
        self.t0 = time.perf_counter()

    def record(self, task: str, result: dict, protocol: dict, dataset: dict) -> dict:
        """The --output-json document: numbers, protocol, data, model, tokenizer, runtime."""
        weights = next((self.ckpt_dir / f for f in ("model.safetensors", "pytorch_model.bin")
                        if (self.ckpt_dir / f).is_file()), None)
        tok = self.tokenizer
        return {
            "task": task, "result": result, "protocol": protocol, "dataset": dataset,
            "checkpoint": {"path": str(self.args.checkpoint), "resolved": str(self.ckpt_dir),
                           "weights_sha256": file_sha256(weights) if weights else None,
                           "config": self.model.config.to_hf_dict() if hasattr(self.model.config, "to_hf_dict")
                           else None},
            "tokenizer": {"name": getattr(tok, "name", type(tok).__name__), "type": self.args.tokenizer_type,
                          "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "runtime": {"device": str(self.device), "precision": self.precision,
                        "batch_size": self.args.batch_size, "seconds": time.perf_counter() - self.t0,
                        "torch": torch.__version__, "python": platform.python_version()},
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        }

    def naming_gpu_failures(self):
        """The one place an evaluation's GPU failure (out of memory, a GPU gone) becomes one line and
        exit code 2: around all of its scoring (errors.naming_gpu_failures)."""
        a = self.args
        doing = (f"evaluation of {a.checkpoint} ({self.model.config.num_params() / 1e6:.1f}M parameters, "
                 f"{self.precision}) in batches of {a.batch_size} x {self.seq_len:,} tokens")
        fixes = [f"a smaller --batch-size (now {a.batch_size})", "a shorter --seq-length"]
        if self.precision == "fp32":
            fixes.append("--precision bf16 (or fp16 where the GPU has no bf16)")
        return naming_gpu_failures(self.device, lambda: doing, "try " + ", ".join(fixes),
                                   "nothing is lost: --output-json is written only when the evaluation completes")

    def finish(self, summary: str, record: dict) -> None:
        log.info(summary)
        if self.args.output_json:
            write_atomic(self.args.output_json, json.dumps(record, indent=2, sort_keys=True) + "\n")
            log.info(f"wrote {self.args.output_json}")


@cli_main
def wiki_main(argv: Sequence[str] | None = None) -> int:
    args = wiki_parser().parse_args(argv)
    s = Session(args, "wiki")
    with s.naming_gpu_failures():
        return _wiki(s, args)


def _wiki(s: Session, args: argparse.Namespace) -> int:
    """WikiText perplexity: the stream protocol (Megatron's) or lm-eval's."""
    stride = args.overlapping_eval or s.seq_len
    if args.max_windows is not None and args.max_windows < 1:
        raise UsageError(f"--max-windows must be >= 1 (got {args.max_windows})")
    fmt = data_format(s.data_path, args.data_format)
    if args.protocol == "lm-eval":
        return _wiki_lm_eval(s, fmt)
    max_tokens = None if args.max_windows is None else (args.max_windows - 1) * stride + s.seq_len + 1
    log.info(f"> building {fmt} token stream from {s.data_path} (detokenizer {s.detokenizer}) ...")
    stream = load_stream(s.data_path, fmt, s.detokenizer, s.tokenizer.encode, s.tokenizer.eot_id,
                         s.model.config.vocab_size, args.json_key, max_tokens)
    log.info(f" > number of original tokens: {stream.num_original_tokens}, "
             f"number of detokenized tokens: {len(stream.tokens)}")
    res = evaluate_stream(s.model, stream.tokens, s.seq_len, stride, batch_size=args.batch_size,
                          precision=s.precision, num_original_tokens=stream.num_original_tokens,
                          max_windows=args.max_windows, pad_id=s.pad_id, progress=not args.no_progress)
    out = res.to_dict()
    out["partial"] = args.max_windows is not None
    adjusted = f"{res.adjusted_ppl:.4f}" if res.adjusted_ppl is not None else "n/a"
    summary = (f"avg loss: {res.loss:.4E}, ppl: {res.ppl:.4E}, adjusted ppl: {adjusted}, token ratio: "
               f"{res.token_ratio} | {res.scored_tokens} tokens scored in {res.windows} windows, "
               f"original tokens {res.num_original_tokens}, seq length {s.seq_len}, stride {stride}, "
               f"detokenizer {s.detokenizer}, {s.precision}" + (" (PARTIAL)" if out["partial"] else ""))
    protocol = {"seq_length": s.seq_len, "stride": stride, "detokenizer": stream.info.get("detokenizer"),
                "windows": res.windows, "max_windows": args.max_windows,
                "adjusted_ppl_formula": "exp(loss_sum / (num_original_tokens - 1))",
                "num_original_tokens_rule": "whitespace-separated words + one end-of-line per line",
                "scoring": "window 0 scores all targets; window i>0 scores its last `stride` targets"}
    s.finish(summary, s.record("wikitext-perplexity", out, protocol, stream.info))
    return 0


def _wiki_lm_eval(s: Session, fmt: str) -> int:
    """`--protocol lm-eval`: lm-evaluation-harness's wikitext task on a WikiText text file."""
    if fmt != "text" or s.args.max_windows is not None:
        raise UsageError("--protocol lm-eval takes a WikiText text file (e.g. wiki.test.raw) and no --max-windows")
    if s.tokenizer.eot_id is None:
        raise UsageError("--protocol lm-eval needs a tokenizer with an end-of-text token (pages start with it)")
    pages = lm_eval_pages(read_text(Path(s.data_path), "--valid-data"))
    log.info(f"> {len(pages)} pages from {s.data_path} (detokenizer {s.detokenizer}), rolling windows of {s.seq_len}")
    res = evaluate_pages(s.model, pages, s.tokenizer.encode, s.tokenizer.eot_id, s.seq_len,
                         detokenize=get_detokenizer(s.detokenizer), batch_size=s.args.batch_size,
                         precision=s.precision, pad_id=s.pad_id, progress=not s.args.no_progress)
    summary = (f"word perplexity: {res.word_perplexity:.4f}, byte perplexity: {res.byte_perplexity:.4f}, bits per "
               f"byte: {res.bits_per_byte:.4f} | {res.pages} pages, {res.words} words, {res.bytes} bytes, "
               f"{res.scored_tokens} tokens scored, seq length {s.seq_len}, detokenizer {s.detokenizer}, {s.precision}")
    protocol = {"name": "lm-eval wikitext", "seq_length": s.seq_len, "detokenizer": s.detokenizer,
                "pages": "split at level-1 headings (EleutherAI/wikitext_document_level)",
                "scoring": "per page: <|endoftext|> + page tokens, disjoint rolling windows (loglikelihood_rolling)",
                "word_count": "len(re.split(r'\\s+', page)) before detokenization", "byte_count": "UTF-8 bytes"}
    dataset = {"path": s.data_path, "sha256": file_sha256(Path(s.data_path)), "pages": res.pages}
    s.finish(summary, s.record("wikitext-lm-eval", res.to_dict() | {"partial": False}, protocol, dataset))
    return 0


@cli_main
def lambada_main(argv: Sequence[str] | None = None) -> int:
    args = lambada_parser().parse_args(argv)
    s = Session(args, "lambada")
    with s.naming_gpu_failures():
        return _lambada(s, args)


def _lambada(s: Session, args: argparse.Namespace) -> int:
    """LAMBADA cloze accuracy."""
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError(f"--max-examples must be >= 1 (got {args.max_examples})")
    path = Path(s.data_path)
    log.info(f"> building lambada dataset from {path} ...")
    texts = read_json_lines(path, "text", "--valid-data")
    detok = get_detokenizer(s.detokenizer)
    texts = [detok(t) for t in texts[: args.max_examples]]
    strict = args.strict_lambada or args.lambada_target == "lm-eval"
    examples = build_cloze_examples(texts, s.tokenizer.encode, strict, s.seq_len, args.lambada_target)
    log.info(f" > found {len(examples)} samples.")
    res = evaluate_cloze(s.model, examples, strict, batch_size=args.batch_size,
                         precision=s.precision, pad_id=s.pad_id, progress=not args.no_progress)
    out = res.to_dict()
    out["partial"] = args.max_examples is not None
    if res.truncated_examples:
        log.info(f" > {res.truncated_examples} example(s) longer than {s.seq_len + 1} tokens lost context on "
                 "the left (none dropped)")
    summary = (f"number correct: {res.correct}, total examples: {res.examples}, avg accuracy: {res.accuracy:.4f}"
               f" | target ppl {res.ppl:.4f}, {'strict (whole word)' if res.strict else 'non-strict (last token)'}"
               f", {res.truncated_examples} truncated, seq length {s.seq_len}, {s.precision}"
               + (" (PARTIAL)" if out["partial"] else ""))
    target = ("everything after the last space, ids of encode(context + target) after encode(context) "
              "(lm-eval)" if args.lambada_target == "lm-eval" else
              "last whitespace-separated word, encoded as ' ' + word" if res.strict
              else "last BPE token of the encoded passage")
    protocol = {"seq_length": s.seq_len, "strict": res.strict, "detokenizer": s.detokenizer,
                "truncation": "left (context), counted", "max_examples": args.max_examples,
                "lambada_target": args.lambada_target, "target": target,
                "ppl_formula": "exp(target NLL summed over examples / examples)"}
    dataset = {"path": str(path), "sha256": file_sha256(path), "examples": len(examples)}
    s.finish(summary, s.record("lambada", out, protocol, dataset))
    return 0


@cli_main
def run_gpt2_eval_main(argv: Sequence[str] | None = None) -> int:
    """`tasks/run_gpt2_eval.py`: Megatron-LM's `scripts/run_gpt2_eval.py` command line (megatron_eval)."""
    task, task_argv = dispatch(sys.argv[1:] if argv is None else argv)
    return (lambada_main if task == "lambada" else wiki_main)(task_argv)
