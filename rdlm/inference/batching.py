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
(per-row index, slot and writers on the device) that CUDA captures once as a graph (`StepRunner._static`;
docs/inference.md); the prompt chunks in flight then run their iteration in a call of their own.

A request in a busy batch gets the tokens of its prompt alone with the same `GenerationConfig`, however
its tokens are scheduled: the same s_0 table (seed, position), cache slots, exit decisions and sampler.

The work is split as vLLM v1 splits its engine: the `Scheduler` (rdlm.inference.scheduler) holds the requests
and their rows and no tensor, and decides what each request does at a step (admission, lockstep, which rows
compute, when to look, when a coda is due, fused iterations, the prompts' share), as a `StepPlan` for the
core's work; the `StepRunner` (rdlm.inference.step_runner) holds every tensor of the rows and carries the
plan out on the model; `ContinuousBatch` runs the step in order and turns the chosen tokens into events.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch
from torch import Tensor

from rdlm.checks import check_int
from rdlm.inference.graphs import PhaseTimes, resolve_compile, sync
from rdlm.inference.params import BatchEvent, Decode, Engine, GenerationConfig, check_request
from rdlm.inference.request import Request, Status
from rdlm.inference.sampling import NonFiniteLogitsError, choose_rows
from rdlm.inference.parallel import check_parallel
from rdlm.inference.scheduler import Scheduler, in_rounds
from rdlm.inference.step_runner import StepOutput, StepRunner
from rdlm.model.lm import RecurrentDepthLM


class ContinuousBatch(Engine):
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
        max_length = model.config.context_length if max_length is None else max_length
        for name, value in (("max_batch", max_batch), ("max_length", max_length), ("num_slots", num_slots),
                            ("exit_sync_every", exit_sync_every), ("prefill_chunk", prefill_chunk),
                            ("coda_every", coda_every)):
            check_int(name, value)
        self.model, self.decode = model.eval(), decode
        self.device = next(model.parameters()).device
        self.max_batch, self.max_length, self.num_slots = max_batch, max_length, num_slots
        self.exit_sync_every, self.prefill_chunk, self.coda_every = exit_sync_every, prefill_chunk, coda_every
        self.scheduler = Scheduler(max_batch, exit_sync_every, coda_every, prefill_chunk)  # who does what, when
        self.phases = PhaseTimes(self.device, profile)  # with `profile`: seconds per phase of the steps
        # the rows' tensors and the model calls (`compile` None: the static step on with CUDA, off on the CPU)
        self.step_runner = StepRunner(model, max_batch, max_length, num_slots, resolve_compile(compile, self.device),
                               prefill_chunk, self.phases)
        self.runner, self.cache = self.step_runner.runner, self.step_runner.cache
        self.cache_bytes = self.cache.nbytes
        self.ids = itertools.count()
        self.failures: list[tuple[int, Exception]] = []  # requests that failed alone (`take_failures`)
        self.first_step: float | None = None  # time.perf_counter() at the first step

    # ---- requests

    def add(self, prompt: list[int], config: GenerationConfig) -> int:
        """Queue a request; returns its id. Raises ValueError for what this batch cannot serve."""
        criterion = check_request(self.model, prompt, config, self.decode)
        if len(prompt) + config.max_new_tokens > self.max_length:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) "
                             f"exceeds the context of {self.max_length} tokens")
        if config.sampler == "parallel":
            check_parallel(self.model, config, len(prompt))
        budget = config.core_slots
        if budget > self.num_slots:
            raise ValueError(f"num_steps {config.max_steps} needs {budget} core cache slots and this batch "
                             f"has {self.num_slots}: use the shared cache (a KV-cache budget) of at most "
                             f"{self.num_slots} slots")
        # s_0 of every position the request may write: a speculative round drafts past its last token
        positions = self.max_length if in_rounds(config) else len(prompt) + config.max_new_tokens
        request = Request(next(self.ids), list(prompt), config, criterion, budget,
                          torch.Generator(device=self.device).manual_seed(config.seed),
                          self.runner.noise_table(config.seed, config.init_scale, positions))
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
        return self.step_runner.capture_seconds

    # ---- one step

    def step(self) -> list[BatchEvent]:
        """Run the next step (the module doc); the tokens it chose. The first step that chooses tokens (or
        that leaves the batch idle) ends the prefill of `generate`'s batch (`prefill_seconds`, `decode_start`)."""
        if self.first_step is None:
            self.first_step = time.perf_counter()
        events = self._run_step()
        if (events or not self.busy) and self.decode_start is None:   # (a prefill alone chooses no token)
            sync(self.device)
            self.decode_start = time.perf_counter()
            self.prefill_seconds = self.decode_start - self.first_step
        return events

    def _run_step(self) -> list[BatchEvent]:
        events: list[BatchEvent] = []
        s, rows = self.scheduler, self.step_runner
        with torch.inference_mode():
            rows.drop(s.drop_cancelled())
            with self.phases.timed("admission and prompt prelude"):
                rows.admit(s.admit())
            starting, rounds = s.starting()
            if starting:
                s.start(starting)
                with self.phases.timed("prelude and s_0"):
                    for q, err in rows.start(starting):   # a value the rows cannot hold: its request fails alone
                        self._fail(q, err)
                        starting.remove(q)
            plan = s.plan(starting, rows.prompts(), rows.static, self.device.type != "cpu" or rows.static,
                          lambda: rows.done.tolist(), rounds)
            output = rows.run(plan)
            self._rounds(output, events)
            if plan.lockstep:
                s.done(list(plan.computing), output.steps)
                with self.phases.timed("coda and sampling"):
                    self._coda(list(plan.computing), events, lockstep=True)
                s.step_ran([])
                return events
            if rows.chunks:
                with self.phases.timed("prompt coda and first token"):
                    for requests, logits, cap in rows.end_prompts():
                        going_on = [j for j, q in enumerate(requests) if s.prefilled(q)]  # a prefill alone ends
                        if going_on and len(going_on) < len(requests):
                            requests, logits = [requests[j] for j in going_on], logits[self.runner.upload(going_on)]
                        if going_on:
                            self._choose(requests, logits, [cap] * len(requests), events)
            iterating = list(plan.iterating)
            if s.step_ran(iterating):
                s.looked(iterating, *rows.look(iterating))
            ready = s.with_status(Status.READY)
            if ready and s.coda_due(ready):
                with self.phases.timed("coda and sampling"):
                    self._coda(ready, events)
        return events

    def _rounds(self, output: StepOutput, events: list[BatchEvent]) -> None:
        """The rounds' tokens, each request's until it finishes (a round may overshoot). A speculative round's
        pending token and accepted drafts are in the cache; a wave writes its own entries."""
        for q, err in output.failed:
            self._fail(q, err)
        for done in output.rounds:
            q = done.request
            self.drafted, self.accepted = self.drafted + done.drafted, self.accepted + done.accepted
            if q.config.draft_steps is not None:
                q.length += len(done.tokens)
            going_on = all(self._chosen(q, token, steps, None, events) for token, steps in done.tokens)
            if going_on and done.exhausted:  # the wave ran out of room: the request ends with the tokens it has
                self.scheduler.free(q)
                if done.tokens:
                    events[-1] = dataclasses.replace(events[-1], finish_reason="length")
                going_on = False
            if not going_on:
                self.step_runner.end_round(q)

    @property
    def core_passes(self) -> int:
        return self.step_runner.core_passes

    @property
    def wave_steps(self) -> int:
        return self.step_runner.wave_steps

    def take_failures(self) -> list[tuple[int, Exception]]:
        """The requests that failed since the last call, each with its error (their rows are free)."""
        failures, self.failures = self.failures, []
        return failures

    def _fail(self, q: Request, err: Exception) -> None:
        """End one request with an error, alone: the others go on; its row is freed and wiped."""
        self.scheduler.free(q)
        self.step_runner.clear(q.row)
        self.step_runner.end_round(q)
        self.failures.append((q.id, err))

    def take_timings(self) -> dict[str, float]:
        """The seconds per phase accumulated since the last call (empty without `profile`)."""
        return self.phases.take()

    def _coda(self, requests: list[Request], events: list[BatchEvent], lockstep: bool = False) -> None:
        """The coda for rows whose token is done, together, and their next tokens."""
        logits = self.step_runner.coda(requests, lockstep)
        for q in requests:
            q.length += 1
        self._choose(requests, logits, [q.iteration for q in requests], events)

    def _choose(self, requests: list[Request], logits: Tensor, steps: list[int], events: list[BatchEvent]) -> None:
        """Choose each request's next token from its row of logits [n, V] (`choose_rows`); emit them in order;
        free the rows that finished."""
        chosen = choose_rows(logits, [q.config for q in requests], [q.generator for q in requests],
                             self.step_runner.seen, self.runner.upload([q.row for q in requests]), self.runner.upload)
        for j, q in enumerate(requests):
            if chosen[j] is None:
                self._fail(q, NonFiniteLogitsError(self.model, len(q.tokens) + 1))
                continue
            token, scored = chosen[j]
            self._chosen(q, token, steps[j], scored, events)

    def _chosen(self, q: Request, token: int, steps: int, scored: tuple | None, events: list[BatchEvent]) -> bool:
        """Emit a request's chosen token; whether the request goes on (it may finish, or fail alone)."""
        try:   # the request's own stop strings, decoded with the server's tokenizer
            reason = self.scheduler.chosen(q, token, steps, self.decode)
        except Exception as err:  # noqa: BLE001 (whatever it is, it is this request's alone)
            self._fail(q, err)
            return False
        events.append(BatchEvent(q.id, token, steps, reason, *((None, None) if scored is None else scored)))
        return reason is None
