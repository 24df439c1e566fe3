"""The seam between the continuous batch's scheduler and its step runner (rdlm.inference.batching): what the
scheduler decides a step does (`StepPlan`), what carrying it out gives back (`StepOutput`), and the engine's
settings both read (`EngineSettings`). A step is three calls:

    plan = scheduler.schedule()       # admissions, prompt chunks, starts, iterations, rounds, the look, codas
    out = step_runner.execute(plan)   # every model call and tensor of the step
    events = scheduler.update(out)    # tokens chosen -> finish reasons, the look's findings -> codas due

Everything here is plain host data: request ids, rows, numbers, configs. The runner copies what it needs
into its own per-row state when a request is admitted (`Admission`), and never sees a scheduler's
`Request`; the scheduler never sees a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.params import GenerationConfig


@dataclass(frozen=True)
class EngineSettings:
    """The continuous batch's settings, stored once and read by its parts (the scheduler, the step runner).

    `max_batch` rows over a cache of `max_length` entries and `num_slots` core slots per row;
    `exit_sync_every`: steps between the host's looks at the exit flags; `coda_every`: steps a done row may
    wait for others to run the coda with; `prefill_chunk`: prompt token-iterations per step; `static`: the
    rows' iterations run as static steps (CUDA graphs on CUDA); `rides_along`: a row done on the device
    since the last look stays in the core's calls, frozen (a static step, or a device where reading the
    flags waits for the queued work); `lockstep`: a token every row starts together may run all its iterations
    in one call (rdlm.inference.runner.lockstep; off where the static step is compiled for the CPU, which runs every
    token through it)."""

    max_batch: int
    max_length: int
    num_slots: int
    exit_sync_every: int = 1
    coda_every: int = 1
    prefill_chunk: int = 256
    static: bool = False
    rides_along: bool = False
    lockstep: bool = True


@dataclass(frozen=True)
class Admission:
    """A request entering row `row`: what the runner keeps of it for its life there (its own copy)."""

    request: int
    row: int
    prompt: tuple[int, ...]
    config: GenerationConfig
    criterion: ExitCriterion | None
    budget: int  # core cache slots the request cycles through
    positions: int  # buffer entries whose s_0 the request may use (its noise table's length)


@dataclass(frozen=True)
class ChunkSpec:
    """A chunk of prompts that begins prefilling (rdlm.inference.runner.prefill): the requests' tokens
    start .. start + lengths[j] - 1, right-padded to the longest; `cap` iterations over `budget` slots."""

    chunk: int  # its id, the key of both sides' views of it
    requests: tuple[int, ...]
    start: int
    lengths: tuple[int, ...]
    cap: int
    budget: int
    n: int  # the tokens of each row: the longest's (padded so still when others left)


@dataclass(frozen=True)
class Start:
    """A chosen token fed at buffer index `position` of `row`: its prelude and s_0; it may run `cap` iterations."""

    request: int
    row: int
    token: int
    position: int
    cap: int


@dataclass(frozen=True)
class Iterating:
    """A row whose token is in progress: it has run `iteration` iterations (as the host counts them) of `cap`."""

    request: int
    row: int
    position: int
    iteration: int
    cap: int


@dataclass(frozen=True)
class RoundSpec:
    """A request's round (self-speculative decoding, a parallel sampler's wave step) from its pending token
    `token` at `position`."""

    request: int
    row: int
    token: int
    position: int


@dataclass(frozen=True)
class Coda:
    """When the rows whose token is done run their coda at the end of the step, decided by the scheduler
    before the step as a rule over what the look finds (`due`). `waiting`: (row, iterations run) of the rows
    that were found done before; the look adds the rows it finds. It runs when some row is done and one of:
    `now` (a row waited long enough), half the rows `decoding` wait, or none of `blockers` (the rows that
    could still be done before the wait ends) is still iterating. `decoding` counts the rows decoding as the
    step begins; the runner adds the first tokens that go on and drops the rounds that failed or ran out of
    room (`due`'s `decoding`). A request that a round's tokens, or a first token's stop string, end in this
    step still counts: the coda may then wait one step longer, which changes no token."""

    waiting: tuple[tuple[int, int], ...] = ()
    now: bool = False
    decoding: int = 0
    blockers: tuple[int, ...] = ()

    def due(self, found: set[int], decoding: int | None = None) -> bool:
        """Whether the coda runs, once the look found the rows `found` done (`decoding`: the rows decoding
        then, where the step changed `self.decoding`)."""
        done = len(self.waiting) + len(found)
        if not done:
            return False
        decoding = self.decoding if decoding is None else decoding
        return self.now or 2 * done >= decoding or all(row in found for row in self.blockers)


@dataclass(frozen=True)
class StepPlan:
    """Everything one step does, in the order the runner carries it out:

    1. `wipe`: rows freed by a failure (their cache and state zeroed before anyone reuses them);
    2. `admitted`: requests entering rows, and `chunks`: the prompt chunks that begin prefilling; `dropped`:
       requests gone (cancelled, failed or finished) whose runner state goes;
    3. `starts`: the tokens fed now (prelude, s_0);
    4. `rounds`: requests that decode a round at a time, each in calls of their own;
    5. the core: a `lockstep` token (the `iterating` rows started it together: all its `iterations` in this
       step, exits decided on the device, then the coda), or `iterations` core iterations (1, or a power of
       two fused into one static call) of the `iterating` rows, with `prompt_iterations` iterations of the
       prompt chunks in flight (`prompts`, in order; `prompt_iterations_alone` when no row computes);
       `peek`: a row done on the device since the last look leaves the call (its flag is read for free);
       `since_look`: a row may be done on the device;
    6. the prompt chunks that ran their iterations: their coda, and the first token of each request whose
       prompt ends there;
    7. the look: the host reads the iterating rows' exit flags when `look_due` (every `exit_sync_every`
       steps) or when a row that computed reached its cap; `coda`: when the done rows run their coda."""

    wipe: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    admitted: tuple[Admission, ...] = ()
    chunks: tuple[ChunkSpec, ...] = ()
    starts: tuple[Start, ...] = ()
    rounds: tuple[RoundSpec, ...] = ()
    iterating: tuple[Iterating, ...] = ()
    lockstep: bool = False
    iterations: int = 1
    peek: bool = False
    since_look: bool = False
    prompts: tuple[int, ...] = ()
    prompt_iterations: int = 0
    prompt_iterations_alone: int = 0
    look_due: bool = False
    coda: Coda = field(default_factory=Coda)


@dataclass
class Chosen:
    """A token the runner chose for a request after `iterations` iterations (with its scores when asked), or
    the request's failure (`error`: its logits were not finite)."""

    request: int
    token: int = -1
    iterations: int = 0
    scored: tuple | None = None
    error: Exception | None = None


@dataclass
class RoundOutput:
    """A request's round: the tokens that became final, each with the iterations run at the position that
    chose it; a speculative round's drafts and accepted drafts; whether a parallel sampler's wave ran out of
    room (the request can give no more tokens); or the round's failure."""

    request: int
    tokens: list[tuple[int, int]] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    exhausted: bool = False
    error: Exception | None = None


@dataclass
class StepOutput:
    """What carrying out a plan gives back, in the order the scheduler takes it: the rounds; a lockstep
    token's next tokens (`lockstep`); the prompt chunks that ended (`ended`, in order) after the prompts ran
    `prompt_iterations`, and the first tokens chosen there (`first`); the requests whose rows iterated
    (`computed`); what the look found (`found`: request -> iterations run, for the rows whose token is done;
    None when the host did not look); and the tokens the done rows' coda chose (`coda`, empty when it was
    not due)."""

    rounds: list[RoundOutput] = field(default_factory=list)
    lockstep: list[Chosen] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    prompt_iterations: int = 0
    first: list[Chosen] = field(default_factory=list)
    computed: tuple[int, ...] = ()
    found: dict[int, int] | None = None
    coda: list[Chosen] = field(default_factory=list)
