"""The pictures of the latent analysis, as PNG files (matplotlib, Agg backend: no display needed).

Each function draws one figure from the numbers computed elsewhere in `rdlm.analysis` and writes it
atomically (temporary file, then rename), returning the path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: render to files only
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.colors import LogNorm, Normalize

from rdlm.analysis.convergence import Convergence
from rdlm.analysis.path_independence import PathIndependence
from rdlm.analysis.pca import PCA
from rdlm.fileio import atomic_write

PLANES = ((0, 1), (2, 3), (4, 5))  # PCA planes (1,2), (3,4), (5,6) of Figure 6


def save_figure(fig: plt.Figure, path: str | os.PathLike, dpi: int = 110) -> Path:
    path = Path(path)
    try:
        with atomic_write(path, "wb") as handle:
            fig.savefig(handle, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _coloured_path(ax: plt.Axes, xy: np.ndarray, iterations: np.ndarray, norm: Normalize) -> None:
    """A path whose colour runs with the iteration; start (circle) and end (star) marked."""
    segments = np.stack([xy[:-1], xy[1:]], axis=1)
    lines = LineCollection(list(segments), cmap="viridis", norm=norm, linewidths=1.2)
    lines.set_array(iterations[1:])
    ax.add_collection(lines)
    ax.scatter(xy[:, 0], xy[:, 1], c=iterations, cmap="viridis", norm=norm, s=6, zorder=2)
    ax.scatter(xy[0, 0], xy[0, 1], marker="o", s=50, facecolors="none", edgecolors="black", zorder=3, label="s_0")
    ax.scatter(
        xy[-1, 0], xy[-1, 1], marker="*", s=110, color="red", edgecolors="black", linewidths=0.5, zorder=3, label="s_r"
    )
    ax.autoscale_view()


def plot_trajectories(
    projected: np.ndarray,
    iterations: np.ndarray,
    labels: Sequence[str],
    pca: PCA,
    path: str | os.PathLike,
    title: str = "",
) -> Path:
    """Figure 6 style: one row per token, its path in the PCA planes (1,2), (3,4), (5,6).

    projected: [tokens, iterations, k] coordinates (see `pca.project_trajectory`).
    """
    tokens, _, k = projected.shape
    planes = [p for p in PLANES if p[1] < k]
    if not planes:
        raise ValueError(f"need at least 2 principal components to draw a plane, got {k}")
    fig, axes = plt.subplots(
        tokens, len(planes), figsize=(3.3 * len(planes), 2.6 * tokens + 0.6), squeeze=False, layout="constrained"
    )
    norm = Normalize(vmin=iterations[0], vmax=iterations[-1])
    for row in range(tokens):
        for col, (a, b) in enumerate(planes):
            ax = axes[row, col]
            _coloured_path(ax, projected[row][:, [a, b]], iterations, norm)
            ax.set_xlabel(f"PC{a + 1} ({100 * pca.explained_ratio[a]:.1f}%)", fontsize=8)
            ax.set_ylabel(f"PC{b + 1} ({100 * pca.explained_ratio[b]:.1f}%)", fontsize=8)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_title(labels[row], fontsize=9, loc="left")
    axes[0, -1].legend(fontsize=7, loc="best")
    fig.colorbar(
        plt.cm.ScalarMappable(norm=norm, cmap="viridis"), ax=axes, label="iteration", shrink=min(0.6, 3 / tokens + 0.2)
    )
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def plot_convergence(conv: Convergence, labels: Sequence[str], path: str | os.PathLike, title: str = "") -> Path:
    """Figure 5 style heatmap: ||s_i - s*|| per token (rows) and iteration (columns), log colour scale."""
    values = np.maximum(conv.distance, 1e-12)
    tokens, iters = values.shape
    fig, ax = plt.subplots(figsize=(min(3 + 0.18 * iters, 16), 1 + 0.28 * tokens))
    image = ax.imshow(
        values,
        aspect="auto",
        interpolation="nearest",
        cmap="magma_r",
        norm=LogNorm(vmin=values.min(), vmax=values.max()),
    )
    ax.set_yticks(range(tokens), labels, fontsize=7)
    ticks = np.unique(np.linspace(0, iters - 1, min(iters, 12)).round().astype(int))
    ax.set_xticks(ticks, [str(conv.iterations[t]) for t in ticks], fontsize=7)
    ax.set_xlabel("iteration i")
    fig.colorbar(image, ax=ax, label=f"||s_i - s*||  (s* at r = {conv.limit_steps})")
    if title:
        ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def plot_path_independence(
    result: PathIndependence, labels: Sequence[str], pca: PCA, path: str | os.PathLike, title: str = ""
) -> Path:
    """Left: relative spread of the K runs per iteration (median and range over tokens).
    Right: the K paths of each chosen token in PCA plane (1,2)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    rel = np.maximum(result.relative_spread, 1e-16)
    steps = np.arange(rel.shape[1])
    left.fill_between(steps, rel.min(0), rel.max(0), alpha=0.25, label="min-max over tokens")
    left.plot(steps, np.median(rel, 0), label="median over tokens")
    left.set_yscale("log")
    left.set_xlabel("iteration i")
    left.set_ylabel("spread of s_i over runs / ||s_i||")
    left.set_title(f"{result.num_runs} random initial states", fontsize=9)
    left.legend(fontsize=7)
    if result.paths.shape[1] and pca.components.shape[0] >= 2:
        colours = plt.cm.tab10(np.arange(result.paths.shape[1]) % 10)
        for t, colour in enumerate(colours):
            for k in range(result.num_runs):
                xy = pca.project(result.paths[k, t])[:, :2]
                right.plot(xy[:, 0], xy[:, 1], color=colour, lw=0.9, alpha=0.8, label=labels[t] if k == 0 else None)
                right.scatter(*xy[0], marker="o", s=25, facecolors="none", edgecolors=colour)
                right.scatter(*xy[-1], marker="*", s=70, color=colour, edgecolors="black", linewidths=0.4)
        right.set_xlabel("PC1")
        right.set_ylabel("PC2")
        right.set_title("paths per token and run (o start, * end)", fontsize=9)
        right.legend(fontsize=6, loc="best")
    else:
        right.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def plot_dynamics_counts(counts: Mapping[str, Mapping[str, int]], path: str | os.PathLike) -> Path:
    """Stacked bars: tokens labelled fixed point / orbit / slider, per prompt."""
    names = list(counts)
    labels = list(next(iter(counts.values()))) if counts else []
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(names) + 2), 3.2))
    bottom = np.zeros(len(names))
    for label, colour in zip(labels, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        values = np.array([counts[n][label] for n in names], dtype=float)
        ax.bar(range(len(names)), values, bottom=bottom, label=label, color=colour)
        bottom += values
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.set_title("latent dynamics per prompt", fontsize=10)
    return save_figure(fig, path)


def plot_exit_histograms(
    exit_steps: Mapping[str, np.ndarray], max_steps: int, criterion: str, path: str | os.PathLike
) -> Path:
    """Figure 4 style: distribution of the iteration at which each token exits, one curve per group."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    bins = np.arange(0.5, max_steps + 1.5, max(1, max_steps // 40))
    for name, steps in exit_steps.items():
        steps = np.asarray(steps)
        ax.hist(
            steps,
            bins=bins.tolist(),
            density=True,
            histtype="stepfilled",
            alpha=0.35,
            label=f"{name} (mean {steps.mean():.1f}, n={steps.size})",
        )
    ax.set_xlabel(f"steps to exit (capped at r = {max_steps})")
    ax.set_ylabel("density")
    ax.set_title(f"exit criterion: {criterion}", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
