"""The decode loop's device side: the state of one generation in static buffers on the model's
device, the per-token work over them, and the CUDA graph that replays one whole token.

Every new token stays on the device: it is chosen (argmax or sampling, gpt2forge.generate.sampling),
written into column t of `chosen`, checked against the stop ids (`finished`), added to the seen
mask, and fed to the next step, all by tensor ops. The host only reads `chosen` and `finished`
every `sync_every` tokens (Generator.generate), so the GPU never waits for Python between tokens:

    loop = DecodeLoop(batch_size=2, max_len=64, vocab_size=50257, device=device)
    loop.start(pad, seen, stop_ids=(50256,), prompt_len=P)
    loop.record(prefill_logits, sampling, generator)          # token 0
    step = loop.token_step(forward, sampling, generator)     # token t: forward, slot + 1, record
    step(); step(); ...
    rows, finished = loop.read(0, 3)                          # the one host sync of 3 tokens

On CUDA, `cuda_graph(step, ...)` captures the step once (the model's forward, the choice and the
bookkeeping) and returns its replay: no dynamo guards, no Python and no input copies per token.
Elsewhere the same step runs eagerly, which is what the CPU tests check token for token.
`Rows` is the host's side: each row's tokens up to its stop, fed one read at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from gpt2forge.generate.sampling import SamplingConfig, next_token

# on_token(step, ids of every row this step (B,), finished flags after this step (B,))
TokenCallback = Callable[[int, list[int], list[bool]], None]

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(ids (B, 1), slots (1,), pad (B,)) -> logits (B, >= vocab_size): a CachedLM decode call."""


class DecodeLoop:
    """The static buffers of one generator's decode loop (allocated once, reused by every
    generation, so a captured graph stays valid) and the token step over them."""

    def __init__(self, batch_size: int, max_len: int, vocab_size: int, device: torch.device, stop_slots: int = 8):
        B, long = batch_size, dict(dtype=torch.long, device=device)
        self.vocab_size = vocab_size
        self.tok = torch.zeros(B, 1, **long)
        """The latest token of each row: the next step's input."""
        self.slot = torch.zeros(1, **long)
        """The cache slot `tok` goes into."""
        self.pad = torch.zeros(B, **long)
        """Padding slots per row (left padding, gpt2forge.generate.kv_cache)."""
        self.seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
        """Tokens already in each row's sequence (the repetition penalty's)."""
        self.chosen = torch.zeros(B, max_len, **long)
        """Column t: the new token t of each row."""
        self.index = torch.zeros(1, **long)
        """The column of `chosen` the next token goes into."""
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        """Whether the row has produced a stop id."""
        self.stop = torch.full((stop_slots,), -1, **long)
        """The stop ids, -1 (no token) in the unused slots."""
        self.graphs: dict[tuple, tuple[Callable[[], None], object]] = {}
        """Captured token steps (CUDA) by what they were captured for; see Generator._token_step."""

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer a token step changes."""
        return [self.tok, self.slot, self.seen, self.chosen, self.index, self.finished]

    def start(self, pad: torch.Tensor, seen: torch.Tensor, stop_ids: Collection[int], prompt_len: int) -> None:
        """A new generation: prompts left-padded by `pad` (B,) to `prompt_len`, `seen` (B, V) their
        tokens; the first new token goes into slot `prompt_len` and column 0."""
        stop = sorted(stop_ids)
        if len(stop) > self.stop.numel():  # a larger buffer: graphs captured over the old one are stale
            self.stop = torch.full((len(stop),), -1, dtype=torch.long, device=self.stop.device)
            self.graphs.clear()
        self.stop.fill_(-1)
        if stop:
            self.stop[:len(stop)] = torch.tensor(stop)
        self.pad.copy_(pad)
        self.seen.copy_(seen)
        self.slot.fill_(prompt_len)
        self.index.zero_()
        self.finished.zero_()

    def record(self, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Choose each row's next token from `logits` (B, >= V) and keep it: in `chosen`, in
        `finished` (a stop id), in `seen` (with a repetition penalty) and in `tok` for the next step."""
        nxt = next_token(logits, sampling, self.vocab_size, self.seen, generator)[:, None]  # (B, 1)
        self.chosen.index_copy_(1, self.index, nxt)
        self.finished |= (nxt == self.stop[None, :]).any(dim=1)  # an explicit compare: no host sync
        if sampling.repetition_penalty != 1.0:
            self.seen.scatter_(1, nxt, True)
        self.tok.copy_(nxt)
        self.index += 1

    def token_step(self, forward: Forward, sampling: SamplingConfig,
                   generator: torch.Generator | None) -> Callable[[], None]:
        """One decode step as a function of no arguments: `tok` through `forward` in `slot`, the
        slot advanced, the next token recorded. Only tensor ops on the buffers: capturable."""

        def step() -> None:
            logits = forward(self.tok, self.slot, self.pad)
            self.slot += 1
            self.record(logits, sampling, generator)

        return step

    def read(self, start: int, end: int) -> tuple[list[list[int]], list[bool]]:
        """The host sync: tokens start..end-1 of each row (B lists) and the rows' stop flags now,
        in one transfer."""
        both = torch.cat([self.chosen[:, start:end], self.finished[:, None].long()], dim=1).tolist()
        return [row[:-1] for row in both], [bool(row[-1]) for row in both]


def cuda_graph(step: Callable[[], None], device: torch.device, generator: torch.Generator | None,
               state: list[torch.Tensor]) -> Callable[[], None]:
    """`step` captured as a CUDA graph; returns its replay.

    As torch.cuda.graph requires, the step first runs twice on a side stream (lazy initialisation,
    the allocator's pool); `state` (the tensors it changes) and `generator`'s state are put back
    afterwards, so that capturing changes no result. A sampling `generator` (on this device) is
    registered with the graph, so each replay draws fresh numbers and advances it as an eager
    step would; None means CUDA's default generator, which torch registers itself.
    """
    saved = [t.clone() for t in state]
    rng = None if generator is None else generator.get_state()
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    current.wait_stream(side)
    for t, s in zip(state, saved):
        t.copy_(s)
    if generator is not None:
        generator.set_state(rng)
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph):
        step()
    return graph.replay


class Rows:
    """The host's side of a generation: each row's new tokens up to its first stop id, the time of
    each decode step, and the on_token calls, fed one chunk of tokens at a time."""

    def __init__(self, n: int, stop_ids: frozenset[int], on_token: TokenCallback | None):
        self.n, self.stop_ids, self.on_token = n, stop_ids, on_token
        self.out: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.step_s: list[float] = []

    def take(self, start: int, chunk: list[list[int]], seconds: float) -> int | None:
        """Tokens start.. of every row (chunk: B lists), each decode step `seconds` long; returns
        the token after which every row had stopped (the rest of the chunk is dropped), else None."""
        for j in range(len(chunk[0])):
            t = start + j
            row_ids = [row[j] for row in chunk[:self.n]]
            for b, i in enumerate(row_ids):
                if not self.finished[b]:
                    self.finished[b] = i in self.stop_ids
                    if not self.finished[b]:
                        self.out[b].append(i)
            if t > 0:
                self.step_s.append(seconds)
            if self.on_token is not None:
                self.on_token(t, row_ids, self.finished[:])
            if all(self.finished):
                return t
        return None
