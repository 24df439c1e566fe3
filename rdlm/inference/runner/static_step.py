"""The continuous batch's rows on the device (`RowTensors`) and their static step (`StaticStep`): n core
iterations of the decoding rows as one fixed-shape call over every row of the batch, whose per-row buffer
index, core slot and writers are device tensors, so the call is the same at every step and CUDA captures it
once per n (rdlm.inference.execution.graphs). The step runner (rdlm.inference.runner.step_runner) takes this path
where the engine's `static` setting is on (by default on CUDA).

Compiled on the CPU (rdlm.inference.execution.cpu_compile), the rest of a token runs the same way: its prelude
(`prelude`: the rows whose token starts write their entries) and its coda and head (`readout`: the rows whose
token ends), each one compiled call over the batch's first rows. Eager, at batch 1 on the `small` preset, the
prelude and the coda with the head took 2.5 of a token's 5.3 ms at r = 4, against 2.3 ms for its four
compiled core iterations (docs/generation.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rdlm.inference.execution.cpu_compile import (
    Compiled,
    compiled_iteration,
    compiled_parts,
    cpu_compiled,
    weights_stamp,
)
from rdlm.inference.execution.graphs import StaticSteps
from rdlm.inference.execution.model_calls import Call, ModelCalls
from rdlm.inference.exits.track import done_iterating
from rdlm.inference.runner.row_exits import STATE_ONLY, RowExits

# The compiled step (the CPU's) computes the batch's first rows up to the last decoding one (a power of two) and
# reads their keys up to the last one's end (rounded up to a multiple of KEYS_STEP), two sizes it takes as the
# lengths of views of a tensor (`span`, `keys`), compiled as dynamic sizes: one compile for every count and length
# (and one for a lone row, which the compiler specializes, where the engine compiles it ahead: `warm_up`). On the
# `small` preset at max_batch 8 with one request decoding, reading the whole buffer (512 entries) over every row ran
# 8x slower than a batch of one (measured on two cores; docs/generation.md).
KEYS_STEP = 32


@dataclass
class RowTensors:
    """Each row's token in progress, on the device: its latent state and prelude output [b, 1, h], its
    iterations run, cap and min_steps, whether it stopped iterating (exited or at its cap: frozen until the
    host looks), the tokens its request has seen [b, V] (the repetition penalty), its buffer index and core
    cache budget, and the token itself [b, 1] (the compiled prelude reads it)."""

    state: Tensor
    embedded: Tensor
    iterations: Tensor
    cap: Tensor
    min_steps: Tensor
    stopped: Tensor
    seen: Tensor
    write_index: Tensor
    budget: Tensor
    token: Tensor

    @classmethod
    def zeros(cls, calls: ModelCalls, max_batch: int) -> RowTensors:
        c, device = calls.model.config, calls.device
        state = torch.zeros(max_batch, 1, c.hidden_size, dtype=calls.dtype, device=device)

        def longs() -> Tensor:
            return torch.zeros(max_batch, dtype=torch.long, device=device)

        return cls(
            state,
            torch.zeros_like(state),
            longs(),
            longs(),
            longs(),
            torch.zeros(max_batch, dtype=torch.bool, device=device),
            torch.zeros(max_batch, c.vocab_size, dtype=torch.bool, device=device),
            longs(),
            longs() + 1,
            longs().view(-1, 1),
        )


class StaticStep:
    """The decoding rows' static step over `rows` (see the module doc); `on`: the engine takes it. Holds its
    graph cache (`steps`) and which rows decode in it (`decoding`, a device mask read in place)."""

    def __init__(self, calls: ModelCalls, rows: RowTensors, exits: RowExits, max_batch: int, on: bool) -> None:
        self.calls, self.rows, self.exits, self.max_batch = calls, rows, exits, max_batch
        self.steps = StaticSteps(calls.device, on, shared_pool=True)
        self.decoding = torch.zeros_like(rows.stopped)
        self.starting, self.ending = torch.zeros_like(rows.stopped), torch.zeros_like(rows.stopped)  # (`prelude`, ...)
        self._marked: dict[int, tuple[int, ...]] = {}  # the rows each of these masks marks, by id(mask)
        self.fused_iterations = 0  # core iterations run several to a call
        # compiled on the CPU (rdlm.inference.execution.cpu_compile); captured on CUDA
        self.compiled = compiled_iteration(self, calls.model) if cpu_compiled(on, calls.device, calls.model) else None
        # the prelude and the coda with the head, compiled beside the core iteration (None: eager, by the caller)
        self.ends: tuple[Compiled, Compiled] | None = None if self.compiled is None else compiled_parts(self)
        self._keys = torch.empty(calls.key_valid.shape[1], dtype=torch.bool, device=calls.device)  # (`keys`)
        self._span = torch.empty(max_batch, dtype=torch.bool, device=calls.device)  # (`span`)
        self._lone_row = max_batch == 1  # whether a lone row runs its own (specialized) compiled code

    @property
    def on(self) -> bool:
        return self.steps.static

    def mark_decoding(self, rows: list[int]) -> None:
        """`decoding`: these rows of the batch (copied to the device when they changed)."""
        self._mark(self.decoding, rows)

    def _mark(self, mask: Tensor, rows: list[int]) -> None:
        """`mask`: these rows of the batch, copied to the device when they changed."""
        marked = tuple(rows)
        if self._marked.get(id(mask)) != marked:
            self._marked[id(mask)] = marked
            mask.copy_(self.calls.upload([b in marked for b in range(self.max_batch)]))

    def refresh(self) -> None:
        """Compiled on the CPU: the compiled calls take the model's weights as they are now (a step's first act:
        weights change between steps; `Compiled.refresh`)."""
        if self.compiled is not None and self.ends is not None:
            stamp = weights_stamp(self.calls.model)
            for part in (self.compiled, *self.ends):
                part.refresh(stamp)
            if self.calls.compiled_prompts is not None:
                self.calls.compiled_prompts.refresh(stamp)

    def prelude(self, rows: list[int], end: int) -> None:
        """Compiled on the CPU: the prelude of the tokens in `rows.token` of `rows` (at their buffer index, the
        last of them `end` - 1), its output into `rows.embedded`; the other rows keep theirs and write nothing."""
        assert self.ends is not None
        self._mark(self.starting, rows)
        span = self.span(max(rows) + 1)
        self.rows.embedded[: span.shape[0]].copy_(self.ends[0](self.keys(end), span))

    def readout(self, rows: list[int], end: int) -> Tensor:
        """Compiled on the CPU: the coda and the head over the final states of `rows` (their buffer indices below
        `end`), the other rows writing nothing: float32 logits of the batch's first rows [k, V] (k > max(rows))."""
        assert self.ends is not None
        self._mark(self.ending, rows)
        return self.ends[1](self.keys(end), self.span(max(rows) + 1))

    def run(self, rows: list[int], n: int, end: int | None = None) -> None:
        """n core iterations of the decoding `rows` as one fixed-shape call over all `max_batch` rows (CUDA
        captures it once per n; compiled on the CPU, the call computes the rows up to the last decoding one and
        reads their keys up to `end`, their largest buffer index + 1). A row that is not decoding (free,
        prefilling its prompt or waiting for its coda) or has stopped keeps its state and writes nothing; each
        iteration updates the rows' counts, reads the state-only exit criteria (`RowExits.read`) and
        updates the stopped flags on the device (`done_iterating`), so a row that exits inside the call is frozen
        there."""
        self.mark_decoding(rows)
        keys = None if self.compiled is None or end is None else self.keys(end)
        span = None if keys is None else self.span(max(rows) + 1)  # (`iteration`)
        key = ("core iterations", n, self.exits.in_step)  # (a graph reads the criteria of the rows admitted so far)
        self.steps.run(key, lambda: self.iterations(n, keys, span), idempotent=False)
        if n > 1:
            self.fused_iterations += n

    def warm_up(self) -> float:
        """Compile the CPU's compiled iteration now (a call with no row decoding changes nothing: every row
        keeps its state and its cache entries), for several rows and for a lone one; the seconds it took."""
        if self.compiled is None or self.ends is None:
            return 0.0
        for mask in (self.decoding, self.starting, self.ending):
            self._mark(mask, [])
        before = self.compile_seconds
        for rows in (self.max_batch, 1):
            if rows == 1:
                self._lone_row = True
            self.compiled(self.keys(1), self.span(rows))
            self.rows.embedded[:rows].copy_(self.ends[0](self.keys(1), self.span(rows)))
            self.ends[1](self.keys(1), self.span(rows))
        return self.compile_seconds - before

    @property
    def compile_seconds(self) -> float:
        """The time spent compiling (CPU), 0.0 where nothing is compiled."""
        parts = () if self.compiled is None or self.ends is None else (self.compiled, *self.ends)
        return sum(part.seconds for part in parts)

    def span(self, rows: int) -> Tensor:
        """A view whose length is the rows the compiled step computes for `rows` rows: a power of two, at most
        the batch, at least two unless a lone row has its own compiled code (a size of 1 is specialized by the
        compiler: running it first would compile again for the next count)."""
        length = min(1 << (rows - 1).bit_length(), self.max_batch)
        return _dynamic(self._span, length if self._lone_row else max(length, min(2, self.max_batch)))

    def keys(self, end: int) -> Tensor:
        """A view whose length is the buffer entries the compiled step reads for rows that end at `end`: rounded
        up to KEYS_STEP, at most the buffer."""
        return _dynamic(self._keys, -(-end // KEYS_STEP) * KEYS_STEP)

    def iteration(
        self, keys: Tensor | None = None, span: Tensor | None = None
    ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """The static body of one iteration: (the new state of the batch's first rows, those of them that
        iterated: decoding, not stopped, and the exit readings of their state-only criteria: the rows' new
        streaks and exited flags, `RowExits.read`; None where no row has one). `keys`: a tensor whose length is the
        buffer entries read (every decoding row's index below it; None: the whole buffer); `span`: one whose
        length is the rows computed (every decoding row below it; None: all of them). Compiled, it reads every
        state-only criterion whether a row has it or not (a few elementwise ops in the compiled code), so the
        first request with one compiles nothing new."""
        t = self.rows
        k = t.state.shape[0] if span is None else span.shape[0]
        first = lambda x: x.narrow(0, 0, k)  # noqa: E731  (narrow, not a slice: k may be every row)
        writers = first(self.decoding) & ~first(t.stopped)
        end = None if keys is None else keys.shape[0]
        call = self.calls.every_row(first(t.write_index), first(t.iterations) % first(t.budget), writers, end)
        out = self.calls.iterate_once(first(t.state), first(t.embedded), 0, call)
        state = torch.where(writers.view(-1, 1, 1), out, first(t.state))
        names = STATE_ONLY if self.compiled is not None else self.exits.in_step
        iterations = first(t.iterations) + writers.long()  # (counted by the caller)
        read = self.exits.read(names, first(t.state), state, writers, iterations, first(t.cap), first(t.min_steps))
        return state, writers, read

    def prelude_body(self, keys: Tensor, span: Tensor) -> Tensor:
        """The static body of the prelude (compiled: `prelude`): the new `embedded` of the batch's first rows
        (`iteration` says what `keys` and `span` are), the rows marked `starting` computed from their token."""
        writers, call = self._writing(self.starting, keys, span)
        first = lambda x: x.narrow(0, 0, writers.shape[0])  # noqa: E731
        embedded = self.calls.embed(first(self.rows.token), call)
        return torch.where(writers.view(-1, 1, 1), embedded, first(self.rows.embedded))

    def readout_body(self, keys: Tensor, span: Tensor) -> Tensor:
        """The static body of the coda and the head (compiled: `readout`): the logits [k, V] of the batch's first
        rows, the rows marked `ending` writing their coda entries."""
        writers, call = self._writing(self.ending, keys, span)
        return self.calls.readout(self.rows.state.narrow(0, 0, writers.shape[0]), call)[:, -1]

    def _writing(self, mask: Tensor, keys: Tensor, span: Tensor) -> tuple[Tensor, Call]:
        """(the rows of `mask` among the batch's first rows, a call of those rows at their buffer indices in which
        only they write cache entries) for the prelude or the coda."""
        k = span.shape[0]
        writers = mask.narrow(0, 0, k)
        return writers, self.calls.every_row(self.rows.write_index.narrow(0, 0, k), None, writers, keys.shape[0])

    def iterations(self, n: int, keys: Tensor | None = None, span: Tensor | None = None) -> tuple:
        t = self.rows
        iteration = self.iteration if self.compiled is None else self.compiled
        for _ in range(n):
            state, writers, read = iteration() if keys is None or span is None else iteration(keys, span)
            k = writers.shape[0]
            t.state[:k].copy_(state)
            t.iterations[:k] += writers.long()
            if read is not None and self.exits.in_step:  # (compiled, it reads them whether any row has one)
                self.exits.streak[:k].copy_(read[0])
                self.exits.exited[:k].copy_(read[1])
            t.stopped |= self.decoding & done_iterating(self.exits.exited, t.iterations, t.cap, self.exits.runs_on)
        return ()


def _dynamic(whole: Tensor, length: int) -> Tensor:
    """The first `length` entries of `whole` (at most all), their length marked dynamic to the compiler where it
    can vary: the compiler specializes a length of 1, and a dynamic length lies in [2, whole's length], a single
    value when that is 2."""
    view = whole[:length]
    if view.shape[0] > 1 and whole.shape[0] > 2:
        torch._dynamo.mark_dynamic(view, 0)
    return view
