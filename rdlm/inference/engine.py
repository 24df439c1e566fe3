"""The decode engine: a batch of sequences over one preallocated `RecurrentKVCache`.

`Sequences` is a left-padded batch over one `ModelRunner` that runs blocks of tokens (the prompt, speculative
drafts and their verification; a transformers forward over `RecurrentCache`). `Session`, a `Sequences`,
owns a generation's state: its `ModelRunner` (rdlm.inference.runner: the model, the cache, the
valid entries the masks read, the s_0 noise table), the buffer length, the sampling generators and the
static decode buffers. `StaticBatch` (rdlm.inference.static) puts it behind the engine interface that
`rdlm.inference.generate` (and every caller of it: the CLI, chat, the transformers and lm-eval
integrations) drives.

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
on the eager path (the same runner calls over slices of the cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from rdlm.inference.exits import ExitCriterion, ExitTrack, iterate_with_exits
from rdlm.inference.graphs import StaticSteps, resolve_compile
from rdlm.inference.params import GenerationConfig, check_criterion, check_prompt
from rdlm.inference.prefill import PromptChunk
from rdlm.inference.runner import Call, ModelRunner
from rdlm.inference.sampling import NonFiniteLogitsError  # noqa: F401 (its home before sampling.py)
from rdlm.model.lm import RecurrentDepthLM
from rdlm.resources import check_time, forward_seconds


@dataclass
class Rows:
    """The rows of one adaptive token still iterating (all rows, or the active ones after exits)."""
    index: Tensor            # [b] rows of the batch
    state: Tensor            # [b, 1, h]
    embedded: Tensor         # [b, 1, h]
    call: Call               # these rows' RoPE, mask and cache rows
    steps: Tensor            # [b] iterations run
    exited: Tensor           # [b] bool
    streak: Tensor           # [b] consecutive passing evaluations
    logits: Tensor | None    # [b, V] of the latest iteration when the criterion reads logits
    remaining: Tensor | None = None   # [b] a learned gate's running sums (rdlm.inference.exits.ExitTrack)
    cumulative: Tensor | None = None

    def select(self, keep: Tensor) -> "Rows":
        pick = lambda t: None if t is None else t[keep]  # noqa: E731
        index = self.index[keep]
        return Rows(index, self.state[keep], self.embedded[keep], self.call.select(keep, index), self.steps[keep],
                    self.exited[keep], self.streak[keep], pick(self.logits), pick(self.remaining),
                    pick(self.cumulative))


def check_generation_time(config, device: torch.device, batch: int, prompt_length: int,
                          generation: GenerationConfig) -> None:
    """Refuse a generation whose one token (or whole run) cannot end in any reasonable time; warn when long."""
    r = generation.num_steps
    prefill = forward_seconds(config, device, batch * prompt_length, 1, generation.prefill_steps or r)
    token = forward_seconds(config, device, batch, 1, r)
    check_time(prefill + generation.max_new_tokens * token, max(token, prefill),
               f"generating {generation.max_new_tokens} tokens at r = {r}", "token")


class Sequences:
    """A batch of sequences over one `ModelRunner` and its cache, run in blocks of tokens at a fixed r (the
    prompt, speculative drafts and their verification, a transformers forward over `RecurrentCache`).
    Prompts are left-padded to a common length: buffer index t of row b holds that row's token at
    position t - pad[b]. `length` buffer entries are written; a block appends at `length`.

    new_tokens: the room after the longest prompt (the buffer holds prompt and new tokens); num_slots /
    strategy: the core cache (rdlm.inference.cache); seed / init_scale: the s_0 noise table; criterion /
    min_steps: a learned exit gate that picks each token's read-out iteration (an Ouro checkpoint), else
    None."""

    def __init__(self, model: RecurrentDepthLM, prompts: list[list[int]], new_tokens: int, num_slots: int,
                 strategy: str, seed: int, init_scale: float, criterion: ExitCriterion | None = None,
                 min_steps: int = 0) -> None:
        for p in prompts or [[]]:  # no prompt is refused as an empty one
            check_prompt(model, p)
        self.model, self.criterion, self.min_steps = model, criterion, min_steps
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch = len(prompts)
        self.prompt_length = max(len(p) for p in prompts)
        max_length = self.prompt_length + new_tokens
        if max_length > model.config.context_length:
            raise ValueError(f"prompt ({self.prompt_length}) + new tokens ({new_tokens}) exceeds the context "
                             f"length {model.config.context_length}")
        pad = torch.tensor([self.prompt_length - len(p) for p in prompts], device=self.device)
        self.runner = ModelRunner(model, self.batch, max_length, num_slots, strategy, pad, seed, init_scale)
        self.cache = self.runner.cache
        self.ids = torch.zeros(self.batch, self.prompt_length, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            self.ids[b, self.prompt_length - len(p):] = torch.tensor(p, device=self.device)
        self.length = 0  # buffer entries written so far

    # ---- block calls (prompt, drafts, verification): eager, over slices of the cache

    def begin(self, ids: Tensor) -> tuple[Tensor, Call]:
        """Mark the new tokens (buffer indices from `self.length` on) valid and run the prelude: (e, the
        call for these tokens)."""
        self.runner.admit(self.length, ids.shape[1])
        call = self.runner.block(self.length, ids.shape[1])
        return self.runner.embed(ids, call), call

    def append(self, ids: Tensor) -> tuple[Tensor, Call]:
        """`begin`, and count the tokens as written: the caller runs their iterations and coda over the
        returned call (a speculative draft)."""
        e, call = self.begin(ids)
        self.length += ids.shape[1]
        return e, call

    def rewind(self, position: int) -> None:
        """Forget the buffer entries from index `position` on: the next call writes its tokens there (their
        cache entries are overwritten; until then the mask hides them)."""
        self.length = position
        self.runner.rewind(position)

    def forward(self, ids: Tensor, num_steps: int, last_only: bool = True) -> tuple[Tensor, Tensor]:
        """Run tokens through the model at a fixed r (the prefill: `PromptChunk`, a chunk of every row);
        append them to the cache. (logits, state): the logits of the last token [B, V], or of every token
        [B, n, V] with `last_only=False`. With a learned gate, each token is read out at the iteration its
        gate chose, as the reference selects, so the first new token is the reference's."""
        e, call = self.begin(ids)
        chunk = PromptChunk.block(self.runner, call, e, num_steps, self.criterion, self.min_steps)
        state, logits = chunk.run(self.runner)
        self.length += ids.shape[1]
        return (logits[:, -1] if last_only else logits), state


