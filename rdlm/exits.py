"""Per-token exit criteria for adaptive compute (SPEC section 4, paper section 6.1).

A token stops iterating the core block once its iterations have converged. Each criterion is a pure
*score* function of the previous and the current iteration (next-token logits and/or latent states)
giving one number per token, where smaller means more converged; a token passes when its score is
below the threshold. `ExitCriterion` bundles a score with its threshold and a `patience` (how many
consecutive passing iterations make an exit): argmax-stability is "the argmax agreed for n steps".

Shapes: logits are [..., vocab], states [..., hidden]; scores and decisions are [...] (e.g. [batch] for
one decoded token per sequence, or [batch, seq]). Nothing here keeps state between calls: the streak
counter for `patience` is passed in and returned (`ExitCriterion.update`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# score(prev_logits, logits, prev_state, state, **options) -> [...] float tensor
ScoreFn = Callable[..., Tensor]


def kl_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None) -> Tensor:
    """KL(p_i || p_{i-1}) between successive next-token distributions (the paper's default)."""
    log_p, log_q = F.log_softmax(logits.float(), dim=-1), F.log_softmax(prev_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0)


def entropy_diff_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None) -> Tensor:
    """|H(p_{i-1}) - H(p_i)| / H(p_{i-1}): relative change of the next-token entropy."""
    def entropy(x: Tensor) -> Tensor:
        log_p = F.log_softmax(x.float(), dim=-1)
        return -(log_p.exp() * log_p).sum(dim=-1)

    prev = entropy(prev_logits)
    return (prev - entropy(logits)).abs() / prev.clamp_min(1e-12)


def latent_diff_score(prev_logits=None, logits=None, prev_state: Tensor | None = None,
                      state: Tensor | None = None) -> Tensor:
    """||s_i - s_{i-1}|| / ||s_i||: relative change of the latent state."""
    prev, cur = prev_state.float(), state.float()
    return (cur - prev).norm(dim=-1) / cur.norm(dim=-1).clamp_min(1e-12)


def minp_kl_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None,
                  min_p: float = 0.1) -> Tensor:
    """KL between min-p filtered distributions: tokens below min_p * max probability are floored to
    1/vocab before renormalizing, so the tail's noise does not delay exits (the floor keeps KL finite)."""
    def filtered_log_probs(x: Tensor) -> Tensor:
        p = F.softmax(x.float(), dim=-1)
        keep = p >= min_p * p.amax(dim=-1, keepdim=True)
        p = torch.where(keep, p, torch.full_like(p, 1.0 / p.shape[-1]))
        return (p / p.sum(dim=-1, keepdim=True)).log()

    log_p, log_q = filtered_log_probs(logits), filtered_log_probs(prev_logits)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0)


def argmax_change_score(prev_logits: Tensor, logits: Tensor, prev_state=None, state=None) -> Tensor:
    """1 where the most likely next token changed since the previous iteration, else 0."""
    return (prev_logits.argmax(dim=-1) != logits.argmax(dim=-1)).float()


def cosine_score(prev_logits=None, logits=None, prev_state: Tensor | None = None,
                 state: Tensor | None = None) -> Tensor:
    """1 - cos(s_i, s_{i-1}): cosine distance between successive latent states."""
    return 1 - F.cosine_similarity(state.float(), prev_state.float(), dim=-1, eps=1e-12)


@dataclass(frozen=True)
class CriterionSpec:
    score: ScoreFn
    threshold: float          # default threshold
    uses_logits: bool         # needs the coda run after every iteration
    uses_state: bool
    patience: int = 1         # default number of consecutive passing iterations
    help: str = ""


# Defaults: kl 5e-4 and latent-diff 0.03 are the paper's (SPEC section 4); the others are ours.
CRITERIA: dict[str, CriterionSpec] = {
    "kl": CriterionSpec(kl_score, 5e-4, True, False, help="KL between successive next-token distributions"),
    "entropy-diff": CriterionSpec(entropy_diff_score, 1e-3, True, False,
                                  help="relative change of next-token entropy"),
    "latent-diff": CriterionSpec(latent_diff_score, 0.03, False, True,
                                 help="||s_i - s_{i-1}|| / ||s_i||"),
    "minp-kl": CriterionSpec(minp_kl_score, 1e-6, True, False,
                             help="KL between min-p filtered next-token distributions"),
    "argmax-stability": CriterionSpec(argmax_change_score, 0.5, True, False, patience=5,
                                      help="the most likely next token unchanged for n steps"),
    "cosine": CriterionSpec(cosine_score, 1e-3, False, True,
                            help="cosine distance between successive latent states"),
}


@dataclass(frozen=True)
class ExitCriterion:
    """A named criterion with its threshold: a token exits after `patience` consecutive iterations
    whose score is below `threshold`."""

    name: str
    threshold: float
    patience: int = 1
    options: tuple[tuple[str, object], ...] = ()

    @property
    def spec(self) -> CriterionSpec:
        return CRITERIA[self.name]

    @property
    def uses_logits(self) -> bool:
        return self.spec.uses_logits

    @property
    def uses_state(self) -> bool:
        return self.spec.uses_state

    def score(self, prev_logits: Tensor | None = None, logits: Tensor | None = None,
              prev_state: Tensor | None = None, state: Tensor | None = None) -> Tensor:
        """The per-token score of this iteration (smaller is more converged)."""
        self._check_inputs(prev_logits, logits, prev_state, state)
        return self.spec.score(prev_logits, logits, prev_state, state, **dict(self.options))

    def __call__(self, prev_logits: Tensor | None = None, logits: Tensor | None = None,
                 prev_state: Tensor | None = None, state: Tensor | None = None) -> Tensor:
        """Bool tensor: which tokens pass this iteration (an exit when patience is 1)."""
        return self.score(prev_logits, logits, prev_state, state) < self.threshold

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

    `argmax-stability` takes `n` (an alias of patience: steps the argmax must stay unchanged);
    `minp-kl` takes `min_p` (default 0.1).
    """
    if name not in CRITERIA:
        close = difflib.get_close_matches(name, list(CRITERIA), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown exit criterion {name!r}{hint}; available: {', '.join(CRITERIA)}")
    spec = CRITERIA[name]
    if "n" in options:
        if name != "argmax-stability":
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
    threshold = spec.threshold if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold != threshold:
        raise ValueError(f"exit threshold must be a number, got {threshold!r}")
    patience = spec.patience if patience is None else patience
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        raise ValueError(f"patience (n) must be an integer >= 1, got {patience!r}")
    return ExitCriterion(name, float(threshold), patience, tuple(sorted(options.items())))
