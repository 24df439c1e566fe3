"""Per-token exit steps under an adaptive exit criterion, for Figure 4 style histograms (paper section 6.1).

Teacher-forced: the whole prompt is iterated together and, after every iteration i, read out through the
coda as if every token stopped at s_i. A token's exit step is the first i (>= 2, since criteria compare
iteration i with i-1) at which the criterion (`rdlm.inference.exits.criteria`, e.g. KL < 5e-4) has passed `patience`
times in a row; tokens that never pass are counted at the cap r. This is the exit step a token would get if all
tokens before it ran to the same depth, a close stand-in for decoding with per-token exits, and much
cheaper (one pass over the prompt instead of one per token).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from rdlm.analysis.trajectories import Recurrence
from rdlm.inference.exits.criteria import ExitCriterion
from rdlm.inference.exits.track import ExitTrack, iterate_with_exits
from rdlm.model.lm import RecurrentDepthLM


@torch.no_grad()
def exit_steps(
    model: RecurrentDepthLM,
    token_ids: Sequence[int] | Tensor,
    criterion: ExitCriterion,
    max_steps: int,
    *,
    seed: int = 0,
    init_scale: float = 1.0,
) -> np.ndarray:
    """The exit iteration of every token of one prompt, in [1, max_steps] (max_steps = never exited).

    The decode engine's loop (`iterate_with_exits`) over the whole prompt, with exited tokens iterating
    on (`freeze=False`) so that every token sees the others at the same depth."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    recurrence = Recurrence.for_prompt(model, token_ids)
    state = recurrence.initial_state(seed, init_scale)
    track = ExitTrack.start(
        state.shape[1],
        state.device,
        model.config.vocab_size if criterion.uses_logits else None,
        gate=criterion.uses_gate,
    )
    gate = model.exit_probability if criterion.uses_gate else None
    for i in range(max_steps):  # one iteration at a time: stop once every token has exited
        state, track = iterate_with_exits(
            lambda s, i, exited: recurrence.step(s, i),
            recurrence.readout,
            state,
            track,
            criterion,
            i,
            1,
            max_steps,
            min_steps=1,
            freeze=False,
            gate=gate,
        )
        if bool(track.exited.all()):
            break
    assert track.iterations is not None  # ExitTrack.start counts the iterations (only the batch's rows do not)
    return track.iterations.cpu().numpy()
