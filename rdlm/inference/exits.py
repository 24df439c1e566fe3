"""Per-token exit criteria for adaptive compute (docs/inference.md#exit-criteria, paper section 6.1).

A token stops iterating the core block once its iterations have converged. Each criterion is a pure
*score* function of the previous and the current iteration (next-token logits and/or latent states)
giving one number per token, where smaller means more converged; a token passes when its score is
below the threshold. `ExitCriterion` bundles a score with its threshold and a `patience` (how many
consecutive passing iterations make an exit).

The formulas are those of the authors' reference code (`raven_modeling_minimal.py`, its exit
evaluators), so that a threshold means what it means there:
- `kl` and `minp-kl` are KL(p_{i-1} || p_i), the previous distribution being the target;
- `entropy-diff` is the absolute change |H(p_i) - H(p_{i-1})|, with H computed as -sum p log(p + 1e-10);
- `latent-diff` and `cosine` are computed in the states' own dtype (bfloat16 on a bfloat16 model);
- `argmax-stability`'s threshold is a number of steps: exit once the argmax has stayed the same for
  that many consecutive iterations (default 5), so a threshold of 3 means 3 steps.
Default thresholds are the paper's where it gives one (kl 5e-4, latent-diff 0.03), else the reference
code's; `CriterionSpec.reference_threshold` keeps the code's default where they differ (kl: 1e-3).

Shapes: logits are [..., vocab], states [..., hidden]; scores and decisions are [...] (e.g. [batch] for
one decoded token per sequence, or [batch, seq]). Nothing here keeps state between calls: the streak
counter for `patience` is passed in and returned (`ExitCriterion.update`).

`gate` and `gate-exact` read a model's learned exit gate instead (Ouro; `RecurrentDepthLM.exit_probability`):
after iteration i the gate gives lambda_i, the exit distribution is p_i = lambda_i * prod_{j<i}(1 - lambda_j),
and a token exits at the first iteration whose cumulative probability reaches the threshold (default the
checkpoint's `exit_threshold`), accumulated in the reference's order so decisions match it bit for bit.
`gate` stops iterating the token there (compute saved; later tokens read its latest cache entry, as for
every criterion here); `gate-exact` runs every iteration for every token, as the reference does, and only
selects the exit iteration's state for the logits.

Where each token stands lives in one place, an `ExitTrack` (iterations run, exited, the streak, the latest
logits, the gate's running sums, gate-exact's chosen state), and `ExitTrack.after_iteration` is its one
update after an iteration, reading the gate (`ExitTrack.read_gate`, the rule `gate_exits`) or the criterion
(`ExitTrack.read_criterion`, at the iterations of `exit_schedule`). `iterate_with_exits` is the one
per-token exit loop around it: tokens decoded in lockstep (rdlm.inference.lockstep, for the decode engine
and the continuous batch), gate-exact's teacher-forced logits (rdlm.inference.evaluate) and the exit-step
analysis (rdlm.analysis.exit_steps) run it. The continuous batch's rows,
which sit at different iterations, keep an `ExitTrack` over the rows and read it one iteration at a time
(rdlm.inference.row_exits); a prompt being prefilled keeps one over its tokens for the gate
(rdlm.inference.prefill).
"""

from __future__ import annotations

import difflib
import dataclasses
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rdlm.checks import check_int, is_int

# score(prev_logits, logits, prev_state, state, **options) -> [...] float tensor
ScoreFn = Callable[..., Tensor]


def kl_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None) -> Tensor:
    """KL(p_{i-1} || p_i) between successive next-token distributions, the previous one as the target
    (the reference code's direction). Not clamped: round-off can make it slightly negative."""
    return _kl_to_previous(F.log_softmax(prev_logits.float(), dim=-1), F.log_softmax(logits.float(), dim=-1))


def entropy_diff_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None) -> Tensor:
    """|H(p_i) - H(p_{i-1})|: absolute change of the next-token entropy (in nats)."""
    return (_entropy(logits) - _entropy(prev_logits)).abs()


