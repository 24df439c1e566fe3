"""Per-token exit steps under an adaptive exit criterion, for Figure 4 style histograms (paper section 6.1).

Teacher-forced: the whole prompt is iterated together and, after every iteration i, read out through the
coda as if every token stopped at s_i. A token's exit step is the first i (>= 2, since criteria compare
iteration i with i-1) at which the criterion (`rdlm.inference.exits`, e.g. KL < 5e-4) has passed `patience` times
in a row; tokens that never pass are counted at the cap r. This is the exit step a token would get if all
tokens before it ran to the same depth, a close stand-in for decoding with per-token exits, and much
cheaper (one pass over the prompt instead of one per token).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from rdlm.analysis.trajectories import Recurrence
from rdlm.model.lm import RecurrentDepthLM


class ExitRule(Protocol):
    """What is needed of an `rdlm.inference.exits.ExitCriterion`."""

    name: str
    uses_logits: bool

    def update(self, streak: Tensor | None, prev_logits: Tensor | None = None, logits: Tensor | None = None,
               prev_state: Tensor | None = None, state: Tensor | None = None) -> tuple[Tensor, Tensor]: ...


def exit_criterion(name: str, threshold: float | None = None) -> ExitRule:
    """`rdlm.inference.exits.make_exit_criterion`, imported here so the rest of the analysis does not need it."""
    from rdlm.inference.exits import make_exit_criterion

    return make_exit_criterion(name, threshold)


@torch.no_grad()
def exit_steps(model: RecurrentDepthLM, token_ids: Sequence[int] | Tensor, criterion: ExitRule,
               max_steps: int, *, seed: int = 0, init_scale: float = 1.0) -> np.ndarray:
    """The exit iteration of every token of one prompt, in [1, max_steps] (max_steps = never exited)."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    recurrence = Recurrence.for_prompt(model, token_ids)
    state = recurrence.initial_state(seed, init_scale)
    exit_at = torch.full(recurrence.input_ids.shape[1:], max_steps, dtype=torch.long)
    done = torch.zeros_like(exit_at, dtype=torch.bool)
    streak, prev_state, prev_logits = None, None, None
    for i in range(1, max_steps + 1):
        state = recurrence.step(state, i - 1)
        logits = recurrence.readout(state)[0] if criterion.uses_logits else None
        if i >= 2:
            exited, streak = criterion.update(streak, prev_logits, logits, prev_state, state[0])
            new = exited.cpu() & ~done
            exit_at[new] = i
            done |= new
            if bool(done.all()):
                break
        prev_state, prev_logits = state[0], logits
    return exit_at.numpy()
