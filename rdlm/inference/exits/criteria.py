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

Where each token stands, and the one update after an iteration, is rdlm.inference.exits.track (`ExitTrack`,
`done_iterating`, the per-token loop `iterate_with_exits`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass

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


def latent_diff_score(
    prev_logits=None, logits=None, prev_state: Tensor | None = None, state: Tensor | None = None
) -> Tensor:
    """||s_i - s_{i-1}|| / ||s_i||: relative change of the latent state."""
    assert prev_state is not None and state is not None  # (ExitCriterion checks its inputs)
    return ((state - prev_state).norm(dim=-1) / state.norm(dim=-1).clamp_min(1e-12)).float()


def minp_kl_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None, min_p: float = 0.1) -> Tensor:
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


def cosine_score(
    prev_logits=None, logits=None, prev_state: Tensor | None = None, state: Tensor | None = None
) -> Tensor:
    """1 - cos(s_i, s_{i-1}): cosine distance between successive latent states."""
    assert prev_state is not None and state is not None  # (ExitCriterion checks its inputs)
    cos = (
        (state * prev_state).sum(dim=-1)
        / state.norm(dim=-1).clamp_min(1e-12)
        / prev_state.norm(dim=-1).clamp_min(1e-12)
    )
    return (1 - cos).float()


def _kl_to_previous(prev_log_p: Tensor, log_p: Tensor) -> Tensor:
    return F.kl_div(log_p, prev_log_p, reduction="none", log_target=True).sum(dim=-1)


def _entropy(logits: Tensor) -> Tensor:
    p = F.softmax(logits.float(), dim=-1)
    return -(p * torch.log(p + 1e-10)).sum(dim=-1)


@dataclass(frozen=True)
class CriterionSpec:
    score: ScoreFn
    threshold: float  # rdlm's default threshold: the paper's where it gives one
    uses_logits: bool  # needs the coda run after every iteration
    uses_state: bool
    patience: int = 1  # default number of consecutive passing iterations
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

    @property
    def state_only(self) -> bool:
        """It compares the latent states alone (no logits, no gate): a step can read it on the device between
        iterations it runs in one call (rdlm.inference.runner.row_exits)."""
        return self.uses_state and not self.uses_logits and not self.uses_gate


def _reads_the_gate(*args: object) -> Tensor:
    """The score of a gate criterion: there is none, the model's gate is read instead (`gate_exits`)."""
    raise ValueError("a gate criterion has no score: it reads the model's exit gate")


# Defaults: kl 5e-4 and latent-diff 0.03 are the paper's (section 6.1); the others are the reference
# code's. The reference code's kl default is 1e-3.
CRITERIA: dict[str, CriterionSpec] = {
    "kl": CriterionSpec(
        kl_score,
        5e-4,
        True,
        False,
        reference_threshold=1e-3,
        help="KL(p_{i-1} || p_i) between successive next-token distributions",
    ),
    "entropy-diff": CriterionSpec(
        entropy_diff_score, 1e-3, True, False, help="absolute change of next-token entropy |H_i - H_{i-1}|"
    ),
    "latent-diff": CriterionSpec(latent_diff_score, 0.03, False, True, help="||s_i - s_{i-1}|| / ||s_i||"),
    "minp-kl": CriterionSpec(
        minp_kl_score, 1e-5, True, False, help="KL(p_{i-1} || p_i) between min-p filtered next-token distributions"
    ),
    "argmax-stability": CriterionSpec(
        argmax_change_score,
        5,
        True,
        False,
        patience=5,
        counts_steps=True,
        help="the most likely next token unchanged for n steps (threshold = n)",
    ),
    "cosine": CriterionSpec(cosine_score, 1e-3, False, True, help="cosine distance between successive latent states"),
    "gate": CriterionSpec(
        _reads_the_gate,
        0.5,
        False,
        False,
        uses_gate=True,
        help="a learned exit gate (Ouro): cumulative exit probability >= threshold; stops iterating the token",
    ),
    "gate-exact": CriterionSpec(
        _reads_the_gate,
        0.5,
        False,
        False,
        uses_gate=True,
        exact=True,
        help="the learned exit gate as the reference uses it: every iteration runs, "
        "the exit selects which one's logits are read",
    ),
}


