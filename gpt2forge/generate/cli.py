"""`text_generate_gpt2.py`: the reference's flags, one-shot / interactive / prompt-file modes, the
reference's latency lines, and `--save-samples-path` records.

IPU flags get their device meaning: `--poptorch-loop` compiles the decode step (CUDA graphs on a
GPU); `--single-ipu`, `--layers-per-ipu`, `--matmul-proportion`, `--device-iterations` have nothing
to do on one CPU/GPU and are accepted with a notice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import torch

from gpt2forge.core import log
from gpt2forge.core.device import resolve_device
from gpt2forge.core.errors import UsageError, collect, naming_gpu_failures
from gpt2forge.core.flags import str_to_bool
from gpt2forge.core.memory import GiB, available_device_memory
from gpt2forge.core.precision import cpu_half_matmul_is_emulated
from gpt2forge.generate import gemv
from gpt2forge.generate.generator import GenerationResult, Generator
from gpt2forge.generate.sampling import SamplingConfig
from gpt2forge.model.pretrained import load_pretrained, resolve_model_dir

EOT_TEXT = "<|endoftext|>"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="text_generate_gpt2.py",
        description="Generate text from a GPT-2 checkpoint (ours or a Hugging Face GPT-2 directory) with a "
                    "KV cache. Without --prompt or --prompt-file: interactive (`Input: `; an empty line, EOF "
                    "or Ctrl-C ends).")
    flag = {"type": str_to_bool, "nargs": "?", "const": True, "default": False, "metavar": "BOOL"}
    a = p.add_argument
    a("--model-name-or-path", default="gpt2", help="checkpoint directory (step_N/, epoch_N/, a root with `latest`) "
      "or a local Hugging Face GPT-2 directory; nothing is downloaded (default: gpt2)")
    a("--tokenizer-type", type=int, default=0, choices=(0, 1), help="0: the GPT-2 files saved with the checkpoint "
      "(vocab.json + merges.txt or tokenizer.json; else the GPT-2 BPE); 1: Megatron gpt2-vocab.json + "
      "gpt2-merges.txt (the same BPE) (default: 0)")
    a("--prompt", default=None, help="one-shot prompt")
    a("--prompt-file", default=None, help="(new) batch mode: one prompt per line; one output line per prompt")
    a("--json", action="store_true", help="(new) with --prompt-file: JSON lines {prompt, completion, tokens}")
    a("--input-len", type=int, default=64, help="longest prompt in tokens; longer ones keep their last "
      "--input-len tokens, with a notice (default: 64)")
    a("--output-len", type=int, default=128, help="most tokens to generate; one that leaves no room for a prompt "
      "becomes half the model's n_positions, with a notice (default: 128)")
    a("--batch-size", type=int, default=1, help="rows generated together: the prompt repeated, or consecutive "
      "lines of --prompt-file (default: 1)")
    a("--temperature", type=float, default=1.0, help="softmax temperature (default: 1.0; the reference's 1.2 "
      "was never applied, so 1.0 reproduces its behaviour)")
    a("--topk", type=int, default=4, help="sample among the k most likely tokens, 0 = all (default: 4)")
    a("--top-p", type=float, default=1.0, help="(new) nucleus sampling mass, 1 = off (default: 1.0)")
    a("--repetition-penalty", type=float, default=1.0, help="penalise tokens already in the text, 1 = off "
      "(default: 1.0; the reference's 2.0 was never applied)")
    a("--greedy", action="store_true", help="(new) always take the most likely token")
    a("--seed", type=int, default=None, help="(new) sampling seed: the same seed gives the same text")
    a("--stop-token", default=EOT_TEXT, help=f"a row stops when it generates this token; the text is cut at "
      f"its first occurrence (default: {EOT_TEXT})")
    a("--ignore-eos", action="store_true", help="(new) never stop early: exactly --output-len tokens (benchmarks)")
    a("--save-samples-path", default=None, help="append Input/Output records to PATH/samples.txt")
    a("--fp16", **{**flag, "help": "run in float16 (weights and cache)"})
    a("--bf16", **{**flag, "help": "(new) run in bfloat16 (weights and cache)"})
    a("--poptorch-loop", **{**flag, "help": "the fastest decode loop of the device: torch.compile'd decode "
                                            "step, CUDA graphs on a GPU (compiles once, excluded from timings)"})
    a("--device", default="auto", help="(new) auto | cpu | cuda | cuda:N (default: auto)")
    a("--single-ipu", **{**flag, "help": "the whole model on one device: always the case here (accepted)"})
    a("--layers-per-ipu", type=int, nargs="+", default=None, help="IPU sharding (accepted; no effect)")
    a("--matmul-proportion", type=float, nargs="+", default=None, help="IPU memory knob (accepted; no effect)")
    a("--device-iterations", type=int, default=1, help="PopTorch device iterations (accepted; no effect)")
    return p


def _validate(args: argparse.Namespace) -> SamplingConfig:
    problems = []
    for name in ("input_len", "output_len", "batch_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.fp16 and args.bf16:
        problems.append("--fp16 and --bf16 exclude each other; pick one")
    if args.prompt is not None and args.prompt_file is not None:
        problems.append("--prompt and --prompt-file exclude each other; pick one")
    if args.json and args.prompt_file is None:
        problems.append("--json needs --prompt-file")
    if args.prompt_file is not None and not Path(args.prompt_file).is_file():
        problems.append(f"--prompt-file {args.prompt_file}: file not found")
    collect(problems)
    for name in ("layers_per_ipu", "matmul_proportion"):
        if getattr(args, name) is not None:
            log.notice(f"--{name.replace('_', '-')} is an IPU setting with no effect on one CPU/GPU; ignored")
    if args.single_ipu or args.device_iterations != 1:
        log.notice("--single-ipu / --device-iterations: the model always runs whole on one device; ignored")
    return SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.topk, top_p=args.top_p,
                          repetition_penalty=args.repetition_penalty)


def check_cache_fits(model, batch_size: int, length: int, device: torch.device) -> None:
    """The KV cache (keys and values of every layer for `batch_size` rows of `length` positions) is
    allocated whole before the first token, after the model: refuse one that cannot fit the memory
    the device has left, naming --batch-size."""
    cfg = model.config
    need = 2.0 * cfg.n_layer * batch_size * length * cfg.n_embd * next(model.parameters()).element_size()
    have, where = available_device_memory(device)
    if need > have:
        raise UsageError(f"--batch-size {batch_size}: the KV cache of {batch_size:,} rows of {length} positions needs "
                         f"{need / GiB:,.1f} GiB and {where} has less; use a smaller --batch-size or --output-len")


class Session:
    """A loaded model, its tokenizer and a Generator, plus what every mode needs around them."""

    def __init__(self, args: argparse.Namespace, sampling: SamplingConfig, device: torch.device):
        model, self.tok = load_pretrained(args.model_name_or_path, device, args.tokenizer_type)
        print(f"Loaded {resolve_model_dir(args.model_name_or_path)} ({model.config.num_params() / 1e6:.1f}M "
              f"parameters, {self.tok.name} tokenizer, device {device})", file=sys.stderr)
        n_ctx = model.config.n_positions
        if args.output_len >= n_ctx:  # tasks/run_text_generator.sh's 256 on `make train`'s 128 positions
            log.notice(f"--output-len {args.output_len} leaves no room for a prompt in the model's n_positions "
                       f"({n_ctx}): at most {n_ctx // 2} tokens are generated")
            args.output_len = n_ctx // 2
        if args.input_len + args.output_len > n_ctx:
            log.notice(f"--input-len {args.input_len} + --output-len {args.output_len} exceed the model's "
                       f"n_positions ({n_ctx}): prompts are limited to {n_ctx - args.output_len} tokens")
            args.input_len = n_ctx - args.output_len
        dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else None
        if dtype is not None:
            model.to(dtype)
        if (args.bf16 and device.type == "cpu" and cpu_half_matmul_is_emulated("bf16")
                and not gemv.kernel_available()):
            log.notice("--bf16: this CPU has no bf16 instructions and the custom ops library (its bf16 matmul "
                       "kernel) is not built, so bf16 matmuls are emulated, far slower than fp32; run `make` "
                       "or drop --bf16")
        self.args, self.sampling = args, sampling
        check_cache_fits(model, args.batch_size, args.input_len + args.output_len, device)
        self.gen = Generator(model, args.batch_size, args.input_len + args.output_len, compile=args.poptorch_loop)
        warm_s = self.gen.warm_up()  # excluded from the latency lines, as the reference's first call
        what = "Compiled the decode step" if args.poptorch_loop else "Warmed up"
        kernel = self.gen.kernel
        print(f"{what} in {warm_s:.1f} secs; decoding on {kernel.threads} thread(s), {kernel.streams} read streams, "
              f"{kernel.prefetch} prefetches, {kernel.lanes} lanes" if device.type == "cpu"
              else f"{what} in {warm_s:.1f} secs", file=sys.stderr)
        self.rng = torch.Generator(device=device)
        self.rng.manual_seed(args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self.stop_ids, self.stop_text = self._stop(args)
        self.samples: TextIO | None = None
        if args.save_samples_path:
            Path(args.save_samples_path).mkdir(parents=True, exist_ok=True)
            self.samples = open(Path(args.save_samples_path) / "samples.txt", "a", encoding="utf-8")
            self._record(f"Text generator record{datetime.datetime.now()}:")

    def _stop(self, args) -> tuple[tuple[int, ...], str | None]:
        if args.ignore_eos or not args.stop_token:
            return (), None
        if args.stop_token == EOT_TEXT:
            return (self.tok.eot_id,), EOT_TEXT
        ids = self.tok.encode(args.stop_token)
        return (tuple(ids) if len(ids) == 1 else ()), args.stop_token

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text) or [self.tok.eot_id]  # an empty prompt starts a new document
        limit = self.args.input_len
        if len(ids) > limit:
            print(f"notice: Input text length {len(ids)} larger than limit {limit}: keeping its last {limit} tokens",
                  file=sys.stderr, flush=True)
            ids = ids[-limit:]
        return ids

    def completion(self, ids: list[int]) -> str:
        """Decoded new tokens, cut at the first stop text (only if present: the reference's cut one
        character too many when it was absent)."""
        text = self.tok.decode(ids)
        if self.stop_text and self.stop_text in text:
            text = text[:text.index(self.stop_text)]
        return text

    def generate(self, prompts: list[list[int]], on_token=None) -> GenerationResult:
        return self.gen.generate(prompts, self.args.output_len, self.sampling, self.stop_ids, self.rng, on_token)

    def report(self, res: GenerationResult, prompt_len: int, out: TextIO) -> None:
        """The reference's three latency lines (warm-up/compilation excluded)."""
        n = max(1, len(res.step_s) + 1)
        per_token = sum(res.step_s) / len(res.step_s) if res.step_s else res.prefill_s
        print(f"latency avg per sentence: {res.total_s * 1000:.2f} ms/sentence_({n})", file=out)
        print(f"Per-token latency avg: {per_token * 1000:.2f} ms/token", file=out)
        print(f"Batch size: {self.gen.batch_size}; Input length {prompt_len}; Output length {n}, "
              f"throughput: {self.gen.batch_size / res.total_s:.2f} samples/sec", file=out, flush=True)

    def _record(self, line: str) -> None:
        if self.samples is not None:
            self.samples.write(line + "\n")
            self.samples.flush()
            os.fsync(self.samples.fileno())

    def record(self, prompt: str, output: str) -> None:
        self._record(f"Input: {prompt}")
        self._record(f"Output: {output}")

    def close(self) -> None:
        if self.samples is not None:
            self.samples.close()