def latent_diff_score(prev_logits=None, logits=None, prev_state: Tensor | None = None,
                      state: Tensor | None = None) -> Tensor:
    """||s_i - s_{i-1}|| / ||s_i||: relative change of the latent state."""
    return ((state - prev_state).norm(dim=-1) / state.norm(dim=-1).clamp_min(1e-12)).float()


def minp_kl_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None,
                  min_p: float = 0.1) -> Tensor:
    """KL(p_{i-1} || p_i) between min-p filtered distributions: probabilities below min_p times the
    largest are set to 1/vocab, then renormalized, so the tail's noise does not delay exits (the floor
    keeps KL finite)."""
    def filtered_log_probs(x: Tensor) -> Tensor:
        p = F.softmax(x.float(), dim=-1)
        p = torch.where(p < min_p * p.amax(dim=-1, keepdim=True), 1.0 / p.shape[-1], p)
        return (p / p.sum(dim=-1, keepdim=True)).log()

    return _kl_to_previous(filtered_log_probs(prev_logits), filtered_log_probs(logits))


def argmax_change_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None) -> Tensor:
    """1 where the most likely next token changed since the previous iteration, else 0."""
    return (prev_logits.argmax(dim=-1) != logits.argmax(dim=-1)).float()


def cosine_score(prev_logits=None, logits=None, prev_state: Tensor | None = None,
                 state: Tensor | None = None) -> Tensor:
    """1 - cos(s_i, s_{i-1}): cosine distance between successive latent states."""
    cos = (state * prev_state).sum(dim=-1) / state.norm(dim=-1).clamp_min(1e-12) \
        / prev_state.norm(dim=-1).clamp_min(1e-12)
    return (1 - cos).float()


def _kl_to_previous(prev_log_p: Tensor, log_p: Tensor) -> Tensor:
    return F.kl_div(log_p, prev_log_p, reduction="none", log_target=True).sum(dim=-1)


def _entropy(logits: Tensor) -> Tensor:
    p = F.softmax(logits.float(), dim=-1)
    return -(p * torch.log(p + 1e-10)).sum(dim=-1)


@dataclass(frozen=True)
class CriterionSpec:
    score: ScoreFn
    threshold: float          # rdlm's default threshold: the paper's where it gives one
    uses_logits: bool         # needs the coda run after every iteration
    uses_state: bool
    patience: int = 1         # default number of consecutive passing iterations
    help: str = ""
    # The reference code's default threshold (its "auto"), where it differs from `threshold`.
    reference_threshold: float | None = None
    # The threshold counts consecutive iterations whose score is 0 (argmax-stability): a token passes
    # an iteration when its score is below 0.5, and exits after `threshold` passes in a row.
    counts_steps: bool = False
    # Reads the model's learned exit gate after every iteration (see the module doc); `exact`: every
    # iteration still runs for every token, the exit only selects the state read out.
    uses_gate: bool = False
    exact: bool = False


# Defaults: kl 5e-4 and latent-diff 0.03 are the paper's (section 6.1); the others are the reference
# code's. The reference code's kl default is 1e-3.
CRITERIA: dict[str, CriterionSpec] = {
    "kl": CriterionSpec(kl_score, 5e-4, True, False, reference_threshold=1e-3,
                        help="KL(p_{i-1} || p_i) between successive next-token distributions"),
    "entropy-diff": CriterionSpec(entropy_diff_score, 1e-3, True, False,
                                  help="absolute change of next-token entropy |H_i - H_{i-1}|"),
    "latent-diff": CriterionSpec(latent_diff_score, 0.03, False, True,
                                 help="||s_i - s_{i-1}|| / ||s_i||"),
    "minp-kl": CriterionSpec(minp_kl_score, 1e-5, True, False,
                             help="KL(p_{i-1} || p_i) between min-p filtered next-token distributions"),
    "argmax-stability": CriterionSpec(argmax_change_score, 5, True, False, patience=5, counts_steps=True,
                                      help="the most likely next token unchanged for n steps (threshold = n)"),
    "cosine": CriterionSpec(cosine_score, 1e-3, False, True,
                            help="cosine distance between successive latent states"),
    "gate": CriterionSpec(lambda *args: None, 0.5, False, False, uses_gate=True,
                          help="a learned exit gate (Ouro): cumulative exit probability >= threshold; "
                               "stops iterating the token"),
    "gate-exact": CriterionSpec(lambda *args: None, 0.5, False, False, uses_gate=True, exact=True,
                                help="the learned exit gate as the reference uses it: every iteration runs, "
                                     "the exit selects which one's logits are read"),
}