class Session(Sequences):
    """Prefill and decode for a batch of prompts, all with one `GenerationConfig`, over one cache
    (`Sequences`): the static decode step and adaptive exits. (Self-speculative decoding runs its rounds over
    a session's `Sequences`: rdlm.inference.speculative.)"""

    def __init__(self, model: RecurrentDepthLM, prompts: list[list[int]], config: GenerationConfig,
                 extra_tokens: int = 0) -> None:
        # Refused before the cache is allocated: a job that would not end in any reasonable time.
        check_generation_time(model.config, next(model.parameters()).device, len(prompts),
                              max(map(len, prompts), default=0), config)
        super().__init__(model, prompts, config.max_new_tokens + extra_tokens, config.core_slots,
                         config.cache_strategy, config.seed, config.init_scale, check_criterion(model, config),
                         config.min_steps)
        self.config = config
        self.static = resolve_compile(config.compile, self.device)
        self.samplers = [torch.Generator(device=self.device).manual_seed(config.seed)
                         for _ in range(self.batch)]
        self.seen = torch.zeros(self.batch, model.config.vocab_size, dtype=torch.bool, device=self.device)
        for b, p in enumerate(prompts):
            self.seen[b, torch.tensor(p, device=self.device)] = True
        self.last_state: Tensor | None = None
        # Inputs of a decoded token, written in place so that a captured step reads them.
        h = model.config.hidden_size
        self.index = torch.zeros((), dtype=torch.long, device=self.device)     # its buffer index
        self.tokens = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self.warm = torch.zeros(self.batch, 1, h, dtype=self.dtype, device=self.device)
        self.static_steps = StaticSteps(self.device, self.static)

    @property
    def capture_seconds(self) -> float:
        return self.static_steps.capture_seconds

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
        self.runner.admit(t)
        self.index.fill_(t)
        self.tokens.copy_(tokens.view(-1, 1))
        if self.config.continuous_cot:
            self.warm.copy_(self.last_state)
        if self.criterion is None:
            logits, state = self.static_steps.run(("fixed",), self.token_fixed)
            steps = torch.full((self.batch,), self.config.num_steps, device=self.device)
        else:
            logits, state, steps = self.token_adaptive()
        self.length = t + 1
        self.last_state = state
        return logits, steps

    def decode_start(self) -> tuple[Tensor, Tensor, Call]:
        """Prelude and s_0 of the token being decoded, every row: (e, s_0, its call). Static, the call
        writes at the device-side `self.index` and sees the whole buffer; eager, at `self.length`."""
        call = self.runner.block(self.index if self.static else self.length)
        e = self.runner.embed(self.tokens, call)
        return e, self.warm if self.config.continuous_cot else self.runner.initial_state(e, call.positions), call

    def token_fixed(self) -> tuple[Tensor, Tensor]:
        """One token per row at r = num_steps: (logits [B, V], final state [B, 1, h])."""
        r = self.config.num_steps
        e, state, call = self.decode_start()
        state = self.runner.iterate(state, e, call, range(r))
        self.cache.fill_missing(r, call.start, None)
        return self.runner.readout(state, call)[:, -1], state

    # ---- adaptive exits

    def token_adaptive(self) -> tuple[Tensor, Tensor, Tensor]:
        """One token per row, each row iterating until the exit criterion fires (between min_steps and
        num_steps). Returns (logits [B, V], final state [B, 1, h], steps [B]).

        While every row iterates, chunks of `exit_sync_every` iterations run as static steps (CUDA
        graphs on CUDA) over the whole batch, exited rows frozen on the device; at the end of a chunk
        the host looks at the exit flags, and once some rows have exited the others go on alone."""
        c = self.config
        r, every = c.num_steps, c.exit_sync_every
        if self.criterion.spec.exact:  # every row runs every iteration: one chunk, the exit only selects
            return self.token_exact()
        rows = full = self.static_steps.run(("adaptive", "start"), self.adaptive_start)[0]
        final, steps = rows.state.clone(), rows.steps.clone()
        i, compact = 0, False
        while i < r:
            n = min(every, r - i)
            if compact:
                rows = self.iterate(rows, i, n)
            else:
                self.static_steps.run(("adaptive", i, n), lambda: (self.iterate(rows, i, n, in_place=True),),
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
        self.cache.fill_missing(steps, full.call.start, None)
        return self.runner.readout(final, full.call)[:, -1], final, steps

    def token_exact(self) -> tuple[Tensor, Tensor, Tensor]:
        """`gate-exact`: all num_steps iterations for every row (every cache entry written, as the
        reference computes), the logits read from each row's state at its gate exit. Steps reported: the
        iterations run, num_steps."""
        r = self.config.num_steps
        rows = self.static_steps.run(("adaptive", "start"), self.adaptive_start)[0]
        track = ExitTrack(rows.steps, rows.exited, rows.streak, rows.logits, rows.remaining, rows.cumulative)
        _, track = iterate_with_exits(
            lambda state, i, exited: self.runner.step(state, rows.embedded, i, rows.call),
            None, rows.state, track, self.criterion, 0, r, r, min_steps=self.config.min_steps, freeze=False,
            gate=self.runner.exit_probability)
        final = track.exit_state.view_as(rows.state)
        steps = torch.full((self.batch,), r, device=self.device)
        self.cache.fill_missing(steps, rows.call.start, None)
        return self.runner.readout(final, rows.call)[:, -1], final, steps

    def adaptive_start(self) -> tuple[Rows]:
        """Prelude and s_0 of the token; every row active."""
        e, state, call = self.decode_start()
        zeros = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        logits = None
        if self.criterion.uses_logits:
            logits = torch.zeros(self.batch, self.model.config.vocab_size, device=self.device)
        gate = ExitTrack.start(self.batch, self.device, gate=True) if self.criterion.uses_gate else None
        return (Rows(torch.arange(self.batch, device=self.device), state.clone(), e, call, zeros,
                     zeros.bool(), zeros.clone(), logits, gate and gate.remaining, gate and gate.cumulative),)

    def iterate(self, rows: Rows, first: int, n: int, in_place: bool = False) -> Rows:
        """Iterations first .. first + n - 1 for `rows` (`iterate_with_exits`), deciding exits on the
        device. A row that exited keeps its state and stops writing core cache entries. `in_place` writes
        the results into `rows`' own tensors (a static step's outputs are its inputs)."""
        c = self.config

        def step(state: Tensor, i: int, exited: Tensor) -> Tensor:
            return self.runner.step(state, rows.embedded, i, rows.call.but(core_writers=~exited) if i else rows.call)

        def readout(state: Tensor) -> Tensor:
            return self.runner.readout(state, rows.call)[:, -1]

        track = ExitTrack(rows.steps, rows.exited, rows.streak, rows.logits, rows.remaining, rows.cumulative)
        gate = self.runner.exit_probability if self.criterion.uses_gate else None
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