def gate_update(
    lam: Tensor, remaining: Tensor, cumulative: Tensor, threshold: float | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(passed, remaining, cumulative) after one iteration whose gate gave `lam`: p_i = lam * remaining is
    added to the cumulative exit probability (the reference's cumsum order), remaining *= 1 - lam."""
    cumulative = cumulative + lam * remaining
    return cumulative >= threshold, remaining * (1 - lam), cumulative


def gate_exits(
    lam: Tensor,
    remaining: Tensor,
    cumulative: Tensor,
    threshold: float | Tensor,
    steps: int | Tensor,
    min_steps: int | Tensor,
    running: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
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
            raise ValueError(
                f"exit criterion {self.name!r}: the threshold is the number of steps, so it must "
                f"equal patience (got threshold={self.threshold}, patience={self.patience})"
            )

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

    def score(
        self,
        prev_logits: Tensor | None = None,
        logits: Tensor | None = None,
        prev_state: Tensor | None = None,
        state: Tensor | None = None,
    ) -> Tensor:
        """The per-token score of this iteration (smaller is more converged)."""
        if self.uses_gate:
            raise ValueError(f"exit criterion {self.name!r} reads a model's exit gate: use gate_exits")
        self._check_inputs(prev_logits, logits, prev_state, state)
        return self.spec.score(prev_logits, logits, prev_state, state, **dict(self.options))

    def __call__(
        self,
        prev_logits: Tensor | None = None,
        logits: Tensor | None = None,
        prev_state: Tensor | None = None,
        state: Tensor | None = None,
    ) -> Tensor:
        """Bool tensor: which tokens pass this iteration (an exit when patience is 1)."""
        cutoff = 0.5 if self.spec.counts_steps else self.threshold
        return self.score(prev_logits, logits, prev_state, state) < cutoff

    def update(
        self,
        streak: Tensor | None,
        prev_logits: Tensor | None = None,
        logits: Tensor | None = None,
        prev_state: Tensor | None = None,
        state: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(exited, streak): count consecutive passing iterations per token; exit at `patience`."""
        passed = self(prev_logits, logits, prev_state, state)
        streak = passed.long() if streak is None else torch.where(passed, streak + 1, 0)
        return streak >= self.patience, streak

    def _check_inputs(self, prev_logits, logits, prev_state, state) -> None:
        if self.uses_logits and (prev_logits is None or logits is None):
            raise ValueError(f"exit criterion {self.name!r} needs prev_logits and logits")
        if self.uses_state and (prev_state is None or state is None):
            raise ValueError(f"exit criterion {self.name!r} needs prev_state and state")


def make_exit_criterion(
    name: str, threshold: float | None = None, *, patience: int | None = None, **options
) -> ExitCriterion:
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
            raise ValueError(
                f"exit criterion {name!r} takes no option {key!r}"
                + (f"; it takes {sorted(allowed)}" if allowed else "")
            )
        if key == "min_p" and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ValueError(f"min_p must be in (0, 1], got {value!r}")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold)
    ):
        raise ValueError(f"exit threshold must be a number, got {threshold!r}")
    if spec.uses_gate and threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"{name!r} threshold is a cumulative exit probability in (0, 1], got {threshold!r}")
    if spec.counts_steps:
        if threshold is not None and patience is not None and threshold != patience:
            raise ValueError(
                f"{name!r} counts steps: give the threshold ({threshold}) or n/patience ({patience}), not both"
            )
        steps: float = next((v for v in (threshold, patience) if v is not None), spec.patience)
        if isinstance(steps, float) and steps.is_integer():
            steps = int(steps)
        if not is_int(steps, 1):
            raise ValueError(f"{name!r} threshold is a number of steps: an integer >= 1, got {steps!r}")
        threshold, patience = steps, int(steps)  # (an integer: is_int said so)
    threshold = spec.threshold if threshold is None else threshold
    patience = spec.patience if patience is None else patience
    check_int("patience (n)", patience)
    return ExitCriterion(name, float(threshold), patience, tuple(sorted(options.items())))
