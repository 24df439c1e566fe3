"""The seam between the continuous batch's scheduler and its step runner (rdlm.inference.batching): what the
scheduler decides a step does (`StepPlan`), what carrying it out gives back (`StepOutput`), the coda the
scheduler then finds due (`Done` rows), and the engine's settings both read (`EngineSettings`). A step is:

    plan = scheduler.schedule()            # admissions, prompt chunks, starts, iterations, rounds, the look
    out = step_runner.execute(plan)        # every model call and tensor of the step
    events = scheduler.update(plan, out)   # tokens chosen -> finish reasons, the look's findings -> done rows
    done = scheduler.coda_due()            # the done rows whose coda runs now, or None
    events += scheduler.coda_ran(step_runner.coda(done))   # (when due) their next tokens

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
    `exit_sync_every`: core iterations between the host's looks at the exit flags; `coda_every`: core
    iterations a done row may wait for others to run the coda with (a step runs one, or several fused);
    `prefill_chunk`: prompt token-iterations per step; `static`: the rows' iterations run as static steps (CUDA
    graphs on CUDA); `rides_along`: a row done on the device since the last look stays in the core's calls,
    frozen (a static step, or a device where reading the flags waits for the queued work); `lockstep`: a token
    every row starts together may run all its iterations in one call (rdlm.inference.runner.lockstep; off where
    the static step is compiled for the CPU, which runs every token through it)."""

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
    start .. start + lengths[j] - 1, right-padded to the longest; `cap` iterations over `budget` slots.
    `ends[j]`: request j's prompt ends in this chunk (its row then holds the prompt's last state); `chooses[j]`:
    its first new token is chosen there (not for a prefill alone)."""

    chunk: int  # its id, the key of both sides' views of it
    requests: tuple[int, ...]
    start: int
    lengths: tuple[int, ...]
    cap: int
    budget: int
    n: int  # the tokens of each row: the longest's (padded so still when others left)
    ends: tuple[bool, ...] = ()
    chooses: tuple[bool, ...] = ()

    def keep(self, positions: tuple[int, ...]) -> ChunkSpec:
        """The chunk of the requests at `positions` only (the others cancelled): still `n` tokens wide."""
        return ChunkSpec(
            self.chunk,
            tuple(self.requests[j] for j in positions),
            self.start,
            tuple(self.lengths[j] for j in positions),
            self.cap,
            self.budget,
            self.n,
            tuple(self.ends[j] for j in positions),
            tuple(self.chooses[j] for j in positions),
        )


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
class Done:
    """A row whose token is done iterating, found so by a look: its coda reads its final state at buffer index
    `position` after `iterations` iterations and chooses its next token."""

    request: int
    row: int
    position: int
    iterations: int


@dataclass(frozen=True)
class StepPlan:
    """Everything one step does, in the order the runner carries it out:

    1. `wipe`: rows freed by a failure (their cache and state zeroed before anyone reuses them);
    2. `admitted`: requests entering rows, and `chunks`: the prompt chunks that begin prefilling; `dropped`:
       requests gone (cancelled, failed or finished) whose runner state goes; `narrowed`: chunks in flight that
       lost cancelled requests, each as it goes on (its spec) with the positions of the requests it keeps
       (none: the chunk goes);
    3. `starts`: the tokens fed now (prelude, s_0);
    4. `rounds`: requests that decode a round at a time, each in calls of their own;
    5. the core: a `lockstep` token (the `iterating` rows started it together: all its `iterations` in this
       step, exits decided on the device, then the coda), or `iterations` core iterations (1, or a power of
       two fused into one static call, which reads the rows' state-only exit criteria itself) of the
       `iterating` rows, with `prompt_iterations` iterations of the
       prompt chunks in flight (`prompts`, in order; `prompt_iterations_alone` when no row computes);
       `peek`: a row done on the device since the last look leaves the call (its flag is read for free);
       `since_look`: a row may be done on the device;
    6. the prompt chunks that ran their iterations: their coda, and the first token of each request whose
       prompt ends there (`ChunkSpec.ends`, `chooses`);
    7. the look: the host reads the iterating rows' exit flags when `look` (every `exit_sync_every` core
       iterations, where a row has an exit criterion), or when a request of `look_at_cap` computed (its token
       reaches its cap in this step)."""

    wipe: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    narrowed: tuple[tuple[ChunkSpec, tuple[int, ...]], ...] = ()
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
    look: bool = False
    look_at_cap: tuple[int, ...] = ()


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
    (`computed`); and what the look found (`found`: request -> iterations run, for the rows whose token is
    done; None when the host did not look)."""

    rounds: list[RoundOutput] = field(default_factory=list)
    lockstep: list[Chosen] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    prompt_iterations: int = 0
    first: list[Chosen] = field(default_factory=list)
    computed: tuple[int, ...] = ()
    found: dict[int, int] | None = None
