"""The continuous batch's scheduler: which request does what at each step (rdlm.inference.batching). It holds
the requests and their rows, and decides admission, when a token runs in lockstep, which rows compute, when
the host looks at the exit flags, when a coda is due and how many iterations may run at once, and emits each
step's core work as a `StepPlan` for the step runner (rdlm.inference.step_runner); it owns no tensor of the
model and touches no device, so its tests drive it with made-up outcomes and no model.

A request moves through these states (`Status`):

    WAITING -> PREFILLING -> STARTING -> ITERATING -> READY -> STARTING ... -> finished (its row freed)

WAITING: queued for a row. PREFILLING: its prompt runs in chunks (rdlm.inference.prefill) until its first
token is chosen. STARTING: a token was chosen; the prelude and s_0 of the next position come at the next
step. ITERATING: the token's core iterations run, one per step (or all at once in lockstep). READY: the
token is done (an exit, or its cap), found so when the host looked; its coda is due. A request leaves its
row when its last token is chosen, when it fails or when it is cancelled; a request for no new tokens (a
prefill alone) when its prompt is in the cache.

A request that decodes in rounds (self-speculative decoding, the parallel sampler: `in_rounds`) goes
WAITING -> PREFILLING -> STARTING -> STARTING ...: each step runs one round from its pending token
(`StepPlan.rounds`), which chooses one or more tokens. A parallel request without a full prefill starts at
STARTING: its first wave is its prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from rdlm.inference.params import Decode, GenerationConfig
from rdlm.inference.request import Request, Status


@dataclass(frozen=True)
class Prompts:
    """The prompt chunks in flight as the scheduler weighs them (host numbers; the chunks themselves are the
    runner's, rdlm.inference.prefill)."""
    tokens: int          # their tokens in all (rows x chunk length)
    fewest_left: int     # the fewest iterations a chunk has left


@dataclass(frozen=True)
class StepPlan:
    """One step's core work, decided by the scheduler and carried out by the step runner
    (rdlm.inference.step_runner), which reads nothing else of the requests' schedule:

    - a lockstep token (`lockstep`): the `computing` requests started it together; all its `iterations`
      (= r) run in this step, exits decided on the device, then the coda;
    - otherwise `iterations` core iterations (1, or a power of two fused into one static call) of the
      `computing` requests, each at core cache slot `slots[j]` (its iteration mod its budget), the rows done on
      the device since the last look frozen where `may_be_frozen`, and `prompt_iterations` iterations of the
      prompt chunks in flight (the first in the same call as the rows, where the rows' call is eager).

    `iterating`: every request whose token is in progress, computing or not (the look reads their flags);
    `rounds`: requests that decode a round at a time in calls of their own: self-speculative decoding (a round
    of drafts and their verification from the pending token, rdlm.inference.speculative) and the parallel
    sampler (a step of its wavefront, rdlm.inference.parallel)."""
    iterating: tuple[Request, ...] = ()
    computing: tuple[Request, ...] = ()
    iterations: int = 1
    lockstep: bool = False
    slots: tuple[int, ...] = ()
    may_be_frozen: bool = False
    prompt_iterations: int = 0
    rounds: tuple[Request, ...] = ()


def in_rounds(config: GenerationConfig) -> bool:
    """Whether a request decodes a round at a time (`StepPlan.rounds`) rather than a token's iterations."""
    return config.draft_steps is not None or config.sampler == "parallel"


class Scheduler:
    """The requests of a batch of `max_batch` rows and the decisions of its steps (see the module doc).
    `exit_sync_every`: steps between the host's looks at the exit flags; `coda_every`: steps a done row may wait
    for others to run the coda with; `prefill_chunk`: prompt token-iterations per step."""

    def __init__(self, max_batch: int, exit_sync_every: int = 1, coda_every: int = 1, prefill_chunk: int = 256) -> None:
        self.max_batch, self.exit_sync_every, self.coda_every = max_batch, exit_sync_every, coda_every
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = [None] * max_batch
        self.cancelled: set[int] = set()
        self.steps_run = 0                    # steps run: the clock of the waits for a coda
        self.since_look = 0                   # steps since the host last read the exit flags

    # ---- requests

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def cancel(self, request: int) -> None:
        """Drop a request (waiting or running) at the next step's `drop_cancelled`."""
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
        """The request leaves its row (finished or failed)."""
        self.rows[request.row] = None

    def drop_cancelled(self) -> set[int]:
        """Remove the cancelled requests, waiting or in rows; returns their ids (the batch drops them from the
        prompt chunks in flight)."""
        dropped, self.cancelled = self.cancelled, set()
        if dropped:
            self.waiting = deque(q for q in self.waiting if q.id not in dropped)
            for q in self.active:
                if q.id in dropped:
                    self.free(q)
        return dropped

    def admit(self) -> dict[tuple[int, int], list[Request]]:
        """Waiting requests into free rows, in order; each starts prefilling with the cap of its first token.
        Returns them grouped by (cap, cache budget): each group's prompts prefill as one chunk."""
        groups: dict[tuple[int, int], list[Request]] = {}
        while self.waiting and None in self.rows:
            q = self.waiting.popleft()
            q.row = self.rows.index(None)
            self.rows[q.row] = q
            if q.config.sampler == "parallel" and not q.config.full_prefill:
                if q.config.max_new_tokens == 0:
                    self.free(q)             # nothing to prefill, nothing to decode
                else:
                    q.status = Status.STARTING   # its first wave is the prompt (rdlm.inference.parallel)
                continue
            q.cap, q.status = q.config.depth_cap(0, 0), Status.PREFILLING
            groups.setdefault((q.cap, q.budget), []).append(q)
        return groups

    # ---- the plan of a step

    def starting(self) -> tuple[list[Request], list[Request]]:
        """The requests whose chosen token is fed now: (those whose token starts its iterations, those that
        decode a round at a time: `StepPlan.rounds`)."""
        fed = self.with_status(Status.STARTING)
        return [q for q in fed if not in_rounds(q.config)], [q for q in fed if in_rounds(q.config)]

    def plan(self, starting: list[Request], prompts: Prompts | None, static: bool, rides_along: bool,
             done: Callable[[], list[bool]], rounds: list[Request] = ()) -> StepPlan:
        """The step's core work (`StepPlan`), once admission and the starts are done: the token the `starting`
        requests began in lockstep (`in_lockstep`), or the iterating requests' next iteration(s) (`computing`,
        `fusable`) and the prompts' share (`extra_prompt_iterations`). `prompts`: the chunks in flight, if any;
        `static`: the runner's step is the static one; `rides_along` and `done`: as `computing`. The planned
        iterations count as run (`ran`), as a plan is always carried out whole. `rounds`: the requests whose
        round runs in this step (`starting`)."""
        if starting and not rounds and self.in_lockstep(starting, prompts is not None):
            return StepPlan(tuple(starting), tuple(starting), starting[0].cap, lockstep=True)
        iterating = self.with_status(Status.ITERATING)
        computing = self.computing(iterating, rides_along, done)
        n = self.fusable(computing, static, prompts is not None) if computing else 1
        share = 0 if prompts is None else 1 + self.extra_prompt_iterations(
            prompts.tokens, prompts.fewest_left - 1, decoding=bool(computing))
        plan = StepPlan(tuple(iterating), tuple(computing), n, False, tuple(q.iteration % q.budget for q in computing),
                        self.may_be_done(computing), share, tuple(rounds))
        self.ran(computing, n)
        return plan

    # ---- a token's life

    def start(self, requests: list[Request]) -> None:
        """The requests' chosen tokens start: no iteration run yet, each with its cap (the depth budget's)."""
        for q in requests:
            q.iteration, q.status = 0, Status.ITERATING
            q.cap = q.config.depth_cap(len(q.tokens), q.spent)

    def prefilled(self, request: Request) -> bool:
        """The request's whole prompt is in the cache; its first token is chosen next (`chosen`). Whether it
        goes on: a request for no new tokens (a prefill alone) ends here."""
        request.length = len(request.prompt)
        if request.config.max_new_tokens == 0:
            self.free(request)
            return False
        return True

    def chosen(self, request: Request, token: int, steps: int, decode: Decode | None) -> str | None:
        """A token was chosen after `steps` iterations: the request goes on to start it, or ends (its finish
        reason, `GenerationConfig.finish_reason`; an error there, from its stop strings, is the caller's)."""
        request.tokens.append(token)
        request.spent += steps
        reason = request.config.finish_reason(request.tokens, request.spent, decode)
        if reason is not None:
            self.free(request)
        else:
            request.next_token, request.status = token, Status.STARTING
        return reason

    def ran(self, requests: list[Request], iterations: int = 1) -> None:
        """The iterating requests ran `iterations` more core iterations."""
        for q in requests:
            q.iteration += iterations

    def done(self, requests: list[Request], steps: list[int]) -> None:
        """The requests' tokens are done after `steps` iterations each (a lockstep token's end): the coda next."""
        for q, n in zip(requests, steps):
            q.iteration, q.status = n, Status.READY

    def in_lockstep(self, starting: list[Request], prompts_in_flight: bool) -> bool:
        """Whether the token the `starting` requests just started runs in lockstep, all its iterations in this
        step (rdlm.inference.lockstep): every request in a row starts it, with the same depth settings and
        no depth budget, and no prompt is being prefilled or waits for a free row (`generate`'s batch)."""
        if prompts_in_flight or (self.waiting and None in self.rows) or len(starting) != self.running:
            return False
        depth = lambda q: (q.config.num_steps, q.criterion, q.config.min_steps, q.config.exit_every,  # noqa: E731
                           q.budget, q.cap)
        first = starting[0]
        return (not first.config.has_depth_budget and first.cap == first.config.num_steps
                and all(depth(q) == depth(first) for q in starting[1:]))

    def computing(self, iterating: list[Request], rides_along: bool, done: Callable[[], list[bool]]) -> list[Request]:
        """The iterating requests the next core call computes. A row done on the device since the last look
        rides along frozen where reading the flags would cost (`rides_along`: a static step, or a GPU, where
        a read waits for the queued work); otherwise (`done()` reads each row's flag) it leaves the call at
        once. Either way it stays ITERATING until the look, so its coda (and every token) comes at the same
        step."""
        if (self.since_look == 0 or rides_along
                or not any(q.criterion is not None and not q.criterion.spec.exact for q in iterating)):
            return iterating
        flags = done()
        return [q for q in iterating if not flags[q.row]]

    def may_be_done(self, requests: list[Request]) -> bool:
        """Whether a row of `requests` may be done on the device: not right after a look (nobody is), later
        only a row with an exit criterion or at its cap."""
        return self.since_look > 0 and any(q.criterion is not None or q.iteration >= q.cap for q in requests)

    def step_ran(self, iterating: list[Request]) -> bool:
        """A step ended: whether the host looks at the exit flags now (every `exit_sync_every` steps, or at once
        when a row is surely done: at its cap)."""
        self.steps_run += 1
        if not iterating:
            return False
        self.since_look += 1
        if self.since_look >= self.exit_sync_every or any(q.iteration >= q.cap for q in iterating):
            self.since_look = 0
            return True
        return False

    def looked(self, requests: list[Request], finished: list[bool], steps: list[int]) -> None:
        """What the look found: the requests whose token is done leave the core's calls and wait for their coda."""
        for q, is_done, n in zip(requests, finished, steps):
            if is_done:
                q.status, q.ready_since, q.iteration = Status.READY, self.steps_run, n

    def coda_due(self, ready: list[Request]) -> bool:
        """Whether the rows whose token is done run their coda now: once one has waited `coda_every` - 1
        steps, or half the decoding rows wait, or no other row can be done before then (a row with an
        exit criterion may exit any time; one without ends at its cap)."""
        decoding = [q for q in self.active if q.status is not Status.PREFILLING]
        wait = self.coda_every - 1 - (self.steps_run - min(q.ready_since for q in ready))
        if wait <= 0 or 2 * len(ready) >= len(decoding):
            return True
        return not any(q.status is Status.ITERATING and (q.criterion is not None or q.cap - q.iteration <= wait)
                       for q in decoding)

    def fusable(self, requests: list[Request], static: bool, prompts_in_flight: bool) -> int:
        """How many core iterations the next step may run at once (1: the usual one). With the static step,
        when nothing can change between iterations but the iteration counts (no row with an exit criterion,
        no prompt in flight or able to join, no row waiting for its coda), the largest power of two that
        no row's cap cuts short."""
        if (not static or prompts_in_flight or (self.waiting and None in self.rows)
                or any(q.criterion is not None for q in requests) or len(requests) < self.running):
            return 1
        left = min(q.cap - q.iteration for q in requests)
        return 1 << (left.bit_length() - 1) if left > 1 else 1

    def extra_prompt_iterations(self, chunk_tokens: int, iterations_left: int, decoding: bool) -> int:
        """Prompt iterations to run beyond the step's one, in calls of their own: the prompts' share of a step
        is `prefill_chunk` token-iterations, so chunks of `chunk_tokens` (all together) fewer tokens run more,
        and a short prompt's first token comes within a few steps. With no row decoding (`decoding` False)
        nobody waits: they run on until a chunk is done (`iterations_left`: the fewest a chunk has left)."""
        extra = self.prefill_chunk // chunk_tokens - 1
        return extra if decoding else max(extra, iterations_left)
