"""The continuous batch's step runner: carries out each step's plan (rdlm.inference.scheduling.plan.StepPlan) on the
model and gives back what it found (`StepOutput`); it holds every tensor of the batch's rows
(rdlm.inference.batching, whose module doc says what a step does) and its own record of each request in them
(`RowState`, filled from the plan when the request is admitted): it never reads a scheduler's `Request`.

Per row of the batch, on the device: the latent state and the prelude's output of its token in progress,
its iterations run, cap and min_steps, whether it stopped iterating (exited or at its cap: frozen until the
host looks), the tokens it has seen (for the repetition penalty), its buffer index and core cache budget,
and its exit criterion's carry (`RowExits`). Besides the rows: the prompt chunks being prefilled
(rdlm.inference.runner.prefill), the rounds' waves (rdlm.inference.runner.rounds) and the static steps
(rdlm.inference.execution.graphs).

A plan's core iterations run one of three ways, each one place here:

- `_static`: n iterations (1, or a power of two fused) as one fixed-shape call over all `max_batch` rows,
  whose per-row index, slot and writers are device tensors (the same call at every step: CUDA captures it
  once per n);
- `_eager`: one iteration in a call over the computing rows alone, packed with the prompt chunks'
  iteration when any are in flight (`_prompts`: the chunks' iteration alone, the same packed call);
- `_lockstep`: a token's r iterations at once (rdlm.inference.runner.lockstep: fixed, adaptive, gate-exact), as
  static steps or over the rows' slice.

The exit criteria are evaluated after a plan's single iteration (`RowExits`); a lockstep token decides
them inside its iterations; the static step reads the state-only criteria (latent-diff, cosine) itself after
each iteration it runs, so fused iterations may hold such rows (`RowExits.read`). The codas (a lockstep
token's, the prompts', and the done rows' that the scheduler finds due after the step: `coda`) choose the
next tokens here (`choose_rows`): the scheduler learns them, and what the look found, from the output alone. Every
decision of what runs (looks, codas, prompt ends, caps, cancellations) is the plan's: the runner carries it
out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rdlm.inference.execution.cpu_compile import CompiledPrompts
from rdlm.inference.execution.graphs import PhaseTimes
from rdlm.inference.execution.model_calls import Call, ModelCalls, Pack
from rdlm.inference.exits.track import at_cap, done_iterating
from rdlm.inference.runner.lockstep import Lockstep, Rows
from rdlm.inference.runner.prefill import PromptChunk
from rdlm.inference.runner.rounds import Rounds
from rdlm.inference.runner.row_exits import RowExits
from rdlm.inference.runner.row_state import RowState
from rdlm.inference.runner.sampling import NonFiniteLogitsError, choose_rows
from rdlm.inference.runner.static_step import RowTensors, StaticStep
from rdlm.inference.scheduling.plan import (
    Admission,
    Chosen,
    ChunkSpec,
    Done,
    EngineSettings,
    Iterating,
    Start,
    StepOutput,
    StepPlan,
)
from rdlm.model.lm import RecurrentDepthLM


class StepRunner:
    """The rows of a batch over one `ModelCalls` and its cache, by `settings` (see the module doc); `phases`:
    where the step's phases are timed."""

    def __init__(self, model: RecurrentDepthLM, settings: EngineSettings, phases: PhaseTimes) -> None:
        c, max_batch = model.config, settings.max_batch
        self.model, self.settings, self.phases = model, settings, phases
        self.max_batch = max_batch
        self.calls = ModelCalls(model, max_batch, settings.max_length, settings.num_slots, "full")
        self.device, self.dtype, self.cache = self.calls.device, self.calls.dtype, self.calls.cache
        self.rows: dict[int, RowState] = {}  # the requests in rows, by request id (the runner's own copy)
        self.chunks: dict[int, PromptChunk] = {}  # prompts being prefilled, by chunk id
        self.specs: dict[int, ChunkSpec] = {}  # ... and as the plan gave them (which prompts end there)
        self.t = RowTensors.zeros(self.calls, max_batch)  # the rows' tensors
        self.exits = RowExits(self.calls, max_batch, c.vocab_size, self.t.state)  # the criteria's per-row carry
        self.static_step = StaticStep(self.calls, self.t, self.exits, max_batch, settings.static)
        if self.static_step.compiled is not None:  # the prompts' iterations compiled too (cpu_compile)
            self.calls.compiled_prompts = CompiledPrompts(model)
        self.lockstep = Lockstep(self.calls, settings.static, settings.exit_sync_every)
        self.rounds = Rounds(self.calls)  # the parallel sampler's waves
        self._last_inputs: tuple | None = None  # (rows and lengths, their inputs): reused while unchanged

    @property
    def static(self) -> bool:
        return self.static_step.on

    @property
    def capture_seconds(self) -> float:
        return (
            self.static_step.steps.capture_seconds
            + self.lockstep.static_steps.capture_seconds
            + self.static_step.compile_seconds
            + (0.0 if self.calls.compiled_prompts is None else self.calls.compiled_prompts.seconds)
        )

    def warm_up_prompts(self, threads: int = 1) -> float:
        """Compile the prompts' iteration now (`CompiledPrompts`; a no-op where it is not compiled): one iteration
        of a chunk of two tokens in row 0, and where the step runs on fewer than `threads` threads, calls of up to
        128 tokens on one thread and on `threads` to choose which calls run on more (`measure_threads`). They write
        core entries of the first rows (call it while no request holds a row: one admitted there writes its own
        entries before it reads them). The seconds it took."""
        compiled = self.calls.compiled_prompts
        if compiled is None:
            return 0.0
        start = time.perf_counter()
        self._prompt_call(1, 2)
        compiled.measure_threads(threads, self._prompt_tokens)
        return time.perf_counter() - start

    def _prompt_tokens(self, tokens: int) -> None:
        """`_prompt_call` of about `tokens` tokens: prompts of 8 tokens, or longer where the batch has few rows."""
        rows = max(1, min(self.settings.max_batch, tokens // 8))
        self._prompt_call(rows, tokens // rows)

    def _prompt_call(self, rows: int, n: int) -> None:
        """One packed core iteration of a chunk of `rows` x `n` zero states in the first rows."""
        n = min(n, self.settings.max_length)
        call = self.calls.prompt(0, n, self.calls.upload(list(range(rows))), 1)
        state = torch.zeros(rows, n, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        pack = Pack()
        pack.add(call, state, state, 0)
        self.calls.iterate_packed(pack)

    # ---- the step

    def execute(self, plan: StepPlan) -> StepOutput:
        """Carry out the plan, in its order (rdlm.inference.scheduling.plan.StepPlan); what it gave back."""
        out = StepOutput()
        self.static_step.refresh()  # (compiled: the weights as they are now)
        for wiped in plan.wipe:
            self.clear(wiped)
        with self.phases.timed("admission and prompt prelude"):
            self._admit(plan.admitted, plan.chunks)
        for request in plan.dropped:
            self._forget(request)
        self._narrow(plan.narrowed)
        if plan.starts:
            with self.phases.timed("prelude and s_0"):
                self._start(plan.starts)
        for spec in plan.rounds:
            with self.phases.timed("rounds"):
                out.rounds.append(self.rounds.run(self.rows[spec.request], spec.position, spec.token))
        if plan.lockstep:
            with self.phases.timed("core iteration"):
                iterations = self._lockstep(plan.iterating)
            with self.phases.timed("coda and sampling"):
                done = [
                    Done(it.request, it.row, it.position, n) for it, n in zip(plan.iterating, iterations, strict=True)
                ]
                out.lockstep = self._coda(done, lockstep=True)
            return out
        computing = self._iterate(plan, out)
        if self.chunks:
            with self.phases.timed("prompt coda and first token"):
                self._end_prompts(plan, out)
        self._look(plan, computing, out)
        return out

    def coda(self, done: tuple[Done, ...]) -> list[Chosen]:
        """The coda the scheduler found due over the rows whose token is done: their next tokens."""
        with self.phases.timed("coda and sampling"):
            return self._coda(list(done))

    # ---- rows in and out

    def _admit(self, admitted: tuple[Admission, ...], chunks: tuple[ChunkSpec, ...]) -> None:
        """Requests admitted into their rows: the runner's record of each (its generator and s_0 table made
        here, its row routed to its adapter); the rows of those that prefill forget what they held; then the
        chunks that begin prefilling."""
        for a in admitted:
            generator = torch.Generator(device=self.device).manual_seed(a.config.seed)
            noise = self.calls.noise_table(a.config.seed, a.config.init_scale, a.positions)
            self.rows[a.request] = RowState(
                a.request, a.row, list(a.prompt), a.config, a.criterion, a.budget, generator, noise
            )
            self.calls.route(a.row, a.config.adapter)
            self.exits.admit(a.row, a.criterion, a.config.exit_every)
        if admitted:
            self._last_inputs = None  # a call built before holds the rows' adapters of then
        for spec in chunks:
            for request in spec.requests if spec.start == 0 else ():
                row = self.rows[request]
                self.calls.rewind(0, row.row)
                self.t.seen[row.row] = False
                self.t.seen[row.row, self.calls.upload(row.prompt)] = True
        for spec in chunks:
            self.specs[spec.chunk] = spec
            self.chunks[spec.chunk] = PromptChunk.begin(
                self.calls,
                [self.rows[r] for r in spec.requests],
                spec.start,
                list(spec.lengths),
                spec.cap,
                spec.budget,
            )

    def _forget(self, request: int) -> None:
        """A request left its row (finished, failed or cancelled): its record and its wave go."""
        self.rows.pop(request, None)
        self.rounds.forget(request)

    def _narrow(self, narrowed: tuple[tuple[ChunkSpec, tuple[int, ...]], ...]) -> None:
        """Prompt chunks in flight that lost cancelled requests go on with the requests the plan keeps (or go)."""
        for spec, keep in narrowed:
            chunk = self.chunks.pop(spec.chunk)
            del self.specs[spec.chunk]
            if keep:
                self.chunks[spec.chunk], self.specs[spec.chunk] = chunk.select(list(keep)), spec

    def clear(self, row: int) -> None:
        """Wipe a failed request's row: a NaN left in its cache would reach the row's next request through the
        attention's masked (zero-weight) entries."""
        self.cache.clear_rows(row)
        self.t.state[row] = 0

    def _inputs(self, places: list[tuple[int, int]]) -> tuple[Tensor, Call]:
        """(rows, call) of the tokens in progress at (row, buffer index) `places` (`ModelCalls.tokens`: the
        call's rows are a slice where they are consecutive, its start their write indices)."""
        key = tuple(places)
        if self._last_inputs is not None and self._last_inputs[0] == key:  # unchanged since the last step
            return self._last_inputs[1]
        inputs = self.calls.tokens([row for row, _ in places], [length for _, length in places])
        self._last_inputs = (key, inputs)
        return inputs

    # ---- a token's start and end

    def _start(self, starts: tuple[Start, ...]) -> None:
        """Feed each chosen token: prelude and s_0 of its position, and its row's count, cap, min_steps and
        budget (the scheduler checked that they fit)."""
        rows = [self.rows[s.request] for s in starts]
        limits = self.calls.upload(
            [[s.cap, row.config.min_steps, row.budget] for row, s in zip(rows, starts, strict=True)]
        )
        lengths = self.calls.upload([s.position for s in starts])
        self.calls.admit(lengths, rows=self.calls.upload([s.row for s in starts]))
        self._last_inputs = None  # the mask changed
        batch_rows, call = self._inputs([(s.row, s.position) for s in starts])
        select = _selected(call)
        self.t.seen[batch_rows, self.calls.upload([s.token for s in starts])] = True
        ids = self.calls.upload([[s.token] for s in starts])
        self.t.write_index[select] = lengths
        if self.static_step.ends is not None:  # compiled over the batch's first rows (only these write)
            self.t.token[select] = ids
            self.static_step.prelude([s.row for s in starts], max(s.position for s in starts) + 1)
        else:
            self.t.embedded[select] = self.calls.embed(ids, call)
        fresh = [(row, s) for row, s in zip(rows, starts, strict=True) if not row.config.continuous_cot]
        if fresh:  # (continuous CoT: s_0 is the last final state, kept)
            at = self.calls.upload([row.row for row, _ in fresh])
            drawn = [None if row.noise is None else row.noise[s.position] for row, s in fresh]
            noise = (
                None
                if all(d is None for d in drawn)
                else torch.stack([torch.zeros_like(self.t.state[0, 0]) if d is None else d for d in drawn]).unsqueeze(1)
            )
            self.t.state[at] = self.calls.start_state(self.t.embedded[at], noise)
        t = self.t
        t.cap[select], t.min_steps[select], t.budget[select] = limits.unbind(1)
        self.t.iterations[select], self.t.stopped[select] = 0, False
        self.exits.reset(
            select, self.calls.upload([row.criterion is not None and row.criterion.spec.exact for row in rows])
        )

    def _coda(self, done: list[Done], lockstep: bool = False) -> list[Chosen]:
        """The coda over the final states of the rows whose token is done, together, and the next token of each.
        A gate-exact row reads the state its gate chose (a lockstep token's state is that already)."""
        rows = [self.rows[d.request] for d in done]
        for row, d in zip(rows, done, strict=True):
            if not lockstep and row.criterion is not None and row.criterion.spec.exact:
                self.t.state[row.row] = self.exits.exit_state[row.row]  # what the readout (and continuous CoT) reads
            self.cache.fill_missing(d.iterations, d.position, d.position + 1, row=row.row, slots=row.budget)
        batch_rows, call = self._inputs([(d.row, d.position) for d in done])
        if self.static_step.ends is not None:  # compiled over the batch's first rows (only these write)
            every = self.static_step.readout([d.row for d in done], max(d.position for d in done) + 1)
            logits = every if [d.row for d in done] == list(range(every.shape[0])) else every[batch_rows]
        else:
            logits = self.calls.readout(self.t.state[_selected(call)], call)[:, -1]
        return self._choose(rows, logits, [d.iterations for d in done], [d.position for d in done])

    def _choose(
        self, rows: list[RowState], logits: Tensor, iterations: list[int], positions: list[int]
    ) -> list[Chosen]:
        """Each row's next token from its row of logits [n, V] (`choose_rows`), read out at buffer index
        `positions[j]`, or its failure where they are not finite."""
        chosen = choose_rows(
            logits,
            [row.config for row in rows],
            [row.generator for row in rows],
            self.t.seen,
            self.calls.upload([row.row for row in rows]),
            self.calls.upload,
        )
        out = []
        for row, pick, n, position in zip(rows, chosen, iterations, positions, strict=True):
            if pick is None:  # read out at `position`, the logits choose new token number position - prompt + 2
                token = position + 2 - len(row.prompt)
                out.append(Chosen(row.id, error=NonFiniteLogitsError(self.model, token)))
            else:
                out.append(Chosen(row.id, pick[0], n, pick[1]))
        return out

    def _end_prompts(self, plan: StepPlan, out: StepOutput) -> None:
        """Chunks that ran their iterations, in order: the coda over their tokens, then, for each prompt whose
        last chunk this was (`ChunkSpec.ends`), its row's state set to its last token's and, where the plan says
        so (`chooses`: not for a prefill alone), its first new token chosen from that token's logits (the head and
        the choice once for every chunk's prompts); the other prompts go on in a chunk the scheduler begins."""
        outputs, adapters, requests, caps = [], [], [], []  # the first tokens' coda outputs: one head for all
        for key in [k for k in plan.prompts if k in self.chunks and self.chunks[k].iterated]:
            chunk, spec = self.chunks.pop(key), self.specs.pop(key)
            out.ended.append(key)
            state, coda = chunk.finish(self.calls, head=False)  # the head reads out the prompts' last tokens only
            ended = [j for j, ends in enumerate(spec.ends) if ends]
            if ended:
                last = {j: j * chunk.n + chunk.lengths[j] - 1 for j in ended}  # the prompts' last tokens, in [g * n]
                index = self.calls.upload(list(last.values()))
                rows = self.calls.upload([chunk.requests[j].row for j in ended])
                self.t.state[rows] = state.flatten(0, 1)[index].unsqueeze(1)
                choosing = [j for j in ended if spec.chooses[j]]
                if choosing:
                    picked = index if len(choosing) == len(ended) else self.calls.upload([last[j] for j in choosing])
                    outputs.append(coda.flatten(0, 1)[picked].unsqueeze(1))
                    if chunk.call.adapters is not None:  # [g, 1], a chunk's row each
                        adapters.append(chunk.call.adapters[self.calls.upload(choosing)])
                    requests += [chunk.requests[j] for j in choosing]
                    caps += [chunk.cap] * len(choosing)
            self._last_inputs = None
        if requests:
            logits = self.calls.head(torch.cat(outputs), torch.cat(adapters) if adapters else None)[:, -1]
            positions = [len(q.prompt) - 1 for q in requests]
            out.first += self._choose(requests, logits, caps, positions)

    def _look(self, plan: StepPlan, computing: list[Iterating], out: StepOutput) -> None:
        """The host reads the iterating rows' exit flags (one read) when the plan says so: at its interval, or
        when a request it named computed (its token reached its cap)."""
        computed = {it.request for it in computing}
        if plan.iterating and (plan.look or any(request in computed for request in plan.look_at_cap)):
            select = _selected(self._inputs([(it.row, it.position) for it in plan.iterating])[1])
            stopped, iterations = torch.stack((self.t.stopped[select].long(), self.t.iterations[select])).tolist()
            out.found = {it.request: n for it, stop, n in zip(plan.iterating, stopped, iterations, strict=True) if stop}

    # ---- the plan's core iterations

    def _iterate(self, plan: StepPlan, out: StepOutput) -> list[Iterating]:
        """The plan's iterations of the computing rows and the prompt chunks, then the rows' exit decisions;
        the rows that computed."""
        computing = list(plan.iterating)
        if plan.peek:  # rows done on the device since the last look leave the call (a free read here)
            flags = self.t.stopped.tolist()
            computing = [it for it in computing if not flags[it.row]]
        out.computed = tuple(it.request for it in computing)
        share = plan.prompt_iterations if computing else plan.prompt_iterations_alone
        chunks = [self.chunks[k] for k in plan.prompts if k in self.chunks]
        out.prompt_iterations = max(share, 1) if chunks else 0  # the first runs in any case
        n = plan.iterations
        if computing and n > 1:  # fused (static) iterations: only state-only criteria, read inside the call
            self._static(computing, n)
        elif computing:
            rows, call = self._inputs([(it.row, it.position) for it in computing])
            select = _selected(call)
            running = ~self.t.stopped[select]
            prev_state = self.t.state[select].clone()  # `select` may be a view, overwritten below
            if self.static:
                self._static(computing, 1)
                if chunks:  # the prompts' iteration in a call of their own: the step keeps its graph
                    self._prompts(Pack(), chunks)
                state = self.t.state[select]
            else:
                may_be_frozen = plan.since_look and any(
                    self.rows[it.request].criterion is not None or at_cap(it.iteration, it.cap) for it in computing
                )
                state = self._eager(computing, may_be_frozen, rows, call, prev_state, chunks)
        elif chunks:
            self._prompts(Pack(), chunks)
        for _ in range(share - 1):  # the prompts' share of the step beyond the first
            going = [c for c in chunks if not c.iterated]
            if going:
                self._prompts(Pack(), going)
        if not computing or n > 1:
            return computing
        if not self.static:
            self.t.state[select] = state
            self.t.iterations[select] += running.long()
        with self.phases.timed("exit evaluation"):
            members = [_Member(self.rows[it.request], it.iteration + 1, it.cap) for it in computing]
            self.exits.update(
                members, rows, call, prev_state, state, running, self.t.iterations, self.t.min_steps, self.static
            )
            # over every row (one op each, no gather): a row that is not computing has stopped already, or does
            # not decode, and its flag is reset when its next token starts
            self.t.stopped |= done_iterating(self.exits.exited, self.t.iterations, self.t.cap, self.exits.runs_on)
        return computing

    def _static(self, requests: list[Iterating], n: int) -> None:
        """n core iterations of the decoding rows as the static step (rdlm.inference.runner.static_step)."""
        with self.phases.timed("core iteration"):
            self.static_step.run([it.row for it in requests], n, max(it.position for it in requests) + 1)

    def _eager(
        self,
        computing: list[Iterating],
        may_be_frozen: bool,
        rows: Tensor,
        call: Call,
        prev_state: Tensor,
        chunks: list[PromptChunk],
    ) -> Tensor:
        """The computing rows' core iteration in a call over them alone, packed with the prompt chunks' when
        there are any: their new states (a frozen row's kept, where a row `may_be_frozen`). Each row runs at
        core slot (its iteration mod its budget)."""
        frozen = self.t.stopped[_selected(call)] if may_be_frozen else None
        writers = None if frozen is None else ~frozen
        slots = [it.iteration % self.rows[it.request].budget for it in computing]
        if len(set(slots)) == 1:  # every row at the same slot: a plain call at that iteration
            core, iteration = call.but(core_writers=writers), slots[0]
        else:
            core = call.but(rows=rows, slots=self.calls.upload(slots), core_writers=writers)
            iteration = 0
        embedded = self.t.embedded[_selected(call)]
        if not chunks:  # the decoding rows alone: a plain batched call
            with self.phases.timed("core iteration"):
                out = self.calls.iterate_once(prev_state, embedded, iteration, core)
        else:
            pack = Pack()
            pack.add(core, prev_state, embedded, iteration)
            out = self._prompts(pack, chunks)
        state = out.reshape(-1, 1, self.model.config.hidden_size)[: len(computing)]
        return state if frozen is None else torch.where(frozen.view(-1, 1, 1), prev_state, state)

    def _prompts(self, pack: Pack, chunks: list[PromptChunk]) -> Tensor:
        """One core iteration of `pack` (the decoding rows' part, or nothing) and of the prompt `chunks`, in one
        call (a plain one for a chunk alone, as a prefill of the whole batch runs: `PromptChunk.run`; a packed one
        always where the prompts' iteration is compiled, `ModelCalls.compiled_prompts`)."""
        if not pack.segments and len(chunks) == 1 and self.calls.compiled_prompts is None:
            chunk = chunks[0]
            with self.phases.timed("core iteration"):
                out = self.calls.iterate_once(chunk.state, chunk.embedded, chunk.iteration, chunk.call)
            chunk.advance(self.calls, out)
            return out
        tokens = [c.pack(pack) for c in chunks]
        with self.phases.timed("core iteration"):
            out = self.calls.iterate_packed(pack)
        for c, part in zip(chunks, tokens, strict=True):
            c.advance(self.calls, out[:, part])
        return out

    def _lockstep(self, requests: tuple[Iterating, ...]) -> list[int]:
        """The token the requests started together, in lockstep (rdlm.inference.runner.lockstep): all its core
        iterations; the iterations each request ran. On the static path over every row of the batch, the
        rows not decoding frozen; eagerly over the rows that `_eager_rows` gives."""
        first = self.rows[requests[0].request]
        config, criterion, budget = first.config, first.criterion, first.budget
        vocab = self.model.config.vocab_size
        if self.static:
            self.static_step.mark_decoding([it.row for it in requests])
            every_row = lambda: self.calls.all_rows(self.t.write_index, budget, self.static_step.decoding)  # noqa: E731
            if criterion is None:
                self.t.state.copy_(self.lockstep.fixed(config, self.t.state, self.t.embedded, every_row))
                return [config.num_steps] * len(requests)
            final, per_row = self.lockstep.adaptive(
                config,
                criterion,
                lambda: Rows.start(
                    self.calls.batch_rows,
                    self.t.state,
                    self.t.embedded,
                    every_row(),
                    ~self.static_step.decoding,
                    criterion,
                    vocab,
                ),
                self.max_batch - len(requests),
            )
            self.t.state.copy_(final)
            return per_row[self._inputs([(it.row, it.position) for it in requests])[0]].tolist()
        span, rows, call, places, idle = self._eager_rows(requests, budget)
        if criterion is None:
            out = self.lockstep.fixed(config, self.t.state[span], self.t.embedded[span], lambda: call)
            self.t.state[span] = out if idle is None else torch.where(idle.view(-1, 1, 1), self.t.state[span], out)
            return [config.num_steps] * len(requests)
        frozen = torch.zeros(len(rows), dtype=torch.bool, device=self.device) if idle is None else idle
        final, per_row = self.lockstep.adaptive(
            config,
            criterion,
            lambda: Rows.start(rows, self.t.state[span], self.t.embedded[span], call, frozen, criterion, vocab),
            len(rows) - len(requests),
        )
        self.t.state[span] = final
        return per_row[places].tolist()

    def _eager_rows(
        self, requests: tuple[Iterating, ...], budget: int
    ) -> tuple[slice | Tensor, Tensor, Call, Tensor | slice, Tensor | None]:
        """The rows an eager lockstep token runs over: the requests' rows; or, when a few rows between them are
        not decoding (freed by requests that finished), the slice that spans them, the rows between riding
        along frozen and writing nothing: a slice reads the cache as views, where a gather of the rows copies
        it at every layer. With more rows between than decoding, the gather costs less than computing them.
        (rows of the batch as a slice or index, their batch rows, their call, the requests' places among them,
        the rows between as a mask or None.)"""
        numbers = [q.row for q in requests]
        span = slice(numbers[0], numbers[-1] + 1)
        if len(numbers) == span.stop - span.start or span.stop - span.start > 2 * len(numbers):
            rows, call = self._inputs([(it.row, it.position) for it in requests])
            return _selected(call), rows, call.but(budget=budget), slice(None), None
        index = {it.row: it.position for it in requests}
        every = range(span.start, span.stop)
        rows, call = self.calls.tokens(list(every), [index.get(b, 0) for b in every])
        idle = self.calls.upload([b not in index for b in every])
        places = self.calls.upload([b - span.start for b in numbers])
        return span, rows, call.but(budget=budget, core_writers=~idle), places, idle


@dataclass(frozen=True)
class _Member:
    """A computing row as its exit criterion reads it (`RowExits.update`): after `iteration` iterations of `cap`."""

    row: RowState
    iteration: int
    cap: int

    @property
    def criterion(self):
        return self.row.criterion

    @property
    def config(self):
        return self.row.config


def _selected(call: Call) -> Tensor | slice:
    """The batch rows a call over the rows covers (a slice where they are consecutive)."""
    assert call.rows is not None  # (a call of the batch's rows names them)
    return call.rows
