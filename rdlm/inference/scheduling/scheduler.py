"""The continuous batch's scheduler: which request does what at each step (rdlm.inference.batching). It holds
the requests, their rows and the prompt chunks in flight as host numbers, decides admission, when a token
runs in lockstep, which rows compute, when the host looks at the exit flags, when a coda is due and how many
iterations may run at once, and says it all in one `StepPlan` per step (rdlm.inference.scheduling.plan); `update` takes
what the step runner gives back. It owns no tensor and touches no device, so its tests drive it with made-up
outcomes and no model.

A request moves through these states (`Status`):

    WAITING -> PREFILLING -> STARTING -> ITERATING -> AWAITING_CODA -> STARTING ... -> finished (row freed)

WAITING: queued for a row. PREFILLING: its prompt runs in chunks (rdlm.inference.runner.prefill) until its first
token is chosen. STARTING: a token was chosen; the prelude and s_0 of the next position come at the next
step (with the static step, a fixed-depth token waits until the rows iterating, all at one iteration of
their tokens, end theirs, so that the batch stays in one phase: `_hold_for_phase`). ITERATING: the token's
core iterations run, one per step (several fused into a static step's call: `fusable`; or all at once in
lockstep). AWAITING_CODA: the token stopped iterating (an exit, or its cap), found so when the host looked;
its coda comes when due. A request leaves its row when
its last token is chosen, when it fails or when it is cancelled; a request for no new tokens (a prefill
alone) when its prompt is in the cache.

A request that decodes in rounds (self-speculative decoding, the parallel sampler: `in_rounds`) goes
WAITING -> PREFILLING -> STARTING -> STARTING ...: each step runs one round from its pending token
(`StepPlan.rounds`), which chooses one or more tokens. A parallel request without a full prefill starts at
STARTING: its first wave is its prompt.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, replace

from rdlm.checks import is_int
from rdlm.inference.events import BatchEvent
from rdlm.inference.exits.track import at_cap
from rdlm.inference.params import Decode, GenerationConfig
from rdlm.inference.scheduling.plan import (
    Admission,
    Chosen,
    ChunkSpec,
    Done,
    EngineSettings,
    Iterating,
    RoundSpec,
    Start,
    StepOutput,
    StepPlan,
)
from rdlm.inference.scheduling.request import Request, Status

# What a prompt chunk costs beyond its tokens, in prompt tokens: each chunk runs its own prelude and coda calls
# and its own attention in every packed core iteration. Prompts admitted together are split into chunks of
# similar lengths where that saves more padding than this (`length_groups`). Chosen among 0, 8, 32 and one chunk
# on two cores with the `small` preset (8 short prompts of 4-30 tokens: 8 was fastest, one chunk 1.6x slower);
# benchmarks/bench_admission.py measures it against one chunk.
CHUNK_COST = 8


def length_groups(lengths: list[int], cost: float) -> list[list[int]]:
    """The indices of prompts of `lengths` tokens split into chunks, each padded to its longest prompt, that
    cost the fewest tokens in all (padding included) when each chunk costs `cost` tokens more: the optimum
    over groups of neighbours in length order (a dynamic programme, quadratic in the number of prompts). Each
    group lists its indices in order, and the groups come in the order of their first indices.

        length_groups([5, 4, 30, 5], 8) == [[0, 1, 3], [2]]    (one chunk of 3 x 5 tokens, one of 30)
        length_groups([5, 4, 30, 5], 100) == [[0, 1, 2, 3]]    (one chunk of 4 x 30)
    """
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    best = [0.0] + [float("inf")] * len(order)  # best[i]: the cost of the i longest prompts
    cut = [0] * (len(order) + 1)  # where the last group of best[i] begins
    for i in range(1, len(order) + 1):
        for j in range(i):  # a group of order[j:i], padded to order[j]'s length
            total = best[j] + (i - j) * lengths[order[j]] + cost
            if total < best[i]:
                best[i], cut[i] = total, j
    groups, i = [], len(order)
    while i:
        groups.append(sorted(order[cut[i] : i]))
        i = cut[i]
    return sorted(groups)


def in_rounds(config: GenerationConfig) -> bool:
    """Whether a request decodes a round at a time (`StepPlan.rounds`) rather than a token's iterations."""
    return config.draft_steps is not None or config.sampler == "parallel"


