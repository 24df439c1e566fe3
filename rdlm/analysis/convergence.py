"""Convergence of each token's latent state towards its limit (paper Figure 5).

`||s_i - s*||` per token (rows) and iteration (columns), with s* the state after a much larger number
of iterations from the same s_0 (`record_trajectory(..., limit_steps=R)`). Also the per-step relative
change `||s_i - s_{i-1}|| / ||s_i||`, the quantity the latent-difference exit criterion thresholds
(docs/inference.md#exit-criteria) and the training monitor (docs/architecture.md#monitoring).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rdlm.analysis.trajectories import Trajectory


@dataclass
class Convergence:
    distance: np.ndarray  # [tokens, iterations] ||s_i - s*||
    relative_distance: np.ndarray  # [tokens, iterations] ||s_i - s*|| / ||s*||
    relative_change: np.ndarray  # [tokens, iterations - 1] ||s_i - s_{i-1}|| / ||s_i|| between recorded states
    iterations: np.ndarray
    limit_steps: int

    def summary(self) -> dict:
        final = self.relative_distance[:, -1]
        return {
            "limit_steps": self.limit_steps,
            "relative_distance_to_limit_at_r": {"median": float(np.median(final)), "max": float(final.max())},
            "relative_distance_to_limit_at_0": float(np.median(self.relative_distance[:, 0])),
            "relative_change_at_r": {"median": float(np.median(self.relative_change[:, -1]))}
            if self.relative_change.shape[1]
            else {},
        }


def convergence(trajectory: Trajectory) -> Convergence:
    """Distances of every recorded state to the token's limit state s* (needs `limit_steps`)."""
    if trajectory.limit is None or trajectory.limit_steps is None:
        raise ValueError("the trajectory has no limit state s*: record it with limit_steps=R")
    tokens, iters, _ = trajectory.states.shape
    distance = np.empty((tokens, iters))
    change = np.empty((tokens, max(iters - 1, 0)))
    limit_norm = np.linalg.norm(trajectory.limit.astype(np.float64), axis=-1)
    for j in range(tokens):  # token by token: the states may be a memmap larger than memory
        states = trajectory.token_state(j).astype(np.float64)
        distance[j] = np.linalg.norm(states - trajectory.limit[j], axis=-1)
        change[j] = np.linalg.norm(np.diff(states, axis=0), axis=-1) / np.maximum(
            np.linalg.norm(states[1:], axis=-1), 1e-30
        )
    relative = distance / np.maximum(limit_norm, 1e-30)[:, None]
    return Convergence(
        distance=distance,
        relative_distance=relative,
        relative_change=change,
        iterations=trajectory.iterations,
        limit_steps=trajectory.limit_steps,
    )
