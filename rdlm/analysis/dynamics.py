"""Labelling each token's latent dynamics: fixed point, orbit or slider (paper section 6, Figure 6).

The paper finds three behaviours: most tokens converge to a fixed point, some (often those that matter
for reasoning, e.g. numbers) settle on an orbit, and some "slide", drifting steadily along a direction.

The heuristic looks only at the tail of a trajectory (by default its last half, at least 4 steps), in
the full hidden space, with step lengths d_i = ||s_i - s_{i-1}||:

1. **fixed point** if the state has stopped moving, mean(d_i) / mean(||s_i||) < `still_tol` (1e-4),
   or if the steps shrink across the tail: fitting log d_i ~ a + b*i, the step length falls by the factor
   exp(b * tail_steps) < `shrink_tol` (0.5) over the tail (geometric convergence, spirals included).
2. Otherwise it keeps moving. With straightness = ||s_last - s_first|| / sum(d_i) over the tail (1 for a
   straight line, near 0 for a closed loop): **slider** if straightness > `straight_tol` (0.5), else
   **orbit**.

Limits, stated plainly: an orbit whose period is longer than about twice the tail looks straight and is
called a slider (give it more iterations); a very slow convergence (steps shrinking less than 2x over the
tail) is called an orbit or slider; a helix (rotation plus drift) is called by whichever dominates.
With a subsampled record (iteration stride k), steps are k iterations long, so an orbit whose period
divides k is invisible.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from rdlm.analysis.trajectories import Trajectory

FIXED_POINT, ORBIT, SLIDER = "fixed point", "orbit", "slider"
LABELS = (FIXED_POINT, ORBIT, SLIDER)


@dataclass(frozen=True)
class DynamicsThresholds:
    tail_fraction: float = 0.5
    min_tail_steps: int = 4
    still_tol: float = 1e-4
    shrink_tol: float = 0.5
    straight_tol: float = 0.5


@dataclass
class Dynamics:
    label: str
    relative_step: float  # mean step length over mean state norm, in the tail
    step_shrink: float  # factor by which the step length changes across the tail (fitted)
    straightness: float  # net displacement over path length, in the tail

    def to_dict(self) -> dict:
        return asdict(self)


def classify(states: np.ndarray, thresholds: DynamicsThresholds = DynamicsThresholds()) -> Dynamics:
    """Label one token's trajectory [iterations, hidden] (see the module docstring for the rule)."""
    states = np.asarray(states, dtype=np.float64)
    if states.ndim != 2 or states.shape[0] < 3:
        raise ValueError(f"a trajectory must be [iterations >= 3, hidden], got shape {states.shape}")
    tail_len = max(thresholds.min_tail_steps + 1, round(states.shape[0] * thresholds.tail_fraction))
    tail = states[-min(tail_len, states.shape[0]) :]
    steps = np.linalg.norm(np.diff(tail, axis=0), axis=-1)
    path = steps.sum()
    relative_step = float(steps.mean() / max(np.linalg.norm(tail, axis=-1).mean(), 1e-30))
    straightness = float(np.linalg.norm(tail[-1] - tail[0]) / path) if path > 0 else 0.0
    if relative_step < thresholds.still_tol:
        return Dynamics(FIXED_POINT, relative_step, 0.0, straightness)
    # Geometric decay of the step length: slope of log d_i against i, over the whole tail.
    log_steps = np.log(np.maximum(steps, steps.max() * 1e-12))
    slope = np.polyfit(np.arange(steps.size), log_steps, 1)[0]
    shrink = float(np.exp(slope * (steps.size - 1)))
    if shrink < thresholds.shrink_tol:
        label = FIXED_POINT
    else:
        label = SLIDER if straightness > thresholds.straight_tol else ORBIT
    return Dynamics(label, relative_step, shrink, straightness)


def classify_trajectory(
    trajectory: Trajectory, thresholds: DynamicsThresholds = DynamicsThresholds()
) -> list[Dynamics]:
    """One label per recorded token."""
    return [classify(trajectory.token_state(j), thresholds) for j in range(trajectory.num_tokens)]


def count_labels(dynamics: list[Dynamics]) -> dict[str, int]:
    counts = Counter(d.label for d in dynamics)
    return {label: counts.get(label, 0) for label in LABELS}