def gate_update(lam: Tensor, remaining: Tensor, cumulative: Tensor, threshold: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(passed, remaining, cumulative) after one iteration whose gate gave `lam`: p_i = lam * remaining is
    added to the cumulative exit probability (the reference's cumsum order), remaining *= 1 - lam."""
    cumulative = cumulative + lam * remaining
    return cumulative >= threshold, remaining * (1 - lam), cumulative


def gate_exits(lam: Tensor, remaining: Tensor, cumulative: Tensor, threshold: float | Tensor, steps: int | Tensor,
               min_steps: int | Tensor, running: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(exits, remaining, cumulative) after one iteration of the learned gate (`gate_update`): a running token
    exits once its gate passes and it has run at least `min_steps` iterations. The one exit rule of every
    loop that reads a gate (decoding, a batch's rows, a prompt being prefilled)."""
    passed, remaining, cumulative = gate_update(lam, remaining, cumulative, threshold)
    return passed & (steps >= min_steps) & running, remaining, cumulative


@dataclass(frozen=True)
class ExitCriterion:
    """A named criterion with its threshold: a token exits after `patience` consecutive iterations
    whose score is below `threshold`. For a step-counting criterion (argmax-stability) the threshold is
    itself the number of consecutive iterations (and equals `patience`); an iteration passes when its
    score is 0."""

    name: str
    threshold: float
    patience: int = 1
    options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if self.spec.counts_steps and self.threshold != self.patience:
            raise ValueError(f"exit criterion {self.name!r}: the threshold is the number of steps, so it must "
                             f"equal patience (got threshold={self.threshold}, patience={self.patience})")

    @property
    def spec(self) -> CriterionSpec:
        return CRITERIA[self.name]

    @property
    def uses_logits(self) -> bool:
        return self.spec.uses_logits

    @property
    def uses_state(self) -> bool:
        return self.spec.uses_state

    @property
    def uses_gate(self) -> bool:
        return self.spec.uses_gate

    def score(self, prev_logits: Tensor | None = None, logits: Tensor | None = None,
              prev_state: Tensor | None = None, state: Tensor | None = None) -> Tensor:
        """The per-token score of this iteration (smaller is more converged)."""
        if self.uses_gate:
            raise ValueError(f"exit criterion {self.name!r} reads a model's exit gate: use gate_exits")
        self._check_inputs(prev_logits, logits, prev_state, state)
        return self.spec.score(prev_logits, logits, prev_state, state, **dict(self.options))

    def __call__(self, prev_logits: Tensor | None = None, logits: Tensor | None = None,
                 prev_state: Tensor | None = None, state: Tensor | None = None) -> Tensor:
        """Bool tensor: which tokens pass this iteration (an exit when patience is 1)."""
        cutoff = 0.5 if self.spec.counts_steps else self.threshold
        return self.score(prev_logits, logits, prev_state, state) < cutoff

    def update(self, streak: Tensor | None, prev_logits: Tensor | None = None,
               logits: Tensor | None = None, prev_state: Tensor | None = None,
               state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(exited, streak): count consecutive passing iterations per token; exit at `patience`."""
        passed = self(prev_logits, logits, prev_state, state)
        streak = passed.long() if streak is None else torch.where(passed, streak + 1, 0)
        return streak >= self.patience, streak

    def _check_inputs(self, prev_logits, logits, prev_state, state) -> None:
        if self.uses_logits and (prev_logits is None or logits is None):
            raise ValueError(f"exit criterion {self.name!r} needs prev_logits and logits")
        if self.uses_state and (prev_state is None or state is None):
            raise ValueError(f"exit criterion {self.name!r} needs prev_state and state")


def make_exit_criterion(name: str, threshold: float | None = None, *, patience: int | None = None,
                        **options) -> ExitCriterion:
    """An exit criterion by name, with the default threshold/patience unless given.

    `argmax-stability`: the threshold is the number of consecutive iterations the argmax must stay
    unchanged (default 5, as in the reference code); `n` and `patience` are aliases of it.
    `minp-kl` takes `min_p` (default 0.1).
    """
    if name not in CRITERIA:
        close = difflib.get_close_matches(name, list(CRITERIA), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown exit criterion {name!r}{hint}; available: {', '.join(CRITERIA)}")
    spec = CRITERIA[name]
    if "n" in options:
        if not spec.counts_steps:
            raise ValueError(f"option 'n' only applies to 'argmax-stability', not {name!r}")
        n = options.pop("n")
        if patience is not None and patience != n:
            raise ValueError(f"give either n={n} or patience={patience}, not both")
        patience = n
    allowed = {"minp-kl": {"min_p"}}.get(name, set())
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(f"exit criterion {name!r} takes no option {key!r}"
                             + (f"; it takes {sorted(allowed)}" if allowed else ""))
        if key == "min_p" and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ValueError(f"min_p must be in (0, 1], got {value!r}")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or threshold != threshold):
        raise ValueError(f"exit threshold must be a number, got {threshold!r}")
    if spec.uses_gate and threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"{name!r} threshold is a cumulative exit probability in (0, 1], got {threshold!r}")
    if spec.counts_steps:
        if threshold is not None and patience is not None and threshold != patience:
            raise ValueError(f"{name!r} counts steps: give the threshold ({threshold}) or n/patience "
                             f"({patience}), not both")
        steps = next((v for v in (threshold, patience) if v is not None), spec.patience)
        if isinstance(steps, float) and steps.is_integer():
            steps = int(steps)
        if not is_int(steps, 1):
            raise ValueError(f"{name!r} threshold is a number of steps: an integer >= 1, got {steps!r}")
        threshold, patience = steps, steps
    threshold = spec.threshold if threshold is None else threshold
    patience = spec.patience if patience is None else patience
    check_int("patience (n)", patience)
    return ExitCriterion(name, float(threshold), patience, tuple(sorted(options.items())))


# --------------------------------------------------------------------------------------------------
# The per-token exit loop (paper section 6.1)

def exit_schedule(iteration: int, num_steps: int, every: int) -> tuple[bool, bool]:
    """(evaluate, needs_logits_for_next): whether the exit criterion is read after 0-based iteration
    `iteration` of a token with at most `num_steps`, and whether the next iteration's reading needs
    this iteration's logits too. A reading compares iterations i - 1 and i: never at i = 0 (nothing to
    compare) nor at the last iteration (the token stops there anyway); every `every` iterations."""
    def reads(i: int) -> bool:
        return 0 < i < num_steps - 1 and (i + 1) % every == 0

    return reads(iteration), reads(iteration + 1)


@dataclass
class ExitTrack:
    """Where each token of an adaptive loop stands, over its tokens ([n] flat, e.g. [batch] for one decoded
    token per row or [seq] for a teacher-forced prompt; [g, n] for a prompt chunk's tokens). The one exit
    state of every caller: the per-token loop (`iterate_with_exits`), a prompt being prefilled
    (rdlm.inference.prefill) and the continuous batch's rows (rdlm.inference.row_exits). `after_iteration`
    is the one update; its two readings, `read_gate` and `read_criterion`, also serve the callers that count
    iterations or schedule readings themselves."""

    steps: Tensor | None     # [n] iterations run before the token exited (the cap if it never did); None
                             # where the caller counts them (the continuous batch's rows)
    exited: Tensor           # [n] bool: the criterion fired (gate-exact: the exit state is chosen)
    streak: Tensor           # [n] consecutive passing readings
    logits: Tensor | None    # [n, V] the latest readout, kept when the criterion reads logits
    # The learned gate's running sums ([n] float32), when the criterion reads it: the probability of
    # not having exited yet, and the cumulative exit probability.
    remaining: Tensor | None = None
    cumulative: Tensor | None = None
    exit_state: Tensor | None = None  # [n, h] the state at each token's exit (gate-exact, not frozen)

    @classmethod
    def start(cls, n: int | tuple[int, ...], device: torch.device, vocab_size: int | None = None,
              gate: bool = False) -> "ExitTrack":
        """No iteration run yet over `n` tokens (a count, or a shape such as [g, n]); `vocab_size` when the
        criterion reads logits, `gate` when it reads a gate."""
        shape = (n,) if isinstance(n, int) else tuple(n)
        zeros = torch.zeros(shape, dtype=torch.long, device=device)
        logits = None if vocab_size is None else torch.zeros(*shape, vocab_size, device=device)
        ones = torch.ones(shape, device=device) if gate else None
        return cls(zeros, zeros.bool(), zeros.clone(), logits, ones, None if ones is None else ones * 0)

    def select(self, index: Tensor) -> "ExitTrack":
        """The track of the tokens at `index` (of the first dimension)."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]

        return ExitTrack(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def count_iteration(self) -> "ExitTrack":
        """One more iteration run: every token not exited counts it."""
        return replace(self, steps=self.steps + (~self.exited).long())

    def after_iteration(self, criterion: ExitCriterion, i: int, num_steps: int, prev_state: Tensor, state: Tensor,
                        *, min_steps: int | Tensor, every: int = 1, readout: Callable[[Tensor], Tensor] | None = None,
                        gate: Callable[[Tensor], Tensor] | None = None, threshold: float | Tensor | None = None,
                        running: Tensor | None = None, reads: tuple[bool, bool] | None = None,
                        counted: bool = False) -> ExitTrack:
        """The one update after 0-based iteration i of a loop capped at `num_steps`, whose states went from
        `prev_state` to `state` ([..., h], the track's tokens in order): every token still iterating counts
        it (`count_iteration`; `counted`: the caller counted them); a gate criterion then reads `gate(state)`
        (`read_gate`, against `threshold` when given: one per token or row), any other is read at the
        iterations of `exit_schedule` (`read_criterion`; `reads`: (evaluate, needs logits next) decided by a
        caller whose tokens sit at different iterations), `readout(state)` giving the logits when it reads
        them. A reading holds `min_steps`, and reads only the `running` tokens when given. Whether a token is
        then done iterating is `done_iterating`'s one rule. Returns a new track (this one is not modified)."""
        track = self if counted else self.count_iteration()
        tokens = track.exited.shape
        flat = state.reshape(*tokens, state.shape[-1])
        if criterion.uses_gate:
            return track.read_gate(gate(state).reshape(tokens), flat, criterion.threshold if threshold is None
                                   else threshold, min_steps, running)
        evaluate, next_evaluates = exit_schedule(i, num_steps, every) if reads is None else reads
        prev_logits = track.logits
        if criterion.uses_logits and (evaluate or next_evaluates):
            logits = readout(state)
            track = replace(track, logits=logits.reshape(*tokens, logits.shape[-1]))
        if evaluate:
            track = track.read_criterion(criterion, prev_logits, track.logits,
                                         prev_state.reshape(*tokens, state.shape[-1]), flat, min_steps, running)
        return track

    def read_gate(self, lam: Tensor, state: Tensor, threshold: float | Tensor, min_steps: int | Tensor,
                  running: Tensor | None = None) -> "ExitTrack":
        """The learned gate read after an iteration that gave `lam` and `state` ([..., h]) per token: the gate
        rule (`gate_exits`) for each token not yet exited (and `running`, when given: elsewhere the running
        sums stay). A track with `exit_state` keeps the state of every token not yet exited, so it ends at
        the state of the iteration where the gate fired, or the last one."""
        live = ~self.exited if running is None else running & ~self.exited
        exits, remaining, cumulative = gate_exits(lam, self.remaining, self.cumulative, threshold, self.steps,
                                                  min_steps, live)
        if running is not None:
            remaining = torch.where(running, remaining, self.remaining)
            cumulative = torch.where(running, cumulative, self.cumulative)
        exit_state = self.exit_state
        if exit_state is not None:
            exit_state = torch.where(live.unsqueeze(-1), state, exit_state)
        return replace(self, exited=self.exited | exits, remaining=remaining, cumulative=cumulative,
                       exit_state=exit_state)

    def read_criterion(self, criterion: ExitCriterion, prev_logits: Tensor | None, logits: Tensor | None,
                       prev_state: Tensor | None, state: Tensor | None, min_steps: int | Tensor,
                       running: Tensor | None = None) -> "ExitTrack":
        """One reading of `criterion` comparing two iterations: a token exits once it passed `patience`
        readings in a row and has run at least `min_steps` iterations (`running`, when given: only those
        tokens are read, the others keep their streak)."""
        exits, streak = criterion.update(self.streak, prev_logits, logits, prev_state, state)
        exits = exits & (self.steps >= min_steps)
        if running is not None:
            exits, streak = exits & running, torch.where(running, streak, self.streak)
        return replace(self, exited=self.exited | exits, streak=streak)


def done_iterating(exited: Tensor, iterations: Tensor, cap: int | Tensor, runs_on: bool | Tensor = False) -> Tensor:
    """The one rule of whether a token is done iterating after an iteration: its criterion fired (a reading of
    `ExitTrack.after_iteration`, which holds min_steps), unless the criterion only chooses the state read out
    and the token runs on (`runs_on`: gate-exact), or it ran its `cap` iterations. The continuous batch's rows
    read it after every iteration, eager and static (rdlm.inference.step_runner, static_step); the per-token
    loop (`iterate_with_exits`) runs up to the cap, so inside it a token is done once its criterion fired."""
    if isinstance(runs_on, bool):
        fired = torch.zeros_like(exited) if runs_on else exited
    else:
        fired = exited & ~runs_on
    return fired | (iterations >= cap)


def iterate_with_exits(step: Callable[[Tensor, int, Tensor], Tensor], readout: Callable[[Tensor], Tensor],
                       state: Tensor, track: ExitTrack, criterion: ExitCriterion, first: int, n: int,
                       num_steps: int, *, min_steps: int = 2, every: int = 1, freeze: bool = True,
                       gate: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, ExitTrack]:
    """Iterations first .. first + n - 1 (0-based) of a per-token adaptive loop capped at `num_steps`.

    step(state, i, exited) -> the state after iteration i; readout(state) -> next-token logits [..., V]
    (called only when the criterion reads logits, and only at iterations whose reading needs them).
    After each iteration the track takes its one update (`ExitTrack.after_iteration`). `freeze`: an exited
    token keeps its state (decoding: its exit state is its final one); otherwise it goes on iterating and
    only its step count stops (teacher-forced analysis, where every token runs to the same depth). No host
    sync: the caller decides when to look at `exited`. A gate criterion reads `gate(state)` (lambda per
    token) after every iteration instead; unfrozen, the track keeps each token's state at its exit
    (`exit_state`).
    Returns the new state and a new track (the given one is not modified)."""
    tokens = state.shape[:-1]
    if criterion.uses_gate:
        if gate is None or track.remaining is None:
            raise ValueError(f"exit criterion {criterion.name!r} needs the model's gate and a track started "
                             "with gate=True")
        if not freeze and track.exit_state is None:
            track = replace(track, exit_state=state.reshape(-1, state.shape[-1]).clone())
    for i in range(first, first + n):
        prev_state, new = state, step(state, i, track.exited)
        # A token done iterating keeps its state (`done_iterating`: its cap is this loop's bound, so inside the
        # loop that is the tokens whose criterion fired).
        state = torch.where(track.exited.view(*tokens, 1), prev_state, new) if freeze else new
        track = track.after_iteration(criterion, i, num_steps, prev_state, state, min_steps=min_steps, every=every,
                                      readout=readout, gate=gate)
    return state, track
