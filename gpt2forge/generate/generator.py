"""Autoregressive generation with a preallocated KV cache (gpt2forge.generate.kv_cache).

One generation = one batched prefill of the (left-padded) prompts in a single forward pass, then one
token per step written into the cache: the prefix is never recomputed and nothing grows. The tokens
stay on the device (gpt2forge.generate.decode_loop) and the host reads them every `sync_every`
steps. With `compile=True` (the reference's `--poptorch-loop`) the decode step is the device's
fastest: on the CPU one C++ call per token (gpt2forge.generate.fused_step), else torch.compile'd
once for its static shapes; on CUDA that compiled forward, the token's choice and the loop's
bookkeeping are one CUDA graph, replayed per token (the LM head there over all padded_vocab rows,
the padding masked).

    gen = Generator(model, batch_size=2, max_len=192)
    out = gen.generate([[464, 3290], [40]], max_new_tokens=128, sampling=SamplingConfig(greedy=True))
    out.tokens  # new ids per row, stop token excluded
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Collection, Iterator, Sequence

import torch

from gpt2forge.core import log
from gpt2forge.core.capability import capabilities
from gpt2forge.core.compilation import use_machine_cache
from gpt2forge.core.device import synchronize
from gpt2forge.generate.decode_loop import DecodeLoop, Rows, TokenCallback, cuda_graph
from gpt2forge.generate.fused_step import FusedDecodeStep
from gpt2forge.generate.gemv import (
    PREFETCH_CHOICES,
    STREAM_CHOICES,
    KernelSettings,
    kernel_available,
    kernel_settings,
    lane_choices,
)
from gpt2forge.generate.kv_cache import CachedLM
from gpt2forge.generate.sampling import SamplingConfig, check_ids
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.text.tokenizer import load_tokenizer

SYNC_EVERY = 16
"""Decode steps a GPU runs between two host reads of the tokens: a row's stop is seen at most 15
steps late (their tokens are dropped), for one wait per 16 tokens instead of one per token."""


@dataclasses.dataclass
class GenerationResult:
    """What one `Generator.generate` call produced, and how long it took."""

    tokens: list[list[int]]
    """New token ids of each prompt, stop token excluded."""
    prefill_s: float
    """Wall time of the prompt forward pass and the first token's choice."""
    step_s: list[float]
    """Wall time of each later decode step (forward of one token + choice of the next)."""

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.step_s)


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to n inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DirectStep:
    """One compiled decode graph and how to call it without dynamo (Generator._decode_step).

    Dynamo hands the graph's inputs to it as one flat list: the step's ids, slots and pad at
    `positions`, and the CachedLM's parameters and cache buffers at the others, which stay the same
    tensors from call to call (`fixed`). `usable` is False when that could not be established
    (then the step keeps going through dynamo).
    """

    def __init__(self, compiled: Callable, fixed: list, positions: tuple[int, int, int] | None):
        self.compiled, self.fixed, self.positions = compiled, fixed, positions
        self.usable = positions is not None

    @classmethod
    def of(cls, compiled: Callable, gm: torch.fx.GraphModule, example_inputs: list,
           step_inputs: tuple[torch.Tensor, ...] | None, lm: torch.nn.Module) -> DirectStep:
        """The graph dynamo compiled while running the step on `step_inputs` (ids, slots, pad)."""
        unusable = cls(compiled, [], None)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if step_inputs is None or not isinstance(outputs, (tuple, list)) or len(outputs) != 1:
            return unusable
        own = {id(t) for t in itertools.chain(lm.parameters(), lm.buffers())}
        positions: list[int | None] = [None] * len(step_inputs)
        for i, x in enumerate(example_inputs):
            k = next((k for k, t in enumerate(step_inputs) if x is t), None)
            if k is not None and positions[k] is None:
                positions[k] = i
            elif not isinstance(x, torch.Tensor) or id(x) not in own:
                return unusable
        if None in positions:
            return unusable
        return cls(compiled, list(example_inputs), tuple(positions))

    def __call__(self, ids: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        args = list(self.fixed)
        for i, t in zip(self.positions, (ids, slots, pad)):
            args[i] = t
        return self.compiled(*args)[0]


class Generator:
    """Generates for up to `batch_size` prompts at a time, each up to `max_len` tokens in total
    (prompt + new tokens <= max_len <= n_positions). The cache is allocated once and reused by
    every `generate` call, so an interactive session never reallocates or recompiles."""

    def __init__(self, model: GPT2LMHeadModel, batch_size: int, max_len: int, compile: bool = False):
        self.device = next(model.parameters()).device
        self.graph_decode = compile and capabilities(self.device).graph_decode
        """Whether the decode step is compiled and, on CUDA, replayed as a CUDA graph with the token's choice."""
        # CUDA's graph: the LM head over the aligned padded_vocab rows (a cuBLAS-friendly shape).
        self.lm = CachedLM(model, batch_size, max_len, full_head=self.graph_decode).eval()
        self.vocab_size = model.config.vocab_size
        self.loop = DecodeLoop(batch_size, max_len, self.vocab_size, self.device)
        self.sync_every = 1 if self.device.type == "cpu" and not self.graph_decode else SYNC_EVERY
        """Decode steps between two host reads of the tokens (the CPU runs each step synchronously anyway)."""
        self.step = self.lm
        self.threads = torch.get_num_threads()  # prefill's
        self.kernel = KernelSettings(self.threads)  # the decode matmuls' (CPU); warm_up measures the fastest
        self._direct_steps: dict[tuple, DirectStep] = {}  # CPU: input signature -> its graph (_decode_step)
        self._pending: tuple[torch.Tensor, ...] | None = None  # the inputs of the step being compiled
        self._last_graph: DirectStep | None = None  # the graph that ran the latest compiled step
        self.fused: FusedDecodeStep | None = None  # CPU: the step as one C++ call (gpt2forge.generate.fused_step)
        if compile:
            use_machine_cache(None)
        if self.graph_decode:
            # Static shapes (B, 1): one inductor graph, captured with the rest of the token step in
            # a CUDA graph of our own (_token_step), not torch.compile's "reduce-overhead", whose
            # dynamo guards and input copies ran on every token.
            self.step = torch.compile(self.lm, dynamic=False, fullgraph=True)
        elif compile:
            self.fused = FusedDecodeStep.of(self.lm) if self.device.type == "cpu" else None
        if compile and not self.graph_decode and self.fused is None:
            # On CPU the graph's wrapper runs once per token and calls ~100 small kernels: a GPT-2
            # small step is shorter without its ~250 size and stride asserts, and shorter again with
            # the wrapper as C++ (cpp_wrapper) rather than Python, for a longer first compilation
            # (inductor caches it; measured: docs/benchmarks.md, Design measurements).
            # Inductor compiles it as torch.compile's default backend does; _capture_graph keeps it
            # so that _decode_step can call it without dynamo.
            self.step = torch.compile(self.lm, dynamic=False, fullgraph=True, backend=self._capture_graph)

    def _capture_graph(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """torch.compile backend: inductor's compilation of the step, kept as a DirectStep."""
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches={"size_asserts": False, "cpp_wrapper": True})
        graph = DirectStep.of(compiled, gm, example_inputs, self._pending, self.lm)

        def run(*args):
            self._last_graph = graph
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    @property
    def batch_size(self) -> int:
        return self.lm.batch_size

    @property
    def max_len(self) -> int:
        return self.lm.max_len

    @torch.no_grad()
    def warm_up(self, steps: int = 3) -> float:
        """Pick the decode matmuls' settings (`kernel`), then run the decode step `steps` times on
        dummy inputs (compilation, CUDA graph capture, allocator warm-up) so that later timings
        exclude them. Returns the seconds it took."""
        t0 = synchronize(self.device)
        self.kernel = self._probe_settings()
        ids = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.device)
        pad = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        with self._decoding():
            for s in range(steps):
                self._decode_step(ids, torch.tensor([s], device=self.device), pad)
        return synchronize(self.device) - t0

    def _decoding(self, kernel: KernelSettings | None = None) -> contextlib.AbstractContextManager:
        """The thread settings of a decode step: on CPU, torch's own ops on 1 thread and the
        matmuls (gpt2forge.generate.gemv) with `kernel`'s settings (default self.kernel).

        The step's attention, LayerNorm and GELU kernels are small: a second thread saves little
        and every OpenMP region waits for its slowest thread, which on a shared machine may be
        descheduled for milliseconds (on a loaded 2-core machine, 2 threads everywhere made GPT-2
        small's tokens many times slower: docs/benchmarks.md, Design measurements). The matmul
        kernel shares its work without that wait. Inductor bakes torch's thread count into its
        kernels, so the compiled step is always compiled and run inside this.
        """
        if self.device.type != "cpu":
            return num_threads(self.threads)
        stack = contextlib.ExitStack()
        stack.enter_context(num_threads(1))
        stack.enter_context(kernel_settings(self.kernel if kernel is None else kernel))
        return stack

    def _probe_settings(self) -> KernelSettings:
        """The fastest kernel settings for a decode step (the fused one where there is one, else
        eager), on CPU: 1 or all of torch's threads, each of gpt2forge.generate.gemv's PREFETCH_CHOICES,
        at batch 1 each of its STREAM_CHOICES, and above it each of its lane_choices().

        A decode step reads every weight once: one core reads memory nearly as fast as two, and
        when other processes share the cores a second thread may not run at all; and how many
        read streams a core should keep in flight depends on the memory system (8 were faster on
        the 2-core AVX2 machine, 4 on the 2-core AVX-512 EPYC: custom_ops/gemv.cpp), and so does the
        prefetch instruction (non-temporal prefetches cut a Xeon core's read sharply, where an
        EPYC kept its caches with them). Several rows of x make the loops bound by their instructions,
        where AVX-512's may beat AVX2's. Measured here rather than assumed, alternating the settings
        so that a burst of load hits them all.
        """
        n, default = torch.get_num_threads(), self.kernel
        kernel = kernel_available()
        # The stream count matters at batch 1 only (one row of x), the lanes above it, both only on the kernel.
        streams = STREAM_CHOICES if self.batch_size == 1 and kernel else (default.streams,)
        lanes = lane_choices() if self.batch_size > 1 and kernel else (default.lanes,)
        hints = PREFETCH_CHOICES if kernel else (default.prefetch,)
        settings = [KernelSettings(threads, s, hint, width) for threads in sorted({n, 1}, reverse=True)
                    for s in streams for hint in hints for width in lanes]
        if self.device.type != "cpu" or len(settings) == 1:
            return default._replace(threads=n)
        ids = torch.zeros(self.batch_size, 1, dtype=torch.long)
        pad = torch.zeros(self.batch_size, dtype=torch.long)
        slot = torch.zeros(1, dtype=torch.long)
        step = self.fused or self.lm
        best = {}
        for setting in settings * 2:
            with self._decoding(setting):
                for _ in range(3):
                    t0 = time.perf_counter()
                    step(ids, slot, pad)
                    best[setting] = min(best.get(setting, float("inf")), time.perf_counter() - t0)
        return min(best, key=best.get)

    def _decode_step(self, ids: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """self.step(ids, slots, pad); on CPU, once dynamo's guards have passed for inputs like these,
        the compiled graph called directly.

        Each call through dynamo checks ~200 guards (every parameter and cache buffer), then runs its
        frame and gathers the graph's ~170 inputs from the modules, a measurable part of a GPT-2
        small token on CPU that calling the graph directly saves (measured: docs/benchmarks.md,
        Design measurements). The step's modules never change, so what could fail a guard is the inputs
        and the grad mode: the first call with a new input signature goes through dynamo (and
        compiles if needed); later ones call the graph that served it, with the same module
        tensors (updated in place, weights are seen; replaced by other tensors, they are not).
        """
        if self.fused is not None:
            return self.fused(ids, slots, pad)
        if self.device.type != "cpu" or self.step is self.lm or self.graph_decode:
            return self.step(ids, slots, pad)
        signature = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                     *((t.shape, t.stride(), t.dtype) for t in (ids, slots, pad)))
        direct = self._direct_steps.get(signature)
        if direct is not None:
            return direct(ids, slots, pad)
        self._last_graph, self._pending = None, (ids, slots, pad)
        try:
            logits = self.step(ids, slots, pad)
        finally:
            self._pending = None
        if self._last_graph is not None and self._last_graph.usable:
            self._direct_steps[signature] = self._last_graph
        return logits

    def _prefill_inputs(self, prompts: Sequence[Sequence[int]]):
        """Left-padded ids (B, P), padding per row (B,), and the seen-token mask (B, V)."""
        B, V = self.batch_size, self.vocab_size
        P = max(len(p) for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.long)
        pad = torch.empty(B, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
            pad[b] = P - len(p)
        seen = torch.zeros(B, V, dtype=torch.bool)
        seen[ids.new_tensor([b for b, p in enumerate(prompts) for _ in p]),
             ids.new_tensor([t for p in prompts for t in p])] = True
        return ids.to(self.device), pad.to(self.device), seen.to(self.device)

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not 1 <= len(prompts) <= self.batch_size:
            raise ValueError(f"{len(prompts)} prompts for a generator of batch size {self.batch_size}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (use the end-of-text id for none)")
        for p in prompts:
            check_ids(list(p), self.vocab_size, "prompt")
        P = max(len(p) for p in prompts)
        if max_new_tokens < 1 or P + max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {P} tokens + {max_new_tokens} new tokens exceed max_len {self.max_len}")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingConfig,
                 stop_ids: Collection[int] = (), generator: torch.Generator | None = None,
                 on_token: TokenCallback | None = None) -> GenerationResult:
        """Up to `max_new_tokens` new ids for each prompt (non-empty id lists).

        A row stops at its first id in `stop_ids` (not included in its tokens); the call ends when
        every row has stopped. Fewer prompts than `batch_size` are allowed (the spare rows repeat
        the last prompt and are dropped). `generator` seeds the sampling.
        """
        self._check(prompts, max_new_tokens)
        stop_ids = frozenset(stop_ids)
        n, P = len(prompts), max(len(p) for p in prompts)
        ids, pad, seen = self._prefill_inputs(list(prompts) + [prompts[-1]] * (self.batch_size - n))
        loop, rows = self.loop, Rows(n, stop_ids, on_token)
        loop.start(pad, seen, stop_ids, P)
        # Sampling with a generator: its state after each token, to leave it after the stop token's
        # draw (as a loop of one step per token would) when a chunk ran past it.
        rewind = generator is not None and not sampling.greedy and self.sync_every > 1
        with num_threads(self.threads):  # prefill: matmuls with P rows, worth every thread
            t0 = synchronize(self.device)
            loop.record(self.lm(ids, torch.arange(P, device=self.device), pad), sampling, generator)  # token 0
            prefill_s = synchronize(self.device) - t0
        step = self._token_step(sampling, generator)
        with self._decoding():
            for start in range(0, max_new_tokens, self.sync_every):
                end = min(start + self.sync_every, max_new_tokens)
                t0 = time.perf_counter()
                states = [generator.get_state()] if rewind and start == 0 else []
                for _ in range(max(start, 1), end):  # token t comes from decode step t
                    step()
                    if rewind:
                        states.append(generator.get_state())
                chunk, finished = loop.read(start, end)  # the host waits here, once per chunk
                seconds = (time.perf_counter() - t0) / max(1, end - max(start, 1))
                last = rows.take(start, chunk, seconds)
                if last is not None:
                    if last < end - 1 and rewind:
                        generator.set_state(states[last - start])
                    break
                assert not all(finished[:n]), "the device saw a stop the host did not"
        return GenerationResult(rows.out, prefill_s, rows.step_s)

    def _token_step(self, sampling: SamplingConfig, generator: torch.Generator | None) -> Callable[[], None]:
        """One decode step over self.loop's buffers (DecodeLoop.token_step); with graph_decode on
        CUDA its CUDA graph's replay, captured on first use for this sampling, generator and stop
        buffer. A generator on another device than the model draws on the host: no graph then."""
        step = self.loop.token_step(self._decode_step, sampling, generator)
        if not (self.graph_decode and self.device.type == "cuda") or \
                (generator is not None and generator.device != self.device):
            return step
        key = (dataclasses.astuple(sampling), id(generator), self.loop.stop.numel())
        if key not in self.loop.graphs:  # the generator is kept with it: its id stays its own
            self.loop.graphs[key] = (cuda_graph(step, self.device, generator, self.loop.buffers()), generator)
        return self.loop.graphs[key][0]


