"""Path independence: do different random initial states s_0 lead to the same behaviour? (paper section 6)

The prompt is run once as a batch of K copies, each with its own random s_0 (K seeds). At every iteration
the spread of the K states of each token is measured online (nothing but a few chosen tokens' paths is
stored), as the root-mean-square distance from their mean:

    spread_i(t) = sqrt(mean_k ||s_i^k(t) - mean_k s_i^k(t)||^2),   relative: divided by mean_k ||s_i^k(t)||

A path-independent recurrence drives the spread of the final states towards 0 whatever s_0 was; the
whole-trajectory curve shows how fast. With a readout, the fraction of tokens whose next-token argmax
agrees across all K runs at r is reported as well ("same behaviour", not only "same state").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rdlm.analysis.trajectories import Recurrence, StepFn
from rdlm.model.lm import RecurrentDepthLM


@dataclass
class PathIndependence:
    spread: np.ndarray  # [tokens, r + 1] RMS distance of the K states from their mean
    relative_spread: np.ndarray  # [tokens, r + 1] spread / mean state norm
    paths: np.ndarray  # [K, chosen tokens, len(path_iterations), hidden] paths of `path_positions`
    path_positions: np.ndarray
    path_iterations: np.ndarray  # the iterations stored in `paths` (all, or a subsample to bound memory)
    num_runs: int
    argmax_agreement: float | None = None  # fraction of tokens with one argmax across all K runs at r

    def summary(self) -> dict:
        final = self.relative_spread[:, -1]
        return {
            "num_runs": self.num_runs,
            "relative_spread_initial": float(np.median(self.relative_spread[:, 0])),
            "relative_spread_final": {"median": float(np.median(final)), "max": float(final.max())},
            "relative_spread_whole_trajectory": {
                "mean": float(self.relative_spread.mean()),
                "max_over_last_half": float(self.relative_spread[:, self.relative_spread.shape[1] // 2 :].max()),
            },
            "argmax_agreement_at_r": self.argmax_agreement,
        }


def _spread(states: Tensor) -> tuple[Tensor, Tensor]:
    """states [K, T, h] -> (RMS distance from the mean over K, mean norm), each [T]."""
    states = states.double()
    deviation = states - states.mean(0, keepdim=True)
    spread = deviation.pow(2).sum(-1).mean(0).sqrt()
    return spread, states.norm(dim=-1).mean(0)


def spread_over_runs(
    step: StepFn,
    initial_states: Tensor,
    num_steps: int,
    *,
    path_positions: Sequence[int] | np.ndarray = (),
    path_iterations: Sequence[int] | np.ndarray | None = None,
    readout: Callable[[Tensor], Tensor] | None = None,
) -> PathIndependence:
    """Iterate `step` on a batch of K initial states [K, T, h] and measure their spread per iteration.

    The full states of `path_positions` are kept at `path_iterations` (default: every iteration).
    """
    if initial_states.ndim != 3 or initial_states.shape[0] < 2:
        raise ValueError(f"need at least 2 runs as [runs, tokens, hidden], got {tuple(initial_states.shape)}")
    runs, tokens, hidden = initial_states.shape
    positions = np.asarray(path_positions, dtype=int)
    index = torch.as_tensor(positions, device=initial_states.device, dtype=torch.long)
    spread = np.empty((tokens, num_steps + 1))
    norm = np.empty((tokens, num_steps + 1))
    kept = np.arange(num_steps + 1) if path_iterations is None else np.asarray(path_iterations, dtype=int)
    column = {int(i): c for c, i in enumerate(kept)}
    paths = np.empty((runs, positions.size, kept.size, hidden), dtype=np.float32)
    state = initial_states
    for i in range(num_steps + 1):
        if i > 0:
            state = step(state, i - 1)
        s, n = _spread(state)
        spread[:, i], norm[:, i] = s.cpu().numpy(), n.cpu().numpy()
        if i in column:
            paths[:, :, column[i]] = state[:, index].float().cpu().numpy()
    agreement = None
    if readout is not None:
        top = readout(state).argmax(-1)  # [K, T]
        agreement = float((top == top[:1]).all(0).float().mean())
    return PathIndependence(
        spread=spread,
        relative_spread=spread / np.maximum(norm, 1e-30),
        paths=paths,
        path_positions=positions,
        path_iterations=kept,
        num_runs=runs,
        argmax_agreement=agreement,
    )


def path_independence(
    model: RecurrentDepthLM,
    token_ids: Sequence[int] | Tensor,
    num_steps: int,
    *,
    num_runs: int = 4,
    seed: int = 0,
    init_scale: float = 1.0,
    path_positions: Sequence[int] | np.ndarray = (),
    path_iterations: Sequence[int] | np.ndarray | None = None,
) -> PathIndependence:
    """Run one prompt from `num_runs` random initial states (seeds seed..) and compare the trajectories."""
    if num_runs < 2:
        raise ValueError(f"path independence needs at least 2 runs, got {num_runs}")
    recurrence = Recurrence.for_prompt(model, token_ids, batch=num_runs)
    initial = recurrence.initial_state(seed, init_scale)  # one generator, K different draws
    return spread_over_runs(
        recurrence.step,
        initial,
        num_steps,
        path_positions=path_positions,
        path_iterations=path_iterations,
        readout=recurrence.readout,
    )
