"""Continuous batching at the granularity of iterations: the decode engine of `rdlm serve` and of
`rdlm.inference.generate`.

A fixed number of rows share one `RecurrentKVCache`; each request occupies one row from its prompt to
its last token. Every `ContinuousBatch.step()`:

1. admits waiting requests into free rows; their prompts start prefilling (rdlm.inference.prefill:
   a chunk of each prompt runs its iterations inside the following steps, so the rows already decoding
   go on; a prompt's first new token is chosen when its last chunk is done). A step gives the prompts
   `prefill_chunk` token-iterations: a chunk of that many tokens runs one iteration per step, in the
   decoding rows' call; chunks of fewer tokens run proportionally more (the extra ones in calls of
   their own), so a short prompt is prefilled within a few steps and a long one never stalls the batch;
2. starts the next token on every row whose previous token is done (prelude, s_0);
3. runs **one** core iteration for every iterating row and every prompt chunk, in one model call,
   although the rows are at different tokens and iterations, with different r, exit criteria, cache
   budgets and sampling;
4. evaluates each row's exit criterion on the device (rdlm.inference.row_exits): a row whose token is
   done (exit, or r iterations) is frozen there (state kept, no more core cache writes; eagerly on the CPU
   it leaves the core's calls at the next step). Every `exit_sync_every` steps the host looks at the flags (at
   once when a row reaches its cap); the rows found done run the coda together once one of them has
   waited `coda_every` - 1 steps, or half the rows wait, or no other row can be done before then, and
   choose their next token, which starts at the next step. A row that exits early goes on to its next
   token instead of idling behind the others: adaptive depth (paper section 6.1) turned into throughput.

How often to look and to run the coda is a trade: the coda and the head cost about as much for one row
as for many (on a CPU their weights are read once per call) and on a GPU a look is a host sync; every
few steps pays them once for many rows, and keeps rows that finish together in step (so their next
tokens can run in lockstep), at the cost of a done row waiting a few steps (`benchmarks/bench_serve.py`
measures it; `rdlm serve` looks every 4 steps and lets a row wait up to 8). Neither changes a token.

When every request in a row starts its token at the same step with the same depth settings and nothing
waits to join (`generate`'s batch, or a server's rows that happen to go together), the token runs in
lockstep: all its core iterations in this step, then the coda (rdlm.inference.lockstep).

With `compile=True` (the default on CUDA) step 3 is the static step: one fixed-shape call over every row
(per-row index, slot and writers on the device) that CUDA captures once as a graph (`_step_static`;
docs/inference.md); the prompt chunks in flight then run their iteration in a call of their own.

A request in a busy batch gets the tokens of its prompt alone with the same `GenerationConfig`, however
its tokens are scheduled: the same s_0 table (seed, position), cache slots, exit decisions and sampler.

What each request does at a step (admission, lockstep, which rows compute, when to look, when a coda is
due, fused iterations, the prompts' share) is its `Scheduler`'s decision (rdlm.inference.scheduler), which
holds the requests and their rows and no tensor; `ContinuousBatch` carries the decisions out on the model.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch import Tensor

from rdlm.checks import check_int
from rdlm.inference.graphs import PhaseTimes, StaticSteps, resolve_compile, sync
from rdlm.inference.lockstep import Lockstep, LockstepTokens
from rdlm.inference.params import BatchEvent, Decode, Engine, GenerationConfig, check_request
from rdlm.inference.prefill import PromptChunk
from rdlm.inference.request import Request, Status
from rdlm.inference.row_exits import RowExits
from rdlm.inference.runner import Call, ModelRunner, Pack
from rdlm.inference.sampling import NonFiniteLogitsError, choose_rows
from rdlm.inference.scheduler import Scheduler
from rdlm.model.lm import RecurrentDepthLM


class ContinuousBatch(LockstepTokens, Engine):
    """Requests in, tokens out, one core iteration at a time. Not thread-safe: one thread calls
    `add`, `cancel` and `step` (a server runs it in a worker thread and hands requests over).

        batch = ContinuousBatch(model, max_batch=8, max_length=512, num_slots=32)
        rid = batch.add([1, 2, 3], GenerationConfig(num_steps=16, max_new_tokens=8))
        while batch.busy:
            for event in batch.step(): ...
    """

    def __init__(self, model: RecurrentDepthLM, max_batch: int = 8, max_length: int | None = None,
                 num_slots: int = 32, decode: Decode | None = None, exit_sync_every: int = 1,
                 prefill_chunk: int = 256, coda_every: int = 1, profile: bool = False,
                 compile: bool | None = None) -> None:
        c = model.config
        max_length = c.context_length if max_length is None else max_length
        for name, value in (("max_batch", max_batch), ("max_length", max_length), ("num_slots", num_slots),
                            ("exit_sync_every", exit_sync_every), ("prefill_chunk", prefill_chunk),
                            ("coda_every", coda_every)):
            check_int(name, value)
        param = next(model.parameters())
        self.model, self.decode = model.eval(), decode
        self.device, self.dtype = param.device, param.dtype
        self.max_batch, self.max_length, self.num_slots = max_batch, max_length, num_slots
        self.exit_sync_every, self.prefill_chunk, self.coda_every = exit_sync_every, prefill_chunk, coda_every
        self.scheduler = Scheduler(max_batch, exit_sync_every, coda_every, prefill_chunk)  # who does what, when
        self.chunks: list[PromptChunk] = []   # prompts being prefilled (rdlm.inference.prefill)
        self.runner = ModelRunner(model, max_batch, max_length, num_slots, "full")
        self.cache = self.runner.cache
        self.cache_bytes = self.cache.nbytes
        h = c.hidden_size
        self.state = torch.zeros(max_batch, 1, h, dtype=self.dtype, device=self.device)
        self.embedded = torch.zeros_like(self.state)
        self.exits = RowExits(self.runner, max_batch, c.vocab_size, self.state)  # the criteria's per-row state
        # Each row's token in progress, on the device: iterations run, done (exited or at its cap: frozen
        # until the host looks), its cap and min_steps.
        long = dict(dtype=torch.long, device=self.device)
        self.steps, self.cap = torch.zeros(max_batch, **long), torch.zeros(max_batch, **long)
        self.min_steps = torch.zeros(max_batch, **long)
        self.done = torch.zeros(max_batch, dtype=torch.bool, device=self.device)
        self.seen = torch.zeros(max_batch, c.vocab_size, dtype=torch.bool, device=self.device)
        # The static core iteration (`_step_static`; `compile` None: on with CUDA, off on the CPU, as
        # `generate`'s): each row's buffer index, core cache budget and whether it decodes, read in place by a
        # captured step.
        self.static_steps = StaticSteps(self.device, resolve_compile(compile, self.device), shared_pool=True)
        self.write_index, self.budget = torch.zeros(max_batch, **long), torch.ones(max_batch, **long)
        self.decoding = torch.zeros_like(self.done)
        self._decoding_rows: tuple[int, ...] = ()  # the rows `decoding` marks
        self.fused_iterations = 0             # core iterations run several to a call (`_iterate_fused`)
        self.lockstep = Lockstep(self.runner, self.static_steps.static)  # `_token`
        self.ids = itertools.count()
        self._last_inputs: tuple | None = None  # (rows and lengths, their inputs): reused while unchanged
        self.failures: list[tuple[int, Exception]] = []  # requests that failed alone (`take_failures`)
        self.first_step: float | None = None  # time.perf_counter() at the first step
        self.phases = PhaseTimes(self.device, profile)  # with `profile`: seconds per phase of the steps

    # ---- requests

    def add(self, prompt: list[int], config: GenerationConfig) -> int:
        """Queue a request; returns its id. Raises ValueError for what this batch cannot serve."""
        criterion = check_request(self.model, prompt, config, self.decode)
        if config.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 in a continuous batch, got {config.max_new_tokens}")
        if len(prompt) + config.max_new_tokens > self.max_length:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) "
                             f"exceeds the context of {self.max_length} tokens")
        if config.draft_steps is not None:
            raise ValueError("speculative decoding is not available in a continuous batch")
        if config.sampler != "sequential":
            raise ValueError(f"the {config.sampler} sampler decodes one prompt at a time; it is not "
                             f"available in a continuous batch (use rdlm generate)")
        budget = config.core_slots
        if budget > self.num_slots:
            raise ValueError(f"num_steps {config.max_steps} needs {budget} core cache slots and this batch "
                             f"has {self.num_slots}: use the shared cache (a KV-cache budget) of at most "
                             f"{self.num_slots} slots")
        request = Request(next(self.ids), list(prompt), config, criterion, budget,
                           torch.Generator(device=self.device).manual_seed(config.seed),
                           self.runner.noise_table(config.seed, config.init_scale, len(prompt) + config.max_new_tokens))
        self.scheduler.add(request)
        return request.id

    def cancel(self, request: int) -> None:
        """Drop a request (waiting or running); its row is freed at the next step."""
        self.scheduler.cancel(request)

    @property
    def active(self) -> list[Request]:
        return self.scheduler.active

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def capture_seconds(self) -> float:
        return self.static_steps.capture_seconds + self.lockstep.static_steps.capture_seconds

    # ---- one step

    def step(self) -> list[BatchEvent]:
        """Run the next step (the module doc); the tokens it chose. The first step that chooses tokens ends
        the prefill of `generate`'s batch (`prefill_seconds`, `decode_start`)."""
        if self.first_step is None:
            self.first_step = time.perf_counter()
        events = self._run_step()
        if events and self.decode_start is None:
            sync(self.device)
            self.decode_start = time.perf_counter()
            self.prefill_seconds = self.decode_start - self.first_step
        return events

    def _run_step(self) -> list[BatchEvent]:
        events: list[BatchEvent] = []
        s = self.scheduler
        with torch.inference_mode():
            self._drop_cancelled()
            with self.phases.timed("admission and prompt prelude"):
                self._admit()
            starting = s.with_status(Status.STARTING)
            if starting:
                with self.phases.timed("prelude and s_0"):
                    self._start(starting)
                if s.in_lockstep(starting, bool(self.chunks)):
                    self._token(starting, events)
                    s.step_ran([])
                    return events
            iterating = s.with_status(Status.ITERATING)
            computing = s.computing(iterating, self.device.type != "cpu" or self.static_steps.static,
                                    lambda: self.done.tolist())
            if computing or self.chunks:
                self._iterate(computing)
            if self.chunks:
                with self.phases.timed("prompt coda and first token"):
                    self._end_chunks(events)
            if s.step_ran(iterating):
                self._look(iterating)
            ready = s.with_status(Status.READY)
            if ready and s.coda_due(ready):
                with self.phases.timed("coda and sampling"):
                    self._finish(ready, events)
        return events

    def take_failures(self) -> list[tuple[int, Exception]]:
        """The requests that failed since the last call, each with its error (their rows are free)."""
        failures, self.failures = self.failures, []
        return failures

    def _fail(self, q: Request, err: Exception) -> None:
        """End one request with an error, alone: the others go on. Its row is wiped, since a NaN left in its
        cache would reach the row's next request through the attention's masked (zero-weight) entries."""
        self.scheduler.free(q)
        self.cache.clear_rows(q.row)
        self.state[q.row] = 0
        self.failures.append((q.id, err))

    def take_timings(self) -> dict[str, float]:
        """The seconds per phase accumulated since the last call (empty without `profile`)."""
        return self.phases.take()

    def _drop_cancelled(self) -> None:
        dropped = self.scheduler.drop_cancelled()
        for chunk in list(self.chunks) if dropped else ():  # a prompt being prefilled stops writing to its row
            keep = [j for j, q in enumerate(chunk.requests) if q.id not in dropped]
            if len(keep) < len(chunk.requests):
                self.chunks.remove(chunk)
                if keep:
                    self.chunks.append(chunk.select(keep))

    def _admit(self) -> None:
        """Waiting requests into free rows (the scheduler's); those admitted together with the same prefill
        depth and cache budget start prefilling their prompts as one chunk."""
        groups = self.scheduler.admit()
        for q in (q for group in groups.values() for q in group):
            self.runner.rewind(0, q.row)
            self.seen[q.row] = False
            self.seen[q.row, self.runner.upload(q.prompt)] = True
        for (cap, budget), group in groups.items():
            self._begin_chunk(group, 0, cap, budget)

    def _begin_chunk(self, requests: list[Request], start: int, cap: int, budget: int) -> None:
        self.chunks.append(PromptChunk.begin(self.runner, requests, start, cap, budget, self.prefill_chunk))

    def _end_chunks(self, events: list[BatchEvent]) -> None:
        """Chunks that ran their iterations: the coda over their tokens, then the next chunk, or the first
        new token (chosen from the logits of the prompt's last token) and decoding."""
        for chunk in [c for c in self.chunks if c.done]:
            self.chunks.remove(chunk)
            state, logits = chunk.finish(self.runner)
            going_on, ended, last = [], [], []
            for j, (q, length) in enumerate(zip(chunk.requests, chunk.lengths)):
                if chunk.start + length < len(q.prompt):
                    going_on.append(q)
                    continue
                self.scheduler.prefilled(q)
                ended.append(q)
                last.append(j * chunk.n + length - 1)  # the prompt's last token, in the chunk's [g * n]
            if ended:
                index = self.runner.upload(last)
                self.state[self.runner.upload([q.row for q in ended])] = state.flatten(0, 1)[index].unsqueeze(1)
                self._choose(ended, logits.flatten(0, 1)[index], [chunk.cap] * len(ended), events)
            self._last_inputs = None
            if going_on:  # they ran n tokens each
                self._begin_chunk(going_on, chunk.start + chunk.n, chunk.cap, chunk.budget)

    def _inputs(self, requests: list[Request]) -> tuple[Tensor, Call]:
        """(rows, call) of the token in progress of each request (`ModelRunner.tokens`: the call's rows are
        a slice where they are consecutive, its start their write indices)."""
        key = tuple((q.row, q.length) for q in requests)
        if self._last_inputs is not None and self._last_inputs[0] == key:  # unchanged since the last step
            return self._last_inputs[1]
        inputs = self.runner.tokens([q.row for q in requests], [q.length for q in requests])
        self._last_inputs = (key, inputs)
        return inputs

    def _start(self, requests: list[Request]) -> None:
        """Feed each request's chosen token: prelude and s_0 of its next position."""
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
        self.scheduler.start(requests)
        limits = self.runner.upload([[q.cap, q.config.min_steps, q.budget] for q in requests])
        self.cap[select], self.min_steps[select], self.budget[select] = limits.unbind(1)
        self.write_index[select] = lengths
        self.steps[select], self.done[select] = 0, False
        self.exits.reset(select)

    def _iterate(self, requests: list[Request]) -> None:
        """One core iteration for every request whose token is in progress and every prompt chunk being
        prefilled, in one model call. Rows found done on the device since the host last looked
        (`self.done`) are frozen: their state stays, they write no core cache entries, their iteration
        count stops."""
        fused = self.scheduler.fusable(requests, self.static_steps.static, bool(self.chunks)) if requests else 1
        if fused > 1:
            self._iterate_fused(requests, fused)
            return
        if requests:
            rows, call = self._inputs(requests)
            select = call.rows
            prev_state = self.state[select].clone()  # `select` may be a view, overwritten below
            if self.static_steps.static:
                with self.phases.timed("core iteration"):
                    state = self._step_static(requests)[select]
                if self.chunks:  # the prompts' iteration in a call of their own: the step keeps its graph
                    self._run_packed(Pack(), self.chunks)
            else:
                state = self._step(requests, rows, call, prev_state)
        else:
            self._run_packed(Pack(), self.chunks)
        if self.chunks:   # the prompts' share of the step (Scheduler.extra_prompt_iterations)
            extra = self.scheduler.extra_prompt_iterations(sum(c.state.shape[0] * c.n for c in self.chunks),
                                                           min(c.cap - c.iteration for c in self.chunks),
                                                           decoding=bool(requests))
            for _ in range(extra):
                self._iterate_prompts()
        if not requests:
            return
        self.state[select] = state
        running = ~self.done[select]
        self.steps[select] += running.long()
        self.scheduler.ran(requests)
        with self.phases.timed("exit evaluation"):
            self.exits.update(requests, rows, call, prev_state, state, running, self.steps, self.min_steps, self.cap,
                              self.done)
            steps = self.steps[select]
            self.done[select] |= steps >= self.cap[select]

    def _step(self, requests: list[Request], rows: Tensor, call: Call, prev_state: Tensor) -> Tensor:
        """The decoding rows' core iteration in a call over them alone, packed with the prompt chunks' when
        there are any: their new states (a frozen row's kept)."""
        frozen = self.done[call.rows] if self.scheduler.may_be_done(requests) else None
        slots = [q.iteration % q.budget for q in requests]
        writers = None if frozen is None else ~frozen
        if len(set(slots)) == 1:  # every row at the same slot: a plain call at that iteration
            core, iteration = call.but(core_writers=writers), slots[0]
        else:
            core = call.but(rows=rows, slots=self.runner.upload(slots), core_writers=writers)
            iteration = 0
        embedded = self.embedded[call.rows]
        if not self.chunks:  # the decoding rows alone: a plain batched call
            with self.phases.timed("core iteration"):
                out = self.runner.step(prev_state, embedded, iteration, core)
        else:
            pack = Pack()
            pack.add(core, prev_state, embedded, iteration)
            out = self._run_packed(pack, self.chunks)
        state = out.reshape(-1, 1, self.model.config.hidden_size)[:len(requests)]
        return state if frozen is None else torch.where(frozen.view(-1, 1, 1), prev_state, state)

    def _step_static(self, requests: list[Request]) -> Tensor:
        """The decoding rows' core iteration as one fixed-shape call over all `max_batch` rows, the same at
        every step (CUDA captures it once): each row's buffer index, core slot (iterations run, modulo its
        budget) and whether it writes are device tensors, not a plan built per step. A row that is not
        decoding (free, prefilling its prompt or waiting for its coda) or is done keeps its state and writes
        nothing.
        Every row's new state."""
        self._mark_decoding(requests)
        return self.static_steps.run(("core iteration",), self._core_static)[0]

    def _mark_decoding(self, requests: list[Request]) -> None:
        """`self.decoding`: the rows of `requests` (copied to the device when they changed)."""
        decoding = tuple(q.row for q in requests)
        if decoding != self._decoding_rows:
            self._decoding_rows = decoding
            self.decoding.copy_(self.runner.upload([b in decoding for b in range(self.max_batch)]))

    def _core_static(self) -> tuple[Tensor, Tensor]:
        """The static body: (every row's new state, the rows that iterated: decoding and not done)."""
        writers = self.decoding & ~self.done
        call = self.runner.every_row(self.write_index, self.steps % self.budget, writers)
        out = self.runner.step(self.state, self.embedded, 0, call)
        return torch.where(writers.view(-1, 1, 1), out, self.state), writers

    def _iterate_fused(self, requests: list[Request], n: int) -> None:
        """n core iterations of the decoding rows in one static call (`Scheduler.fusable`): each exactly the static
        step, the rows' iteration counts and done flags updated on the device as the one-step path does."""
        self._mark_decoding(requests)
        with self.phases.timed("core iteration"):
            self.static_steps.run(("core iterations", n), lambda: self._core_static_iterations(n), idempotent=False)
        self.fused_iterations += n
        self.scheduler.ran(requests, n)

    def _core_static_iterations(self, n: int) -> tuple:
        for _ in range(n):
            state, writers = self._core_static()
            self.state.copy_(state)
            self.steps += writers.long()
            self.done |= self.decoding & (self.steps >= self.cap)
        return ()

    def _iterate_prompts(self) -> None:
        """One more core iteration of the prompt chunks that have iterations left, in one packed call."""
        chunks = [c for c in self.chunks if not c.done]
        if chunks:
            self._run_packed(Pack(), chunks)

    def _run_packed(self, pack: Pack, chunks: list[PromptChunk]) -> Tensor:
        """One core iteration of `pack` (the decoding rows' part, or nothing) and of `chunks`, in one call (a
        plain one for a chunk alone, as a prefill of the whole batch runs: `PromptChunk.run`)."""
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

    def _look(self, requests: list[Request]) -> None:
        """The host reads the exit flags (one read): rows whose token is done leave the core's calls and wait
        for their coda."""
        select = self._inputs(requests)[1].rows
        finished, steps = torch.stack((self.done[select].long(), self.steps[select])).tolist()
        self.scheduler.looked(requests, [bool(f) for f in finished], steps)

    def _finish(self, requests: list[Request], events: list[BatchEvent]) -> None:
        """The coda for rows whose token is done, together, and their next tokens."""
        for q in requests:
            if q.criterion is not None and q.criterion.spec.exact:
                self.state[q.row] = self.exits.exit_state[q.row]  # what the readout (and continuous CoT) reads
        self._coda(requests, events)

    def _coda(self, requests: list[Request], events: list[BatchEvent]) -> None:
        """The coda over the final states of rows whose token is done, and their next tokens."""
        for q in requests:
            self.cache.fill_missing(q.iteration, q.length, q.length + 1, row=q.row, slots=q.budget)
        call = self._inputs(requests)[1]
        logits = self.runner.readout(self.state[call.rows], call)[:, -1]
        for q in requests:
            q.length += 1
        self._choose(requests, logits, [q.iteration for q in requests], events)

    def _choose(self, requests: list[Request], logits: Tensor, steps: list[int], events: list[BatchEvent]) -> None:
        """Choose each request's next token from its row of logits [n, V] (`choose_rows`); emit them in order;
        free the rows that finished."""
        chosen = choose_rows(logits, [q.config for q in requests], [q.generator for q in requests], self.seen,
                             self.runner.upload([q.row for q in requests]), self.runner.upload)
        for j, q in enumerate(requests):
            if chosen[j] is None:
                self._fail(q, NonFiniteLogitsError(self.model, len(q.tokens) + 1))
                continue
            token, scored = chosen[j]
            try:   # the request's own stop strings, decoded with the server's tokenizer
                reason = self.scheduler.chosen(q, token, steps[j], self.decode)
            except Exception as err:  # noqa: BLE001 (whatever it is, it is this request's alone)
                self._fail(q, err)
                continue
            events.append(BatchEvent(q.id, token, steps[j], reason, *((None, None) if scored is None else scored)))