def sample(model: GPT2LMHeadModel, prompt_ids: list[int], new_tokens: int, temperature: float = 0.8,
           top_k: int = 40, generator: torch.Generator | None = None, stop_id: int | None = None) -> list[int]:
    """Up to `new_tokens` ids drawn after `prompt_ids` (temperature <= 0: greedy), for the sample
    printed after training. The prompt is cut from the left to fit n_positions with the new
    tokens (at most n_positions - 1). Returns only the new ids (stops early at stop_id, excluded).
    The model's train/eval mode is restored afterwards.
    """
    n_ctx = model.config.n_positions
    new_tokens = min(new_tokens, n_ctx - 1)
    prompt = list(prompt_ids)[-(n_ctx - new_tokens):]
    greedy = temperature <= 0
    sampling = SamplingConfig(greedy=greedy, temperature=1.0 if greedy else temperature, top_k=top_k)
    was_training = model.training
    try:
        gen = Generator(model.eval(), batch_size=1, max_len=len(prompt) + new_tokens)
        stop = () if stop_id is None else (stop_id,)
        return gen.generate([prompt], new_tokens, sampling, stop, generator).tokens[0]
    finally:
        model.train(was_training)


def print_sample(model: GPT2LMHeadModel, tokenizer_dir: str | None, prompt: str, new_tokens: int, seed: int) -> None:
    """Print `new_tokens` tokens drawn after `prompt` (the sample after training, --sample-tokens), on
    rank 0, when the model's vocabulary is the tokenizer's (`tokenizer_dir`; None: GPT-2's BPE)."""
    if new_tokens <= 0 or log.rank() != 0:
        return
    tok = load_tokenizer(tokenizer_dir)
    if model.config.vocab_size != tok.vocab_size:
        log.notice(f"no sample: the model's vocabulary ({model.config.vocab_size}) is not the tokenizer's "
                   f"({tok.vocab_size})")
        return
    prompt_ids = tok.encode(prompt) or [tok.eot_id]
    ids = sample(model, prompt_ids, new_tokens, generator=torch.Generator().manual_seed(seed), stop_id=None)
    log.banner("Sample")
    log.info(tok.decode(prompt_ids + ids))
