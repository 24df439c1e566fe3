"""PCA over all tokens' latent trajectories (paper Figure 6).

All recorded states of all tokens (every token at every recorded iteration) are pooled as the rows of
one data matrix; each token's path is then projected onto the top principal directions and drawn in the
planes (1,2), (3,4), (5,6). The covariance is accumulated token by token in float64, so a trajectory
streamed to disk is never loaded whole; the eigendecomposition is `torch.linalg.eigh`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rdlm.analysis.trajectories import Trajectory


@dataclass
class PCA:
    mean: np.ndarray  # [hidden]
    components: np.ndarray  # [k, hidden], orthonormal rows, by decreasing variance
    explained_variance: np.ndarray  # [k]
    explained_ratio: np.ndarray  # [k], fraction of the total variance

    def project(self, states: np.ndarray) -> np.ndarray:
        """[..., hidden] -> [..., k] coordinates in the principal directions."""
        return (np.asarray(states, dtype=np.float64) - self.mean) @ self.components.T


def fit_pca(blocks, num_components: int = 6) -> PCA:
    """PCA of the rows of all `blocks` (an iterable of [rows, hidden] arrays, e.g. one per token)."""
    count = 0
    total: torch.Tensor | None = None
    outer: torch.Tensor | None = None
    for block in blocks:
        x = torch.as_tensor(np.asarray(block), dtype=torch.float64)
        if x.ndim != 2:
            raise ValueError(f"PCA blocks must be [rows, hidden], got shape {tuple(x.shape)}")
        if total is None or outer is None:  # the first block (both are set together)
            total, outer = (
                torch.zeros(x.shape[1], dtype=torch.float64),
                torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64),
            )
        count += x.shape[0]
        total += x.sum(0)
        outer += x.T @ x
    if count < 2 or total is None or outer is None:  # (no rows: count is 0)
        raise ValueError("PCA needs at least two states")
    mean = total / count
    covariance = (outer - count * torch.outer(mean, mean)) / (count - 1)
    values, vectors = torch.linalg.eigh(covariance)  # ascending
    values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)
    k = min(num_components, vectors.shape[1])
    components = vectors[:, :k].T.clone()
    # Fix each direction's sign (largest coordinate positive) so pictures do not flip between runs.
    signs = torch.sign(components.gather(1, components.abs().argmax(1, keepdim=True)))
    components *= signs
    variance_total = values.sum().item()
    ratio = values[:k] / variance_total if variance_total > 0 else torch.zeros(k, dtype=torch.float64)
    return PCA(
        mean=mean.numpy(),
        components=components.numpy(),
        explained_variance=values[:k].numpy(),
        explained_ratio=ratio.numpy(),
    )


def trajectory_pca(trajectory: Trajectory, num_components: int = 6) -> PCA:
    """PCA over every recorded state of every token of a trajectory."""
    return fit_pca((trajectory.states[j] for j in range(trajectory.num_tokens)), num_components)


def project_trajectory(trajectory: Trajectory, pca: PCA) -> np.ndarray:
    """[tokens, iterations, k]: each token's path in the principal coordinates."""
    return np.stack([pca.project(trajectory.states[j]) for j in range(trajectory.num_tokens)])


def plane_alignment(components: np.ndarray, plane: np.ndarray) -> float:
    """How well the span of `components` (2 x h) matches `plane` (2 x h): 1 = same plane, 0 = orthogonal.

    The mean squared cosine of the principal angles between the two planes.
    """
    q_a, _ = np.linalg.qr(np.asarray(components, dtype=np.float64).T)
    q_b, _ = np.linalg.qr(np.asarray(plane, dtype=np.float64).T)
    cosines = np.linalg.svd(q_a.T @ q_b, compute_uv=False)
    return float(np.mean(cosines**2))
