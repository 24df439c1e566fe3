"""The one prefill: a block of tokens run through prelude, r core iterations (with a learned gate, each
token read out at its exit) and coda, a `PromptChunk`. A transformers forward over `Sequences`
(rdlm.integrations.hf.sequences) runs the whole left-padded batch as one chunk in one go (`PromptChunk.block`,
`run`); the continuous batch (rdlm.inference.batching) prefills its prompts inside its steps, a chunk at a
time.

A prompt does not run its r iterations in one call that stalls every decoding row: the prompts admitted
together form `PromptChunk`s of similar lengths (each right-padded to its longest; the scheduler groups them,
rdlm.inference.scheduling.scheduler.length_groups), and each step of the batch runs one core
iteration of every chunk in flight in the same model call as the decoding rows (a packed call,
rdlm.inference.execution.cache.PackedCall), each chunk at its own iteration. When a chunk has run its iterations
the coda runs over its tokens; the logits of a prompt's last token choose its first new token. A
prompt longer than the chunk size goes on with its next chunk, which reads the earlier chunks' keys of
the same iteration from the cache, so the tokens are those of a prefill in one piece; that needs a
cache slot per iteration, so a request that cycles through fewer slots than its prefill runs
iterations (a KV-cache budget) is prefilled in one chunk.

With a learned exit gate, where each token of the chunk stands is an `ExitTrack` over its [g, n] tokens
(`PromptChunk.gate`; rdlm.inference.exits.criteria): after each iteration it takes the track's one update
(`ExitTrack.after_iteration`: the iteration counted, the gate read against each row's threshold), and its
`exit_state` is what the coda reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rdlm.inference.execution.model_calls import Call, ModelCalls, Pack
from rdlm.inference.exits.criteria import ExitCriterion, make_exit_criterion
from rdlm.inference.exits.track import ExitTrack, at_cap

GATE = make_exit_criterion("gate")  # a chunk reads the gate against each row's own threshold (`thresholds`)


@dataclass
class PromptChunk:
    """Prompt tokens start .. start + n - 1 of requests admitted together (right-padded to n). A pad
    writes cache entries past its prompt that the row's own tokens overwrite later; no real token
    attends to it."""

    requests: list[Any]  # the runner's rows (`RowState`: prompt, row, config, criterion); none: every row
    start: int
    lengths: list[int]  # each request's tokens in this chunk
    cap: int  # prefill iterations
    budget: int  # core cache slots the requests cycle through
    state: Tensor  # [g, n, h]
    embedded: Tensor
    call: Call  # RoPE [1, n, 1, d/2], mask [1, 1, n, start + n], the requests' rows
    iteration: int = 0
    gate: ExitTrack | None = None  # a learned gate's track over the [g, n] tokens (exit_state: the chosen)
    thresholds: Tensor | None = None  # [g, 1]: the gate's threshold, or one it never reaches
    minimum: Tensor | None = None  # [g, 1]: the requests' min_steps, with a gate

    @classmethod
    def begin(
        cls, calls: ModelCalls, requests: list[Any], start: int, lengths: list[int], cap: int, budget: int
    ) -> PromptChunk:
        """The prelude and s_0 of the requests' next chunk of prompt, `lengths[j]` tokens of request j from
        `start` (the scheduler sized them: rdlm.inference.scheduling.scheduler). Marks the chunk's tokens valid
        (`ModelCalls.admit`)."""
        device = calls.device
        lengths = list(lengths)
        g, n = len(requests), max(lengths)
        ids = calls.upload(
            [q.prompt[start : start + length] + [0] * (n - length) for q, length in zip(requests, lengths, strict=True)]
        )
        noise = torch.zeros(g, n, calls.model.config.hidden_size, dtype=calls.dtype, device=device)
        for j, (q, length) in enumerate(zip(requests, lengths, strict=True)):
            if q.noise is not None:
                noise[j, :length] = q.noise[start : start + length]
            calls.admit(start, length, q.row)
        call = calls.prompt(start, n, calls.upload([q.row for q in requests]), budget)
        e = calls.embed(ids, call)
        chunk = cls(requests, start, lengths, cap, budget, calls.start_state(e, noise), e, call)
        gated = [q.criterion is not None and q.criterion.uses_gate for q in requests]
        if any(gated):  # read out at each token's gate exit, as a block prefill (`block`) reads it
            never = 2.0  # a cumulative probability never reaches it: rows without a gate keep their last state
            chunk.thresholds = calls.upload(
                [q.criterion.threshold if gate else never for q, gate in zip(requests, gated, strict=True)]
            ).view(-1, 1)
            chunk.minimum = calls.upload([q.config.min_steps for q in requests]).view(-1, 1)
            chunk.gate = chunk._gate_track()
        return chunk

    @classmethod
    def block(
        cls,
        calls: ModelCalls,
        call: Call,
        embedded: Tensor,
        cap: int,
        criterion: ExitCriterion | None = None,
        min_steps: int = 0,
    ) -> PromptChunk:
        """Tokens of every row of the runner's batch at once (a left-padded prompt, or a block appended
        after it: `rdlm.integrations.hf.sequences.Sequences`), their prelude run (`embedded`) and `call` from
        `ModelCalls.block`; s_0 from the runner's noise table. A learned gate `criterion` reads each
        token out at its exit."""
        state = calls.initial_state(embedded, call.positions)
        rows, n = state.shape[0], state.shape[1]
        assert isinstance(call.start, int)  # (a block starts at one buffer index for every row)
        chunk = cls([], call.start, [n] * rows, cap, calls.cache.num_slots, state, embedded, call)
        if criterion is not None and criterion.uses_gate:
            device = calls.device
            chunk.thresholds = torch.full((rows, 1), criterion.threshold, device=device)
            chunk.minimum = torch.full((rows, 1), min_steps, device=device)
            chunk.gate = chunk._gate_track()
        return chunk

    def _gate_track(self) -> ExitTrack:
        """No gate reading yet over the chunk's [g, n] tokens; the chosen state starts at s_0."""
        track = ExitTrack.start(self.state.shape[:2], self.state.device, gate=True)
        return dataclasses.replace(track, exit_state=self.state)

    def run(self, calls: ModelCalls) -> tuple[Tensor, Tensor]:
        """Every iteration of the chunk, one call each (nothing else in the call), then `finish`."""
        while not self.iterated:
            self.advance(calls, calls.iterate_once(self.state, self.embedded, self.iteration, self.call))
        return self.finish(calls)

    @property
    def n(self) -> int:
        return self.state.shape[1]

    @property
    def iterated(self) -> bool:
        """Whether the chunk ran all its iterations (its coda comes next)."""
        return at_cap(self.iteration, self.cap)

    def pack(self, pack: Pack) -> slice:
        """Add its next core iteration to a packed call; returns its tokens there."""
        return pack.add(self.call, self.state, self.embedded, self.iteration)

    def advance(self, calls: ModelCalls, state: Tensor) -> None:
        """Take the state of the iteration just run ([1, g * n, h]); a learned gate keeps, per token, the
        state where it first fired."""
        previous, self.state = self.state, state.view(self.state.shape)
        self.iteration += 1
        if self.gate is None:
            return
        assert self.minimum is not None  # (set with the gate)
        self.gate = self.gate.after_iteration(
            GATE,
            self.iteration - 1,
            self.cap,
            previous,
            self.state,
            min_steps=self.minimum,
            gate=calls.exit_probability,
            threshold=self.thresholds,
        )

    def finish(self, calls: ModelCalls, head: bool = True) -> tuple[Tensor, Tensor]:
        """The coda over the chunk's tokens once it ran its iterations: (final states, logits), [g, n, .]; with
        `head` False, the coda's outputs instead of the logits (the caller reads out the tokens it needs)."""
        if not self.requests:  # a block of every row (`block`)
            calls.cache.fill_missing(self.cap, self.start, self.start + self.n)
        for q, length in zip(self.requests, self.lengths, strict=False):  # (a block of every row: no requests)
            calls.cache.fill_missing(self.cap, self.start, self.start + length, row=q.row, slots=self.budget)
        state = self.state if self.gate is None or self.gate.exit_state is None else self.gate.exit_state
        return state, calls.readout(state, self.call) if head else calls.coda_output(state, self.call)

    def select(self, keep: list[int]) -> PromptChunk:
        """The chunk of the requests at positions `keep` only."""
        pick = torch.tensor(keep, device=self.state.device)
        assert isinstance(self.call.rows, Tensor)  # (a chunk of requests names their rows)
        gate = None if self.gate is None else self.gate.select(pick)
        return dataclasses.replace(
            self,
            requests=[self.requests[j] for j in keep],
            lengths=[self.lengths[j] for j in keep],
            state=self.state[pick],
            embedded=self.embedded[pick],
            call=self.call.keep_rows(pick, self.call.rows[pick]),
            gate=gate,
            thresholds=None if self.thresholds is None else self.thresholds[pick],
            minimum=None if self.minimum is None else self.minimum[pick],
        )