@dataclass
class Chunk:
    """A prompt chunk in flight as the scheduler counts it (its tensors are the runner's)."""

    spec: ChunkSpec
    requests: list[Request]
    iteration: int = 0

    @property
    def left(self) -> int:
        return self.spec.cap - self.iteration


class Scheduler:
    """The requests of a batch and the decisions of its steps (see the module doc), by `settings`."""

    def __init__(self, settings: EngineSettings, decode: Decode | None = None) -> None:
        self.settings, self.decode = settings, decode
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = [None] * settings.max_batch
        self.cancelled: set[int] = set()
        self.chunks: list[Chunk] = []  # prompts being prefilled, in the order their iterations run
        self.chunk_ids = itertools.count()
        self.clock = 0  # core iterations run by the steps (one a step, or those fused): the waits for a coda
        self.since_look = 0  # core iterations run since the host last read the exit flags
        self.failures: list[tuple[int, Exception]] = []  # requests that failed alone, for the engine's caller
        self.drafted = self.accepted = 0  # self-speculative decoding's drafts, in all
        self._wipe: list[int] = []  # rows freed by a failure since the last plan
        self._gone: list[int] = []  # requests that left since the last plan
        self.holding = 0  # tokens held back this step to start in phase with the iterating rows (`starting`)
        self._next_chunks: list[ChunkSpec] = []  # chunks begun after others ended, for the next plan
        self._narrowed: list[tuple[ChunkSpec, tuple[int, ...]]] = []  # chunks in flight that lost requests

    # ---- requests

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def cancel(self, request: int) -> None:
        """Drop a request (waiting or running) at the next step."""
        self.cancelled.add(request)

    @property
    def active(self) -> list[Request]:
        return [q for q in self.rows if q is not None]

    def with_status(self, status: Status) -> list[Request]:
        return [q for q in self.rows if q is not None and q.status is status]

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(q is not None for q in self.rows)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return sum(q is not None for q in self.rows)

    def free(self, request: Request) -> None:
        """The request leaves its row (finished, failed or cancelled); the runner forgets it at the next step."""
        self.rows[request.row] = None
        self._gone.append(request.id)

    def fail(self, request: Request, err: Exception) -> None:
        """End one request with an error, alone: its row is freed and wiped before anyone reuses it."""
        self.free(request)
        self._wipe.append(request.row)
        self.failures.append((request.id, err))

    # ---- the plan of a step

    def schedule(self) -> StepPlan:
        """The next step's plan (`StepPlan`): drop the cancelled, admit the waiting, start the chosen tokens,
        then the core's work and the rules for what follows it. The planned iterations count as run for the
        rows the runner computes (`update`)."""
        self._drop_cancelled()
        admitted, chunks = self._admit()
        chunks, self._next_chunks = (*self._next_chunks, *chunks), []
        starting, rounds = self.starting()
        starting = self.start(starting)
        wipe, self._wipe = tuple(self._wipe), []
        gone, self._gone = tuple(self._gone), []
        narrowed, self._narrowed = tuple(self._narrowed), []
        starts = tuple(Start(q.id, q.row, q.next_token, q.length, q.cap) for q in starting)
        round_specs = tuple(RoundSpec(q.id, q.row, q.next_token, q.length) for q in rounds)
        base = StepPlan(
            wipe=wipe,
            dropped=gone,
            narrowed=narrowed,
            admitted=admitted,
            chunks=chunks,
            starts=starts,
            rounds=round_specs,
        )
        if starting and not rounds and self.in_lockstep(starting, bool(self.chunks)):
            return replace(base, iterating=self._iterating(starting), lockstep=True, iterations=starting[0].cap)
        return self._plan_iterations(base)

    def _plan_iterations(self, base: StepPlan) -> StepPlan:
        """A step that runs the iterating rows' next iteration(s) and the prompts' share of iterations."""
        s = self.settings
        iterating = self.with_status(Status.ITERATING)
        peek = (
            self.since_look > 0
            and not s.rides_along
            and any(q.criterion is not None and not q.criterion.spec.exact for q in iterating)
        )
        n = self.fusable(iterating, bool(self.chunks)) if iterating and not peek else 1
        share = alone = 0
        if self.chunks:
            tokens = sum(len(c.spec.requests) * c.spec.n for c in self.chunks)
            fewest_left = min(c.left for c in self.chunks)
            share = 1 + self.extra_prompt_iterations(tokens, fewest_left - 1, decoding=True)
            alone = 1 + self.extra_prompt_iterations(tokens, fewest_left - 1, decoding=False)
        return replace(
            base,
            iterating=self._iterating(iterating),
            iterations=n,
            peek=peek,
            since_look=self.since_look > 0,
            prompts=tuple(c.spec.chunk for c in self.chunks),
            prompt_iterations=share if iterating else alone,
            prompt_iterations_alone=alone,
            look=any(q.criterion is not None for q in iterating) and self.since_look + n >= s.exit_sync_every,
            look_at_cap=tuple(q.id for q in iterating if at_cap(q.iteration + n, q.cap)),
        )

    def _iterating(self, requests: list[Request]) -> tuple[Iterating, ...]:
        return tuple(Iterating(q.id, q.row, q.length, q.iteration, q.cap) for q in requests)

    def starting(self) -> tuple[list[Request], list[Request]]:
        """The requests whose chosen token is fed now: (those whose token starts its iterations, those that
        decode a round at a time: `StepPlan.rounds`)."""
        fed = self.with_status(Status.STARTING)
        tokens = [q for q in fed if not in_rounds(q.config)]
        self.holding = len(tokens) if self._hold_for_phase(tokens) else 0
        return ([] if self.holding else tokens), [q for q in fed if in_rounds(q.config)]

    def _hold_for_phase(self, starting: list[Request]) -> bool:
        """Whether the tokens `starting` wait for the rows iterating now to end theirs, so that all start
        together: with the static step, a fixed-depth batch whose rows stand at the same iteration of their
        tokens runs their remaining iterations in fused calls (`fusable`) and their codas and preludes in
        one call each; a token started between would split the rows into two phases for the rest of their
        requests (each token a few fused iterations and two codas). It waits at most the iterations those
        rows have left, fewer than a token's."""
        if not (starting and self.settings.static) or any(q.criterion is not None for q in starting):
            return False
        iterating = self.with_status(Status.ITERATING)
        if not iterating or any(q.criterion is not None for q in iterating):
            return False
        left = {q.cap - q.iteration for q in iterating}
        return len(left) == 1 and min(left) > 0

    def _drop_cancelled(self) -> None:
        """Remove the cancelled requests, waiting, prefilling or in rows."""
        dropped, self.cancelled = self.cancelled, set()
        if not dropped:
            return
        self.waiting = deque(q for q in self.waiting if q.id not in dropped)
        for q in self.active:
            if q.id in dropped:
                self.free(q)
        pending = {spec.chunk for spec in self._next_chunks}  # not begun by the runner yet: begun as they are now
        for chunk in list(self.chunks):
            keep = tuple(j for j, q in enumerate(chunk.requests) if q.id not in dropped)
            if len(keep) < len(chunk.requests):  # it goes on without them, last
                self.chunks.remove(chunk)
                chunk.spec, chunk.requests = chunk.spec.keep(keep), [chunk.requests[j] for j in keep]
                if keep:
                    self.chunks.append(chunk)
                if chunk.spec.chunk not in pending:  # the runner's chunk follows
                    self._narrowed.append((chunk.spec, keep))
        self._next_chunks = [c.spec for c in self.chunks if c.spec.chunk in pending]

    def _admit(self) -> tuple[tuple[Admission, ...], tuple[ChunkSpec, ...]]:
        """Waiting requests into free rows, in order; each starts prefilling with the cap of its first token,
        those with the same (cap, cache budget) together, in chunks of similar lengths (`_begin_chunks`)."""
        admitted: list[Admission] = []
        groups: dict[tuple[int, int], list[Request]] = {}
        while self.waiting and None in self.rows:
            q = self.waiting.popleft()
            q.row = self.rows.index(None)
            self.rows[q.row] = q
            if q.config.sampler == "parallel" and not q.config.full_prefill and q.config.max_new_tokens == 0:
                self.rows[q.row] = None  # nothing to prefill, nothing to decode
                continue
            positions = self.settings.max_length if in_rounds(q.config) else len(q.prompt) + q.config.max_new_tokens
            admitted.append(Admission(q.id, q.row, tuple(q.prompt), q.config, q.criterion, q.budget, positions))
            if q.config.sampler == "parallel" and not q.config.full_prefill:
                q.status = Status.STARTING  # its first wave is the prompt (rdlm.inference.runner.parallel)
                continue
            q.cap, q.status = q.config.depth_cap(0, 0), Status.PREFILLING
            groups.setdefault((q.cap, q.budget), []).append(q)
        chunks = [self._begin_chunks(group, 0, cap, budget) for (cap, budget), group in groups.items()]
        return tuple(admitted), tuple(spec for specs in chunks for spec in specs)

    def _begin_chunks(self, requests: list[Request], start: int, cap: int, budget: int) -> list[ChunkSpec]:
        """The requests' next chunks of prompt: at most `prefill_chunk` tokens each, or the whole rest when they
        cycle through fewer cache slots than the prefill runs iterations (a later chunk reads the earlier
        chunks' keys of the same iteration); grouped by length (`length_groups`), so that a short prompt is not
        padded to a long one's length."""
        whole = budget < cap
        lengths = [
            len(q.prompt) - start if whole else min(len(q.prompt) - start, self.settings.prefill_chunk)
            for q in requests
        ]
        return [
            self._begin_chunk([requests[j] for j in group], start, tuple(lengths[j] for j in group), cap, budget)
            for group in length_groups(lengths, CHUNK_COST)
        ]

    def _begin_chunk(
        self, requests: list[Request], start: int, lengths: tuple[int, ...], cap: int, budget: int
    ) -> ChunkSpec:
        """One chunk of `lengths[j]` prompt tokens of request j from `start`."""
        ends = tuple(start + length == len(q.prompt) for q, length in zip(requests, lengths, strict=True))
        chooses = tuple(end and q.config.max_new_tokens > 0 for q, end in zip(requests, ends, strict=True))
        ids = tuple(q.id for q in requests)
        spec = ChunkSpec(next(self.chunk_ids), ids, start, lengths, cap, budget, max(lengths), ends, chooses)
        self.chunks.append(Chunk(spec, list(requests)))
        return spec

    def start(self, requests: list[Request]) -> list[Request]:
        """The requests' chosen tokens start: no iteration run yet, each with its cap (the depth budget's). A
        request whose numbers do not fit the runner's rows (a long: the declared bounds keep every value far
        inside it, so this is the failure path of one that escaped them) fails alone; the others start."""
        started = []
        for q in requests:
            q.iteration, q.status = 0, Status.ITERATING
            q.cap = q.config.depth_cap(len(q.tokens), q.spent)
            values = {"cap": q.cap, "min_steps": q.config.min_steps, "budget": q.budget}
            wrong = [f"{name} = {v}" for name, v in values.items() if not is_int(v, -(2**63), 2**63)]
            if wrong:
                self.fail(q, OverflowError(f"{', '.join(wrong)} does not fit the engine's rows (a 64-bit integer)"))
            else:
                started.append(q)
        return started

    def in_lockstep(self, starting: list[Request], prompts_in_flight: bool) -> bool:
        """Whether the token the `starting` requests just started runs in lockstep, all its iterations in this
        step (rdlm.inference.runner.lockstep): every request in a row starts it, with the same depth settings and
        no depth budget, and no prompt is being prefilled or waits for a free row (`generate`'s batch)."""
        if not self.settings.lockstep or prompts_in_flight or (self.waiting and None in self.rows):
            return False
        if len(starting) != self.running:
            return False

        def depth(q: Request) -> tuple:
            return (q.config.num_steps, q.criterion, q.config.min_steps, q.config.exit_every, q.budget, q.cap)

        first = starting[0]
        return (
            not first.config.has_depth_budget
            and first.cap == first.config.num_steps
            and all(depth(q) == depth(first) for q in starting[1:])
        )

    def fusable(self, requests: list[Request], prompts_in_flight: bool) -> int:
        """How many core iterations the next step may run at once (1: the usual one). With the static step, when
        nothing can change between iterations but what the step decides on the device (the counts, and the
        exits of state-only criteria, which it reads itself: rdlm.inference.runner.row_exits) and no prompt is in
        flight or able to join: the largest power of two that no row's cap cuts short, nor the wait of a row
        found done for its coda, nor, with an exit criterion, the host's next look (`exit_sync_every`
        iterations after the last)."""
        s = self.settings
        criteria = [q.criterion for q in requests if q.criterion is not None]
        if (
            not s.static
            or prompts_in_flight
            or (self.waiting and None in self.rows)
            or any(not c.spec.state_only for c in criteria)
        ):
            return 1
        left = min(q.cap - q.iteration for q in requests)
        if criteria:
            left = min(left, s.exit_sync_every - self.since_look)
        if len(requests) + self.holding < self.running:  # rows wait for their coda (or decode in rounds)
            done = self.with_status(Status.AWAITING_CODA)
            if len(requests) + self.holding + len(done) < self.running:
                return 1
            left = min(left, self._coda_wait(done))
        return 1 << (left.bit_length() - 1) if left > 1 else 1

    def extra_prompt_iterations(self, chunk_tokens: int, iterations_left: int, decoding: bool) -> int:
        """Prompt iterations to run beyond the step's one, in calls of their own: the prompts' share of a step
        is `prefill_chunk` token-iterations, so chunks of `chunk_tokens` (all together) fewer tokens run more,
        and a short prompt's first token comes within a few steps. With no row decoding (`decoding` False)
        nobody waits: they run on until a chunk is done (`iterations_left`: the fewest a chunk has left)."""
        extra = self.settings.prefill_chunk // chunk_tokens - 1
        return extra if decoding else max(extra, iterations_left)

    # ---- what a step gave back

    def update(self, plan: StepPlan, out: StepOutput) -> list[BatchEvent]:
        """Take the outcome of carrying out `plan` (this scheduler's last): each request's chosen tokens (it goes
        on or ends), the prompts' progress, the iterations run, what the look found (those rows now await their
        coda: `coda_due`). Returns the tokens as events, in the order they were chosen."""
        events: list[BatchEvent] = []
        for done in out.rounds:
            self._round(done, events)
        self.clock += plan.iterations
        if plan.lockstep:
            return self.coda_ran(out.lockstep)
        ended = set(out.ended)
        for chunk in list(self.chunks):
            if chunk.spec.chunk in ended:
                self._end_chunk(chunk)
            elif chunk.spec.chunk in plan.prompts:
                chunk.iteration += out.prompt_iterations
        for c in out.first:
            self._chosen(self._by_id(c.request), c, events)
        computed = set(out.computed)
        for q in self.with_status(Status.ITERATING):
            if q.id in computed:
                q.iteration += plan.iterations
        if plan.iterating:
            self.since_look += plan.iterations
        if out.found is not None:
            self.since_look = 0
            for q in self.with_status(Status.ITERATING):
                if q.id in out.found:
                    q.status, q.stopped_at, q.iteration = Status.AWAITING_CODA, self.clock, out.found[q.id]
        return events

    def coda_due(self) -> tuple[Done, ...] | None:
        """The rows found done whose coda runs now (in the order of the rows), or None: once one has waited
        `coda_every` - 1 core iterations, or half the decoding rows wait, or no row still iterating could be done
        before the wait ends (a row with an exit criterion may exit any time; one without ends at its cap)."""
        done = self.with_status(Status.AWAITING_CODA)
        if not done:
            return None
        wait = self._coda_wait(done)
        decoding = sum(q.status is not Status.PREFILLING for q in self.active)
        blocked = any(
            q.criterion is not None or q.cap - q.iteration <= wait for q in self.with_status(Status.ITERATING)
        )
        if wait > 0 and 2 * len(done) < decoding and blocked:
            return None
        return tuple(Done(q.id, q.row, q.length, q.iteration) for q in done)  # (rows hold them in order)

    def _coda_wait(self, done: list[Request]) -> int:
        """The core iterations the rows found done (`done`) may still wait for their coda."""
        return self.settings.coda_every - 1 - (self.clock - min(q.stopped_at for q in done))

    def coda_ran(self, chosen: list[Chosen]) -> list[BatchEvent]:
        """A coda ran over these requests' done tokens (each now in the cache) and chose their next tokens; the
        tokens as events."""
        events: list[BatchEvent] = []
        for c in chosen:
            q = self._by_id(c.request)
            q.length, q.iteration = q.length + 1, c.iterations
            self._chosen(q, c, events)
        return events

    def _by_id(self, request: int) -> Request:
        return next(q for q in self.rows if q is not None and q.id == request)

    def _end_chunk(self, chunk: Chunk) -> None:
        """A chunk ran its iterations: each prompt it ended is in the cache (a prefill alone ends there), the
        others go on with their next chunk."""
        self.chunks.remove(chunk)
        spec, going_on = chunk.spec, []
        for q, ends, chooses in zip(chunk.requests, spec.ends, spec.chooses, strict=True):
            if not ends:
                going_on.append(q)
                continue
            q.length = len(q.prompt)
            if not chooses:  # a prefill alone
                self.free(q)
        if going_on:
            self._next_chunks += self._begin_chunks(going_on, spec.start + spec.n, spec.cap, spec.budget)

    def _round(self, done, events: list[BatchEvent]) -> None:
        """A round's tokens, the request's until it finishes (a round may overshoot). A speculative round's
        pending token and accepted drafts are in the cache; a wave writes its own entries."""
        q = self._by_id(done.request)
        if done.error is not None:
            self.fail(q, done.error)
            return
        self.drafted, self.accepted = self.drafted + done.drafted, self.accepted + done.accepted
        if q.config.draft_steps is not None:
            q.length += len(done.tokens)
        going_on = all(self._chosen(q, Chosen(q.id, token, steps), events) for token, steps in done.tokens)
        if going_on and done.exhausted:  # the wave ran out of room: the request ends with the tokens it has
            self.free(q)
            if done.tokens:
                last = events[-1]
                events[-1] = dataclasses.replace(last, finish_reason="length")

    def _chosen(self, q: Request, c: Chosen, events: list[BatchEvent]) -> bool:
        """A token chosen for `q` (or its failure): it goes on to start it, or ends (its finish reason,
        `GenerationConfig.finish_reason`, through the engine's `decode` for stop strings); whether it goes on."""
        if c.error is not None:
            self.fail(q, c.error)
            return False
        q.tokens.append(c.token)
        q.spent += c.iterations
        try:  # the request's own stop strings, decoded with the engine's tokenizer
            reason = q.config.finish_reason(q.tokens, q.spent, self.decode)
        except Exception as err:  # noqa: BLE001 (whatever it is, it is this request's alone)
            self.fail(q, err)
            return False
        if reason is not None:
            self.free(q)
        else:
            q.next_token, q.status = c.token, Status.STARTING
        logprob, top = (None, None) if c.scored is None else c.scored
        cap = q.config.num_steps if in_rounds(q.config) else q.cap  # a round's positions run up to r
        events.append(BatchEvent(q.id, c.token, c.iterations, reason, logprob, top, cap))
        return reason is None
