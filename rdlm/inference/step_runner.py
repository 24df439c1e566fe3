"""The continuous batch's step runner: carries out each step's plan (rdlm.inference.scheduler.StepPlan) on
the model, and holds every tensor of the batch's rows (rdlm.inference.batching, whose module doc says what
a step does).

Per row of the batch, on the device: the latent state and the prelude's output of its token in progress,
its iterations run, cap and min_steps, whether it is done (exited or at its cap: frozen until the host
looks), the tokens it has seen (for the repetition penalty), its buffer index and core cache budget, and
its exit criterion's carry (`RowExits`). Besides the rows: the prompt chunks being prefilled
(rdlm.inference.prefill) and the static steps (rdlm.inference.graphs).

A plan's core iterations run one of three ways, each one place here:

- `_static`: n iterations (1, or a power of two fused) as one fixed-shape call over all `max_batch` rows,
  whose per-row index, slot and writers are device tensors (the same call at every step: CUDA captures it
  once per n);
- `_eager`: one iteration in a call over the computing rows alone, packed with the prompt chunks'
  iteration when any are in flight (`_prompts`: the chunks' iteration alone, the same packed call);
- `_lockstep`: a token's r iterations at once (rdlm.inference.lockstep: fixed, adaptive, gate-exact), as
  static steps or over the rows' slice.

The exit criteria are evaluated after a plan's single iteration (`RowExits`); a lockstep token decides
them inside its iterations; fused iterations have none to decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rdlm.checks import is_int
from rdlm.inference.graphs import PhaseTimes, StaticSteps
from rdlm.inference.lockstep import Lockstep, Rows
from rdlm.inference.parallel import ParallelSampler
from rdlm.inference.prefill import PromptChunk
from rdlm.inference.request import Request
from rdlm.inference.row_exits import RowExits
from rdlm.inference.runner import Call, ModelRunner, Pack
from rdlm.inference.sampling import NonFiniteLogitsError
from rdlm.inference.scheduler import Prompts, StepPlan
from rdlm.inference.speculative import speculate
from rdlm.model.lm import RecurrentDepthLM


@dataclass
class Round:
    """A request's round (`StepPlan.rounds`): the tokens that became final, each with the iterations run at the
    position that chose it; a speculative round's drafts and accepted drafts; whether a parallel sampler's
    wave ran out of room (the request can give no more tokens)."""
    request: Request
    tokens: list[tuple[int, int]]
    drafted: int = 0
    accepted: int = 0
    exhausted: bool = False


@dataclass
class StepOutput:
    """What carrying out a plan gives back to the batch: a lockstep token's iterations per request, the rounds
    run, and the requests a round failed with its error."""
    steps: list[int] | None = None
    rounds: list[Round] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


class StepRunner:
    """The rows of a batch of `max_batch` rows over one `ModelRunner` and its cache (see the module doc).
    `static`: the decoding rows' iterations run as static steps (`_static`); `prefill_chunk`: a prompt
    chunk's tokens; `phases`: where the step's phases are timed."""

    def __init__(self, model: RecurrentDepthLM, max_batch: int, max_length: int, num_slots: int, static: bool,
                 prefill_chunk: int, phases: PhaseTimes) -> None:
        c = model.config
        self.model, self.max_batch, self.prefill_chunk, self.phases = model, max_batch, prefill_chunk, phases
        self.runner = ModelRunner(model, max_batch, max_length, num_slots, "full")
        self.device, self.dtype, self.cache = self.runner.device, self.runner.dtype, self.runner.cache
        self.chunks: list[PromptChunk] = []   # prompts being prefilled
        self.state = torch.zeros(max_batch, 1, c.hidden_size, dtype=self.dtype, device=self.device)
        self.embedded = torch.zeros_like(self.state)
        self.exits = RowExits(self.runner, max_batch, c.vocab_size, self.state)  # the criteria's per-row carry
        # Each row's token in progress: iterations run, done (exited or at its cap: frozen until the host
        # looks), its cap and min_steps; the tokens it has seen.
        long = dict(dtype=torch.long, device=self.device)
        self.steps, self.cap = torch.zeros(max_batch, **long), torch.zeros(max_batch, **long)
        self.min_steps = torch.zeros(max_batch, **long)
        self.done = torch.zeros(max_batch, dtype=torch.bool, device=self.device)
        self.seen = torch.zeros(max_batch, c.vocab_size, dtype=torch.bool, device=self.device)
        # The static step's inputs, read in place by a captured step: each row's buffer index, core cache
        # budget and whether it decodes in this step.
        self.static_steps = StaticSteps(self.device, static, shared_pool=True)
        self.write_index, self.budget = torch.zeros(max_batch, **long), torch.ones(max_batch, **long)
        self.decoding = torch.zeros_like(self.done)
        self._decoding_rows: tuple[int, ...] = ()  # the rows `decoding` marks
        self.fused_iterations = 0             # core iterations run several to a call
        self.lockstep = Lockstep(self.runner, static)
        self.waves: dict[int, ParallelSampler] = {}   # the parallel sampler's requests (by id): their wavefronts
        self.core_passes = self.wave_steps = 0        # the waves' core calls and steps, all requests together
        self._last_inputs: tuple | None = None  # (rows and lengths, their inputs): reused while unchanged

    @property
    def static(self) -> bool:
        return self.static_steps.static

    @property
    def capture_seconds(self) -> float:
        return self.static_steps.capture_seconds + self.lockstep.static_steps.capture_seconds

    def prompts(self) -> Prompts | None:
        """The prompt chunks in flight as the scheduler weighs them, or None."""
        if not self.chunks:
            return None
        return Prompts(sum(c.state.shape[0] * c.n for c in self.chunks), min(c.cap - c.iteration for c in self.chunks))

    # ---- rows in and out

    def admit(self, groups: dict[tuple[int, int], list[Request]]) -> None:
        """Requests admitted into their rows (`Scheduler.admit`'s groups): their rows forget what they held and
        each group's prompts start prefilling as one chunk."""
        for q in (q for group in groups.values() for q in group):
            self.runner.rewind(0, q.row)
            self.seen[q.row] = False
            self.seen[q.row, self.runner.upload(q.prompt)] = True
        for (cap, budget), group in groups.items():
            self._begin_chunk(group, 0, cap, budget)

    def drop(self, dropped: set[int]) -> None:
        """Cancelled requests' prompts stop being prefilled and their waves go (their rows are the scheduler's
        to free)."""
        for request in dropped:
            self.waves.pop(request, None)
        for chunk in list(self.chunks) if dropped else ():
            keep = [j for j, q in enumerate(chunk.requests) if q.id not in dropped]
            if len(keep) < len(chunk.requests):
                self.chunks.remove(chunk)
                if keep:
                    self.chunks.append(chunk.select(keep))

    def clear(self, row: int) -> None:
        """Wipe a failed request's row: a NaN left in its cache would reach the row's next request through the
        attention's masked (zero-weight) entries."""
        self.cache.clear_rows(row)
        self.state[row] = 0

    def _begin_chunk(self, requests: list[Request], start: int, cap: int, budget: int) -> None:
        self.chunks.append(PromptChunk.begin(self.runner, requests, start, cap, budget, self.prefill_chunk))

    def end_prompts(self) -> list[tuple[list[Request], Tensor, int]]:
        """Chunks that ran their iterations: the coda over their tokens, then each prompt's next chunk, or, for
        a prompt whose last chunk this was, the logits of its last token (its row's state set to that
        token's). Returns (those requests, their logits [n, V], the iterations they ran) per chunk."""
        ended_chunks = []
        for chunk in [c for c in self.chunks if c.done]:
            self.chunks.remove(chunk)
            state, logits = chunk.finish(self.runner)
            going_on, ended, last = [], [], []
            for j, (q, length) in enumerate(zip(chunk.requests, chunk.lengths)):
                if chunk.start + length < len(q.prompt):
                    going_on.append(q)
                    continue
                ended.append(q)
                last.append(j * chunk.n + length - 1)  # the prompt's last token, in the chunk's [g * n]
            if ended:
                index = self.runner.upload(last)
                self.state[self.runner.upload([q.row for q in ended])] = state.flatten(0, 1)[index].unsqueeze(1)
                ended_chunks.append((ended, logits.flatten(0, 1)[index], chunk.cap))
            self._last_inputs = None
            if going_on:  # they ran n tokens each
                self._begin_chunk(going_on, chunk.start + chunk.n, chunk.cap, chunk.budget)
        return ended_chunks

    def _inputs(self, requests: list[Request]) -> tuple[Tensor, Call]:
        """(rows, call) of the token in progress of each request (`ModelRunner.tokens`: the call's rows are
        a slice where they are consecutive, its start their write indices)."""
        key = tuple((q.row, q.length) for q in requests)
        if self._last_inputs is not None and self._last_inputs[0] == key:  # unchanged since the last step
            return self._last_inputs[1]
        inputs = self.runner.tokens([q.row for q in requests], [q.length for q in requests])
        self._last_inputs = (key, inputs)
        return inputs

    # ---- a token's start and end

    def start(self, requests: list[Request]) -> list[tuple[Request, Exception]]:
        """Feed each request's chosen token (`next_token`): prelude and s_0 of its next position, and its row's
        count, cap (the scheduler's `start` set it), min_steps and budget. Returns the requests whose values
        the rows' tensors cannot hold, each with its error: they fail alone, before any row is touched."""
        limits, failed = self._limits(requests)
        if failed:
            requests = [q for q in requests if all(q is not f for f, _ in failed)]
            if not requests:
                return failed
            limits = self._limits(requests)[0]
        lengths = self.runner.upload([q.length for q in requests])
        self.runner.admit(lengths, rows=self.runner.upload([q.row for q in requests]))
        self._last_inputs = None  # the mask changed
        rows, call = self._inputs(requests)
        select = call.rows
        self.seen[rows, self.runner.upload([q.next_token for q in requests])] = True
        ids = self.runner.upload([[q.next_token] for q in requests])
        self.embedded[select] = self.runner.embed(ids, call)
        fresh = [q for q in requests if not q.config.continuous_cot]  # else s_0 is the last final state, kept
        if fresh:
            at = self.runner.upload([q.row for q in fresh])
            drawn = [None if q.noise is None else q.noise[q.length] for q in fresh]
            noise = None if all(d is None for d in drawn) else torch.stack(
                [torch.zeros_like(self.state[0, 0]) if d is None else d for d in drawn]).unsqueeze(1)
            self.state[at] = self.runner.start_state(self.embedded[at], noise)
        self.cap[select], self.min_steps[select], self.budget[select] = limits.unbind(1)
        self.write_index[select] = lengths
        self.steps[select], self.done[select] = 0, False
        self.exits.reset(select)
        return failed

    def _limits(self, requests: list[Request]) -> tuple[Tensor | None, list[tuple[Request, Exception]]]:
        """Each request's cap, min_steps and budget as a row of a long tensor on the device; where one does not
        fit a long (the declared bounds keep every value far inside it: this is the failure path of a value
        that escaped them), the requests at fault with the error, and no tensor."""
        values = [[q.cap, q.config.min_steps, q.budget] for q in requests]
        try:
            return self.runner.upload(values), []
        except (OverflowError, RuntimeError, TypeError, ValueError) as err:   # torch says "Overflow when unpacking"
            failed = [(q, err) for q, row in zip(requests, values) if not all(is_int(v, -2**63, 2**63) for v in row)]
            if not failed:
                raise
            return None, failed

    def look(self, requests: list[Request]) -> tuple[list[bool], list[int]]:
        """The host reads the exit flags (one read): whether each request's token is done, and its iterations."""
        select = self._inputs(requests)[1].rows
        finished, steps = torch.stack((self.done[select].long(), self.steps[select])).tolist()
        return [bool(f) for f in finished], steps

    def coda(self, requests: list[Request], lockstep: bool = False) -> Tensor:
        """The coda over the final states of rows whose token is done (`iteration` iterations run), together:
        their next-token logits [n, V]. A gate-exact row reads the state its gate chose (a lockstep token's
        state is that already)."""
        for q in requests:
            if not lockstep and q.criterion is not None and q.criterion.spec.exact:
                self.state[q.row] = self.exits.exit_state[q.row]  # what the readout (and continuous CoT) reads
            self.cache.fill_missing(q.iteration, q.length, q.length + 1, row=q.row, slots=q.budget)
        call = self._inputs(requests)[1]
        return self.runner.readout(self.state[call.rows], call)[:, -1]

    # ---- the plan's core iterations

    def run(self, plan: StepPlan) -> StepOutput:
        """Carry out the plan (see the module doc)."""
        output = StepOutput()
        for q in plan.rounds:
            with self.phases.timed("rounds"):
                try:
                    output.rounds.append(self._round(q))
                except NonFiniteLogitsError as err:   # the batch fails it alone (its wave goes with it)
                    output.failed.append((q, err))
        if plan.lockstep:
            with self.phases.timed("core iteration"):
                output.steps = self._lockstep(list(plan.computing))
            return output
        self._iterate(plan)
        return output

    def _round(self, q: Request) -> Round:
        """A request's round: a speculative one (rdlm.inference.speculative), or its wave's next step
        (rdlm.inference.parallel; the wave opens at the request's first round)."""
        if q.config.draft_steps is not None:
            tokens, drafted, accepted = speculate(self.runner, q)
            return Round(q, [(t, q.config.num_steps) for t in tokens], drafted, accepted)
        wave = self.waves.get(q.id)
        if wave is None:
            wave = self.waves[q.id] = ParallelSampler(self.runner, q)
        passes, steps = wave.core_passes, wave.wave_steps
        tokens = wave.step()
        self.core_passes += wave.core_passes - passes
        self.wave_steps += wave.wave_steps - steps
        return Round(q, tokens, exhausted=wave.exhausted)

    def end_round(self, q: Request) -> None:
        """A request that decodes in rounds left its row: its wave goes."""
        self.waves.pop(q.id, None)

    def _iterate(self, plan: StepPlan) -> None:
        """The plan's iterations of the computing rows and the prompt chunks, then the rows' exit decisions."""
        requests = list(plan.computing)
        if requests and plan.iterations > 1:  # fused (static) iterations: no exit criterion to read
            self._static(requests, plan.iterations)
        elif requests:
            rows, call = self._inputs(requests)
            select = call.rows
            running = ~self.done[select]
            prev_state = self.state[select].clone()  # `select` may be a view, overwritten below
            if self.static:
                self._static(requests, 1)
                if self.chunks:  # the prompts' iteration in a call of their own: the step keeps its graph
                    self._prompts(Pack())
                state = self.state[select]
            else:
                state = self._eager(plan, rows, call, prev_state)
        elif self.chunks:
            self._prompts(Pack())
        for _ in range(plan.prompt_iterations - 1):  # the prompts' share of the step beyond the first
            chunks = [c for c in self.chunks if not c.done]
            if chunks:
                self._prompts(Pack(), chunks)
        if not requests or plan.iterations > 1:
            return
        if not self.static:
            self.state[select] = state
            self.steps[select] += running.long()
        with self.phases.timed("exit evaluation"):
            self.exits.update(requests, rows, call, prev_state, state, running, self.steps, self.min_steps, self.done)
            self.done[select] |= self.steps[select] >= self.cap[select]

    def _static(self, requests: list[Request], n: int) -> None:
        """n core iterations of the decoding rows as one fixed-shape call over all `max_batch` rows, the same
        at every step (CUDA captures it once per n): each row's buffer index, core slot (iterations run,
        modulo its budget) and whether it writes are device tensors, not a plan built per step. A row that
        is not decoding (free, prefilling its prompt or waiting for its coda) or is done keeps its state
        and writes nothing; each iteration updates the rows' counts and done flags on the device."""
        self._mark_decoding(requests)
        with self.phases.timed("core iteration"):
            self.static_steps.run(("core iterations", n), lambda: self._core_static_iterations(n), idempotent=False)
        if n > 1:
            self.fused_iterations += n

    def _mark_decoding(self, requests: list[Request]) -> None:
        """`self.decoding`: the rows of `requests` (copied to the device when they changed)."""
        decoding = tuple(q.row for q in requests)
        if decoding != self._decoding_rows:
            self._decoding_rows = decoding
            self.decoding.copy_(self.runner.upload([b in decoding for b in range(self.max_batch)]))

    def _core_static(self) -> tuple[Tensor, Tensor]:
        """The static body of one iteration: (every row's new state, the rows that iterated: decoding, not done)."""
        writers = self.decoding & ~self.done
        call = self.runner.every_row(self.write_index, self.steps % self.budget, writers)
        out = self.runner.step(self.state, self.embedded, 0, call)
        return torch.where(writers.view(-1, 1, 1), out, self.state), writers

    def _core_static_iterations(self, n: int) -> tuple:
        for _ in range(n):
            state, writers = self._core_static()
            self.state.copy_(state)
            self.steps += writers.long()
            self.done |= self.decoding & (self.steps >= self.cap)
        return ()

    def _eager(self, plan: StepPlan, rows: Tensor, call: Call, prev_state: Tensor) -> Tensor:
        """The computing rows' core iteration in a call over them alone, packed with the prompt chunks' when
        there are any: their new states (a frozen row's kept)."""
        frozen = self.done[call.rows] if plan.may_be_frozen else None
        writers = None if frozen is None else ~frozen
        if len(set(plan.slots)) == 1:  # every row at the same slot: a plain call at that iteration
            core, iteration = call.but(core_writers=writers), plan.slots[0]
        else:
            core = call.but(rows=rows, slots=self.runner.upload(list(plan.slots)), core_writers=writers)
            iteration = 0
        embedded = self.embedded[call.rows]
        if not self.chunks:  # the decoding rows alone: a plain batched call
            with self.phases.timed("core iteration"):
                out = self.runner.step(prev_state, embedded, iteration, core)
        else:
            pack = Pack()
            pack.add(core, prev_state, embedded, iteration)
            out = self._prompts(pack)
        state = out.reshape(-1, 1, self.model.config.hidden_size)[:len(plan.computing)]
        return state if frozen is None else torch.where(frozen.view(-1, 1, 1), prev_state, state)

    def _prompts(self, pack: Pack, chunks: list[PromptChunk] | None = None) -> Tensor:
        """One core iteration of `pack` (the decoding rows' part, or nothing) and of the prompt chunks (all in
        flight, or `chunks`), in one call (a plain one for a chunk alone, as a prefill of the whole batch
        runs: `PromptChunk.run`)."""
        chunks = self.chunks if chunks is None else chunks
        if not pack.segments and len(chunks) == 1:
            chunk = chunks[0]
            with self.phases.timed("core iteration"):
                out = self.runner.step(chunk.state, chunk.embedded, chunk.iteration, chunk.call)
            chunk.advance(self.runner, out)
            return out
        tokens = [c.pack(pack) for c in chunks]
        with self.phases.timed("core iteration"):
            out = self.runner.step_packed(pack)
        for c, part in zip(chunks, tokens):
            c.advance(self.runner, out[:, part])
        return out

    def _lockstep(self, requests: list[Request]) -> list[int]:
        """The token the requests started together, in lockstep (rdlm.inference.lockstep): all its core
        iterations; the iterations each request ran. On the static path over every row of the batch, the
        rows not decoding frozen; eagerly over the rows that `_eager_rows` gives."""
        first = requests[0]
        config, criterion, budget = first.config, first.criterion, first.budget
        vocab = self.model.config.vocab_size
        if self.static:
            self._mark_decoding(requests)
            every_row = lambda: self.runner.all_rows(self.write_index, budget, self.decoding)  # noqa: E731
            if criterion is None:
                self.state.copy_(self.lockstep.fixed(config, self.state, self.embedded, every_row))
                return [config.num_steps] * len(requests)
            final, per_row = self.lockstep.adaptive(config, criterion, lambda: Rows.start(
                self.runner.batch_rows, self.state, self.embedded, every_row(), ~self.decoding, criterion, vocab),
                self.max_batch - len(requests))
            self.state.copy_(final)
            return per_row[self._inputs(requests)[0]].tolist()
        span, rows, call, places, idle = self._eager_rows(requests, budget)
        if criterion is None:
            out = self.lockstep.fixed(config, self.state[span], self.embedded[span], lambda: call)
            self.state[span] = out if idle is None else torch.where(idle.view(-1, 1, 1), self.state[span], out)
            return [config.num_steps] * len(requests)
        frozen = torch.zeros(len(rows), dtype=torch.bool, device=self.device) if idle is None else idle
        final, per_row = self.lockstep.adaptive(config, criterion, lambda: Rows.start(
            rows, self.state[span], self.embedded[span], call, frozen, criterion, vocab), len(rows) - len(requests))
        self.state[span] = final
        return per_row[places].tolist()

    def _eager_rows(self, requests: list[Request], budget: int) -> tuple[slice | Tensor, Tensor, Call,
                                                                         Tensor | slice, Tensor | None]:
        """The rows an eager lockstep token runs over: the requests' rows; or, when a few rows between them are
        not decoding (freed by requests that finished), the slice that spans them, the rows between riding
        along frozen and writing nothing: a slice reads the cache as views, where a gather of the rows copies
        it at every layer. With more rows between than decoding, the gather costs less than computing them.
        (rows of the batch as a slice or index, their batch rows, their call, the requests' places among them,
        the rows between as a mask or None.)"""
        numbers = [q.row for q in requests]
        span = slice(numbers[0], numbers[-1] + 1)
        if len(numbers) == span.stop - span.start or span.stop - span.start > 2 * len(numbers):
            rows, call = self._inputs(requests)
            return call.rows, rows, call.but(budget=budget), slice(None), None
        index = {q.row: q.length for q in requests}
        every = range(span.start, span.stop)
        rows, call = self.runner.tokens(list(every), [index.get(b, 0) for b in every])
        idle = self.runner.upload([b not in index for b in every])
        places = self.runner.upload([b - span.start for b in numbers])
        return span, rows, call.but(budget=budget, core_writers=~idle), places, idle
