"""The decode engine: a batch of sequences over one preallocated `RecurrentKVCache`.

`Session` owns everything a generation touches: the cache, the attention mask (`key_valid`), the
positions, the s_0 noise table and the static decode buffers. `rdlm.inference.generate` (and every caller of it:
the CLI, chat, the transformers and lm-eval integrations) drives it.

A decoded token is data, not control flow. Its inputs live in preallocated device tensors (the token
ids, the buffer index it is written at, the mask over the whole cache), so every shape is fixed for the
life of a generation and no host sync happens inside a token:

- fixed r: prelude, r core iterations, coda. On CUDA the whole token is captured once in a CUDA graph
  and replayed for every later token (one launch instead of thousands of kernels).
- adaptive r (paper section 6.1): the exit criterion is evaluated on the device after each iteration
  (or every `exit_every` iterations); a row that exited keeps its state and stops writing core cache
  entries. The host reads the exit flags every `exit_sync_every` iterations; rows that exited then
  leave the batch (the core's matmuls run on the active rows only), so a batch's tokens/s rises with
  the iterations its exits save. When to look does not change any result, only the cost.

The prompt, speculative drafts and their verification are blocks of several tokens per row; they run
on the eager path (the same model calls over slices of the cache).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rdlm.inference.cache import CacheCall, RecurrentKVCache
from rdlm.inference.exits import ExitTrack, iterate_with_exits
from rdlm.inference.noise import noise_table
from rdlm.inference.params import GenerationConfig
from rdlm.model.lm import RecurrentDepthLM, Rope
from rdlm.resources import check_time, forward_seconds


class NonFiniteLogitsError(FloatingPointError):
    """The model's logits hold NaN or infinity: no token can be chosen from them."""

    def __init__(self, model: RecurrentDepthLM, token: int) -> None:
        super().__init__(f"model produced non-finite logits at new token {token}; weights may be NaN: "
                         f"{getattr(model, 'source', None) or 'the model'}")


def read_tokens(chosen: Tensor, logits: Tensor) -> tuple[list[int], bool]:
    """(chosen ids, whether every logit was finite), read in the one device-to-host copy the ids need
    anyway: the check costs no synchronization of its own (the CUDA-graph step included)."""
    values = torch.cat([chosen.reshape(-1), torch.isfinite(logits).all().reshape(1).to(chosen.dtype)]).tolist()
    return values[:-1], bool(values[-1])


@dataclass
class Rows:
    """The rows of one adaptive token still iterating (all rows, or the active ones after exits)."""
    index: Tensor            # [b] rows of the batch
    state: Tensor            # [b, 1, h]
    embedded: Tensor         # [b, 1, h]
    rope: Rope
    mask: Tensor             # [b, 1, 1, keys]
    steps: Tensor            # [b] iterations run
    exited: Tensor           # [b] bool
    streak: Tensor           # [b] consecutive passing evaluations
    logits: Tensor | None    # [b, V] of the latest iteration when the criterion reads logits
    remaining: Tensor | None = None   # [b] a learned gate's running sums (rdlm.inference.exits.ExitTrack)
    cumulative: Tensor | None = None

    def select(self, keep: Tensor) -> "Rows":
        pick = lambda t: None if t is None else t[keep]  # noqa: E731
        return Rows(self.index[keep], self.state[keep], self.embedded[keep],
                    (self.rope[0][keep], self.rope[1][keep]), self.mask[keep], self.steps[keep],
                    self.exited[keep], self.streak[keep], pick(self.logits), pick(self.remaining),
                    pick(self.cumulative))


def resolve_compile(compile: bool | None, device: torch.device) -> bool:
    """The static, captured decode step: on by default on CUDA (CUDA graphs). Off on the CPU, which
    has no graphs to capture: there the static step measured the same speed as the eager one
    (benchmarks/bench_generate.py --compile both), and the eager one reads only the written part of
    the cache."""
    if compile is None:
        return device.type == "cuda"
    return bool(compile)


def check_generation_time(config, device: torch.device, batch: int, prompt_length: int,
                          generation: GenerationConfig) -> None:
    """Refuse a generation whose one token (or whole run) cannot end in any reasonable time; warn when long."""
    r = generation.num_steps
    prefill = forward_seconds(config, device, batch * prompt_length, 1, generation.prefill_steps or r)
    token = forward_seconds(config, device, batch, 1, r)
    check_time(prefill + generation.max_new_tokens * token, max(token, prefill),
               f"generating {generation.max_new_tokens} tokens at r = {r}", "token")