class _Stream:
    """Prints row 0's text as its tokens arrive (holding back incomplete UTF-8 and the stop text)."""

    def __init__(self, session: Session):
        self.s, self.ids, self.shown, self.done = session, [], 0, False

    def __call__(self, step: int, row_ids: list[int], finished: list[bool]) -> None:
        if self.done or row_ids[0] in self.s.stop_ids:
            self.done = True
            return
        self.ids.append(row_ids[0])
        text = self.s.completion(self.ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for its other bytes
            return
        stop = self.s.stop_text
        # A stop text of several tokens may be arriving: hold back as many characters as it could cover.
        hold = len(stop) - 1 if stop and not self.s.stop_ids and stop not in self.s.tok.decode(self.ids) else 0
        if len(text) - hold > self.shown:
            sys.stdout.write(text[self.shown:len(text) - hold])
            sys.stdout.flush()
            self.shown = len(text) - hold

    def finish(self) -> None:
        text = self.s.completion(self.ids)
        sys.stdout.write(text[self.shown:] + "\n")
        sys.stdout.flush()


def _one(session: Session, text: str) -> None:
    """Generate for one prompt (repeated --batch-size times), streaming row 0."""
    ids = session.encode(text)
    sys.stdout.write(text)
    stream = _Stream(session)
    res = session.generate([ids] * session.gen.batch_size, stream)
    stream.finish()
    for b in range(1, len(res.tokens)):
        print(text + session.completion(res.tokens[b]))
    session.report(res, len(ids), sys.stdout)
    for row in res.tokens:
        session.record(text, text + session.completion(row))


def _prompt_file(session: Session, path: str) -> None:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    B = session.gen.batch_size
    for start in range(0, len(lines), B):
        texts = lines[start:start + B]
        prompts = [session.encode(t) for t in texts]
        res = session.generate(prompts)
        for text, ids in zip(texts, res.tokens):
            completion = session.completion(ids)
            if session.args.json:
                print(json.dumps({"prompt": text, "completion": completion, "tokens": len(ids)}, ensure_ascii=False))
            else:
                print((text + completion).replace("\\", "\\\\").replace("\n", "\\n"))
            session.record(text, text + completion)
        session.report(res, max(len(p) for p in prompts), sys.stderr)


def _interactive(session: Session) -> None:
    while True:
        try:
            text = input("Input: ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not text.strip():
            return
        try:
            _one(session, text)
        except KeyboardInterrupt:  # stop this generation, keep the session
            print()


def run_generate(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sampling = _validate(args)
    device = resolve_device(args.device)
    with _naming_gpu_failures(args, device):
        session = Session(args, sampling, device)
        try:
            if args.prompt_file is not None:
                _prompt_file(session, args.prompt_file)
            elif args.prompt is not None:
                _one(session, args.prompt)
            else:
                _interactive(session)
        finally:
            session.close()
    return 0


def _naming_gpu_failures(args: argparse.Namespace, device: torch.device):
    """The one place a generation's GPU failure (out of memory, a GPU gone) becomes one line and exit
    code 2: around loading, warm-up and every prompt (errors.naming_gpu_failures)."""
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"

    def doing() -> str:  # called at the failure: the session may have shortened the lengths to the model's
        return (f"generation with {args.model_name_or_path} ({precision}) for {args.batch_size} row(s) of up to "
                f"{args.input_len} + {args.output_len} tokens")

    fixes = ["a smaller --batch-size", "a shorter --output-len or --input-len"]
    if precision == "fp32":
        fixes.append("--bf16 or --fp16 (half the weights and KV cache)")
    saved = f"; the samples already in {args.save_samples_path}/samples.txt are kept" if args.save_samples_path else ""
    return naming_gpu_failures(device, doing, "try " + ", ".join(fixes),
                               f"the completions printed so far are complete{saved}")