class Session:
    """Prefill and decode for a batch of prompts over one cache. Buffer index t of row b holds that
    row's token at position t - pad[b] (prompts are left-padded to a common length)."""

    def __init__(self, model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig,
                 extra_tokens: int = 0) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        vocab = model.config.vocab_size
        for p in prompts:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        self.model, self.config = model, config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch = len(prompts)
        self.prompt_length = max(len(p) for p in prompts)
        max_length = self.prompt_length + config.max_new_tokens + extra_tokens
        if max_length > model.config.context_length:
            raise ValueError(f"prompt ({self.prompt_length}) + new tokens ({config.max_new_tokens}) exceeds "
                             f"the context length {model.config.context_length}")
        check_generation_time(model.config, self.device, self.batch, self.prompt_length, config)
        self.static = resolve_compile(config.compile, self.device)
        self.graphs = self.static and self.device.type == "cuda"
        slots = config.cache_slots if config.cache_strategy == "shared" else config.max_steps
        self.cache = RecurrentKVCache(model.config, self.batch, max_length, slots, config.cache_strategy,
                                      self.dtype, self.device)
        self.pad = torch.tensor([self.prompt_length - len(p) for p in prompts], device=self.device)
        self.ids = torch.zeros(self.batch, self.prompt_length, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            self.ids[b, self.prompt_length - len(p):] = torch.tensor(p, device=self.device)
        self.key_valid = torch.zeros(self.batch, max_length, dtype=torch.bool, device=self.device)
        self.length = 0  # buffer entries written so far
        self.criterion = config.criterion(model.config)
        if self.criterion is not None and self.criterion.uses_gate and model.exit_gate is None:
            raise ValueError(f"exit criterion {self.criterion.name!r} needs a model with a learned exit gate "
                             "(an Ouro checkpoint); this one has none")
        self.noise = noise_table(model, config.seed, config.init_scale, max_length, self.dtype, self.device)
        self.samplers = [torch.Generator(device=self.device).manual_seed(config.seed)
                         for _ in range(self.batch)]
        self.seen = torch.zeros(self.batch, vocab, dtype=torch.bool, device=self.device)
        for b, p in enumerate(prompts):
            self.seen[b, torch.tensor(p, device=self.device)] = True
        self.last_state: Tensor | None = None
        # Inputs of a decoded token, written in place so that a captured step reads them.
        h = model.config.hidden_size
        self.index = torch.zeros((), dtype=torch.long, device=self.device)     # its buffer index
        self.tokens = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self.warm = torch.zeros(self.batch, 1, h, dtype=self.dtype, device=self.device)
        self.graphed: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # key -> (graph, its outputs)
        self.capture_seconds = 0.0

    # ---- inputs of one model call: tokens at buffer indices start .. start + n - 1

    def positions(self, start: int, n: int) -> Tensor:
        index = torch.arange(start, start + n, device=self.device)
        return (index.unsqueeze(0) - self.pad.unsqueeze(1)).clamp_min(0)

    def mask(self, start: int, n: int) -> Tensor:
        """[B, 1, n, start + n]: causal over the buffer and no padding; a pad query sees itself only
        (so its softmax is defined; nobody attends to it)."""
        end = start + n
        keys = self.key_valid[:, None, None, :end]
        if n == 1:
            return keys
        q = torch.arange(start, end, device=self.device).view(-1, 1)
        k = torch.arange(end, device=self.device).view(1, -1)
        return (keys & (k <= q)) | (k == q)

    def initial_state(self, embedded: Tensor, positions: Tensor) -> Tensor:
        """s_0 of tokens at `positions` ([B, n]): rows of the (seed, position) noise table (or e, for a
        model whose s_0 is its embedding)."""
        return self.model.start_state(embedded, None if self.noise is None else self.noise[positions])

    # ---- block calls (prompt, drafts, verification): eager, over slices of the cache

    def begin(self, ids: Tensor) -> tuple[Tensor, Rope, Tensor, Tensor, CacheCall]:
        """Mark the new tokens valid and run the prelude. Returns (e, rope, mask, positions, the cache for
        calls on these tokens)."""
        start, n = self.length, ids.shape[1]
        self.key_valid[:, start:start + n] = True
        if start == 0:
            self.key_valid[:, :n] &= torch.arange(n, device=self.device) >= self.pad.unsqueeze(1)
        positions = self.positions(start, n)
        rope, mask = self.model.rope(positions, check=False), self.mask(start, n)
        cache = self.cache.at(start)
        return self.model.embed(ids, rope, mask, cache), rope, mask, positions, cache

    def rewind(self, position: int) -> None:
        """Forget the buffer entries from index `position` on: the next call writes its tokens there (their
        cache entries are overwritten; until then the mask hides them)."""
        self.length = position
        self.key_valid[:, position:] = False

    def forward(self, ids: Tensor, num_steps: int, initial_state: Tensor | None = None,
                last_only: bool = True) -> tuple[Tensor, Tensor]:
        """Run tokens through the model at a fixed r; append them to the cache. (logits, state): the
        logits of the last token [B, V], or of every token [B, n, V] with `last_only=False`."""
        e, rope, mask, positions, cache = self.begin(ids)
        start = cache.plan.start
        state = self.initial_state(e, positions) if initial_state is None else initial_state
        if self.criterion is not None and self.criterion.uses_gate:
            # Every token runs num_steps (a block call); each is read out at the iteration its gate chose,
            # as the reference selects, so the first new token is the reference's.
            track = ExitTrack.start(state.shape[0] * state.shape[1], self.device, gate=True)
            _, track = iterate_with_exits(
                lambda s, i, exited: self.model.step(s, e, i, rope, mask, cache), None, state, track,
                self.criterion, 0, num_steps, num_steps, min_steps=self.config.min_steps, freeze=False,
                gate=self.model.exit_probability)
            state = track.exit_state.view_as(state)
        else:
            for i in range(num_steps):
                state = self.model.step(state, e, i, rope, mask, cache)
        self.cache.fill_missing(num_steps, start, start + ids.shape[1])
        logits = self.model.readout(state, rope, mask, cache)
        self.length = start + ids.shape[1]
        return (logits[:, -1] if last_only else logits), state

    def prefill(self) -> Tensor:
        steps = self.config.prefill_steps or self.config.num_steps
        logits, state = self.forward(self.ids, steps)
        self.last_state = state[:, -1:]
        return logits

    # ---- decoding one token per row

    def decode(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Feed one token per row; returns (next logits [B, V], iterations run [B])."""
        self.seen[torch.arange(self.batch, device=self.device), tokens] = True
        t = self.length
        self.key_valid[:, t] = True
        self.index.fill_(t)
        self.tokens.copy_(tokens.view(-1, 1))
        if self.config.continuous_cot:
            self.warm.copy_(self.last_state)
        if self.criterion is None:
            logits, state = self.run(("fixed",), self.token_fixed)
            steps = torch.full((self.batch,), self.config.num_steps, device=self.device)
        else:
            logits, state, steps = self.token_adaptive()
        self.length = t + 1
        self.last_state = state
        return logits, steps

    def run(self, key: tuple, body: Callable[[], tuple], idempotent: bool = True) -> tuple:
        """Run a static body: eagerly, or on CUDA through a CUDA graph captured on first use. A
        replay's outputs are the graph's own tensors, overwritten by the next replay. The first call
        runs the body once to warm up (allocator, cuBLAS workspaces), captures it, then replays it;
        a body that updates its inputs in place (`idempotent=False`) is not replayed after the warm-up
        that already did its work."""
        if not self.graphs:
            return body()
        if key in self.graphed:
            graph, outputs = self.graphed[key]
            graph.replay()
            return outputs
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            warm = body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = body()
        self.graphed[key] = (graph, outputs)
        self.capture_seconds += time.perf_counter() - t0
        if not idempotent:
            return warm
        graph.replay()
        return outputs

    def decode_cache(self) -> CacheCall:
        """The cache for calls on the token being decoded, every row: static, it writes at the device-side
        `self.index`; eager, at `self.length`."""
        return self.cache.at(self.index if self.static else self.length)

    def decode_inputs(self) -> tuple[Tensor, Rope, Tensor, Tensor]:
        """(e, rope, mask, positions) of the token at buffer index `self.index`; the cache writes there."""
        positions = (self.index - self.pad).view(-1, 1)
        rope = self.model.rope(positions, check=False)
        if self.static:  # the whole buffer: a fixed shape; the mask hides what is not written yet
            mask = self.key_valid[:, None, None, :]
        else:
            mask = self.key_valid[:, None, None, :self.length + 1]
        return self.model.embed(self.tokens, rope, mask, self.decode_cache()), rope, mask, positions

    def token_fixed(self) -> tuple[Tensor, Tensor]:
        """One token per row at r = num_steps: (logits [B, V], final state [B, 1, h])."""
        r = self.config.num_steps
        e, rope, mask, positions = self.decode_inputs()
        cache = self.decode_cache()
        state = self.warm if self.config.continuous_cot else self.initial_state(e, positions)
        for i in range(r):
            state = self.model.step(state, e, i, rope, mask, cache)
        self.cache.fill_missing(r, cache.plan.start, None)
        return self.model.readout(state, rope, mask, cache)[:, -1], state

    # ---- adaptive exits

    def token_adaptive(self) -> tuple[Tensor, Tensor, Tensor]:
        """One token per row, each row iterating until the exit criterion fires (between min_steps and
        num_steps). Returns (logits [B, V], final state [B, 1, h], steps [B]).

        While every row iterates, chunks of `exit_sync_every` iterations run as static steps (CUDA
        graphs on CUDA) over the whole batch, exited rows frozen on the device; at the end of a chunk
        the host looks at the exit flags, and once some rows have exited the others go on alone."""
        c, cache = self.config, self.decode_cache()
        r, every = c.num_steps, c.exit_sync_every
        if self.criterion.spec.exact:  # every row runs every iteration: one chunk, the exit only selects
            return self.token_exact()
        rows = full = self.run(("adaptive", "start"), self.adaptive_start)[0]
        final, steps = rows.state.clone(), rows.steps.clone()
        i, compact = 0, False
        while i < r:
            n = min(every, r - i)
            if compact:
                rows = self.iterate(rows, i, n, cache.but(rows=rows.index))
            else:
                self.run(("adaptive", i, n), lambda: (self.iterate(rows, i, n, cache, in_place=True),),
                         idempotent=False)
            i += n
            if i == r:
                break
            exited = rows.exited
            done = exited.cpu()  # the host looks: rows that exited leave the batch
            if bool(done.any()):
                final[rows.index[exited]] = rows.state[exited]
                steps[rows.index[exited]] = rows.steps[exited]
                if bool(done.all()):
                    rows = rows.select(~exited)
                    break
                rows, compact = rows.select(~exited), True
        final[rows.index] = rows.state
        steps[rows.index] = rows.steps
        self.cache.fill_missing(steps, cache.plan.start, None)
        logits = self.model.readout(final, full.rope, full.mask, cache)[:, -1]
        return logits, final, steps

    def token_exact(self) -> tuple[Tensor, Tensor, Tensor]:
        """`gate-exact`: all num_steps iterations for every row (every cache entry written, as the
        reference computes), the logits read from each row's state at its gate exit. Steps reported: the
        iterations run, num_steps."""
        r, cache = self.config.num_steps, self.decode_cache()
        rows = self.run(("adaptive", "start"), self.adaptive_start)[0]
        track = ExitTrack(rows.steps, rows.exited, rows.streak, rows.logits, rows.remaining, rows.cumulative)
        _, track = iterate_with_exits(
            lambda state, i, exited: self.model.step(state, rows.embedded, i, rows.rope, rows.mask, cache),
            None, rows.state, track, self.criterion, 0, r, r, min_steps=self.config.min_steps, freeze=False,
            gate=self.model.exit_probability)
        final = track.exit_state.view_as(rows.state)
        steps = torch.full((self.batch,), r, device=self.device)
        self.cache.fill_missing(steps, cache.plan.start, None)
        logits = self.model.readout(final, rows.rope, rows.mask, cache)[:, -1]
        return logits, final, steps

    def adaptive_start(self) -> tuple[Rows]:
        """Prelude and s_0 of the token; every row active."""
        e, rope, mask, positions = self.decode_inputs()
        state = self.warm if self.config.continuous_cot else self.initial_state(e, positions)
        zeros = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        logits = None
        if self.criterion.uses_logits:
            logits = torch.zeros(self.batch, self.model.config.vocab_size, device=self.device)
        gate = ExitTrack.start(self.batch, self.device, gate=True) if self.criterion.uses_gate else None
        return (Rows(torch.arange(self.batch, device=self.device), state.clone(), e, rope, mask, zeros,
                     zeros.bool(), zeros.clone(), logits, gate and gate.remaining, gate and gate.cumulative),)

    def iterate(self, rows: Rows, first: int, n: int, cache: CacheCall, in_place: bool = False) -> Rows:
        """Iterations first .. first + n - 1 for `rows` (`iterate_with_exits`), deciding exits on the
        device; `cache` is the cache for these rows. A row that exited keeps its state and stops writing
        core cache entries. `in_place` writes the results into `rows`' own tensors (a static step's outputs
        are its inputs)."""
        c = self.config

        def step(state: Tensor, i: int, exited: Tensor) -> Tensor:
            writing = cache.but(core_writers=~exited) if i else cache
            return self.model.step(state, rows.embedded, i, rows.rope, rows.mask, writing)

        def readout(state: Tensor) -> Tensor:
            return self.model.readout(state, rows.rope, rows.mask, cache)[:, -1]

        track = ExitTrack(rows.steps, rows.exited, rows.streak, rows.logits, rows.remaining, rows.cumulative)
        gate = self.model.exit_probability if self.criterion.uses_gate else None
        state, track = iterate_with_exits(step, readout, rows.state, track, self.criterion, first, n,
                                          c.num_steps, min_steps=c.min_steps, every=c.exit_every, gate=gate)
        out = dataclasses.replace(rows, state=state, steps=track.steps, exited=track.exited,
                                  streak=track.streak, logits=track.logits, remaining=track.remaining,
                                  cumulative=track.cumulative)
        if in_place:
            for name in ("state", "steps", "exited", "streak", "logits", "remaining", "cumulative"):
                target = getattr(rows, name)
                if target is not None:
                    target.copy_(getattr(out, name))
            return rows
        return out

    # ---- self-speculative decoding

    def speculate(self, pending: int) -> tuple[list[int], int, int]:
        """One round of self-speculative decoding (batch of one), from the `pending` token (chosen,
        not yet fed). Draft L tokens with N iterations each; then continue those L positions from
        iteration N to M in one forward: the prelude output and the first N iterations are the
        draft's (they do not depend on the total depth), the cache already holds slots 0..N-1.
        Accept drafts while they equal the verified greedy choice. The tokens are plain greedy
        decoding's exactly in float32; in bfloat16/float16 the batched verification rounds differently
        from one-token decoding, so a near-tie (top-2 logits a few units in the last place apart) may
        go the other way (see rdlm.inference.generate).
        Returns (new tokens: accepted drafts then the next pending token, drafted, accepted)."""
        c = self.config
        n_draft, depth, length = c.draft_steps, c.num_steps, c.draft_length
        start = self.length
        length = min(length, self.cache.max_length - start)
        fed, embedded, states = [pending], [], []
        for j in range(length):
            e, rope, mask, positions, cache = self.begin(torch.tensor([[fed[-1]]], device=self.device))
            state = self.initial_state(e, positions)
            for i in range(n_draft):
                state = self.model.step(state, e, i, rope, mask, cache)
            logits = self.model.readout(state, rope, mask, cache)
            self.length += 1
            embedded.append(e)
            states.append(state)
            fed.append(int(logits[0, -1].argmax()))
        drafts = fed[1:]
        # Verify: iterations N..M-1 for all L drafted positions at once.
        self.length = start
        rope, mask = self.model.rope(self.positions(start, length), check=False), self.mask(start, length)
        cache = self.cache.at(start)
        e, state = torch.cat(embedded, dim=1), torch.cat(states, dim=1)
        for i in range(n_draft, depth):
            state = self.model.step(state, e, i, rope, mask, cache)
        logits = self.model.readout(state, rope, mask, cache)[0]
        verified, finite = read_tokens(logits.argmax(dim=-1), logits)
        if not finite:
            raise NonFiniteLogitsError(self.model, self.length + 1 - self.prompt_length)
        accepted = 0
        while accepted < length and drafts[accepted] == verified[accepted]:
            accepted += 1
        processed = min(accepted + 1, length)  # positions whose cache entries are now final
        self.rewind(start + processed)
        return drafts[:processed - 1] + [verified[processed - 1]], length, accepted
