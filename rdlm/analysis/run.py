"""One call that runs every latent analysis on a set of prompts and writes the pictures and the report.

    result = analyze(model, [Prompt("p0", ids)], "out/analysis", AnalysisSettings(num_steps=32))

For each prompt: its trajectory for r iterations plus the limit state s* (Figures 5 and 6), the dynamics
labels, and the path-independence runs. Across prompts: label counts and the exit-step histogram
(Figure 4). Writes `<out>/*.png`, `<out>/summary.json` and the self-contained `<out>/report.html`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rdlm.analysis import plots
from rdlm.analysis.convergence import convergence
from rdlm.analysis.dynamics import DynamicsThresholds, classify_trajectory, count_labels
from rdlm.analysis.path_independence import path_independence
from rdlm.analysis.pca import project_trajectory, trajectory_pca
from rdlm.analysis.report import Figure, Section, write_report
from rdlm.analysis.trajectories import DEFAULT_MAX_BYTES, record_trajectory, select_positions
from rdlm.fileio import write_json
from rdlm.model.lm import RecurrentDepthLM
from rdlm.resources import check_time, forward_seconds

# The files and directories `analyze` writes into its output directory.
_OUTPUT_RE = re.compile(
    r"(report\.html|summary\.json|dynamics_counts\.png|exit_steps\.png|states|"
    r"(trajectories|convergence|path_independence)_.+\.png)"
)


def is_analysis_file(name: str) -> bool:
    """Whether `name` in an output directory is one `analyze` writes (what an earlier analysis left)."""
    return _OUTPUT_RE.fullmatch(name) is not None


@dataclass
class Prompt:
    name: str
    token_ids: list[int]
    category: str = ""  # groups prompts in the exit-step histogram (e.g. a task name)
    text: str | None = None


@dataclass
class AnalysisSettings:
    num_steps: int = 32  # r for the trajectories
    limit_steps: int | None = None  # r for s*; default 4 * num_steps
    seed: int = 0
    init_scale: float = 1.0
    plot_tokens: int = 6  # tokens drawn in the trajectory figure, evenly spread
    plot_positions: Sequence[int] | None = None  # or exactly these prompt positions
    max_tokens: int | None = 128  # recorded tokens per prompt (evenly spread); None = all
    iteration_stride: int | None = None  # None: 1, or larger if the record would exceed max_bytes
    max_bytes: int = DEFAULT_MAX_BYTES
    stream: bool = False  # stream states to <out>/states/*.npy (numpy memmap)
    num_runs: int = 4  # random s_0 for path independence
    exit_criterion: str | None = "kl"  # None: skip the exit-step histogram
    exit_threshold: float | None = None
    exit_max_steps: int | None = None  # default num_steps
    thresholds: DynamicsThresholds = field(default_factory=DynamicsThresholds)

    def __post_init__(self) -> None:
        if self.num_steps < 3:
            raise ValueError(f"num_steps must be >= 3 to see any dynamics, got {self.num_steps}")
        if self.limit_steps is not None and self.limit_steps < self.num_steps:
            raise ValueError(f"limit_steps ({self.limit_steps}) must be >= num_steps ({self.num_steps})")
        if self.num_runs < 2:
            raise ValueError(f"num_runs must be >= 2, got {self.num_runs}")
        if self.plot_tokens < 1:
            raise ValueError(f"plot_tokens must be >= 1, got {self.plot_tokens}")
        if not (isinstance(self.init_scale, (int, float)) and math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise ValueError(f"init_scale must be a finite number >= 0, got {self.init_scale!r}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {self.max_bytes}")


@dataclass
class AnalysisResult:
    out_dir: Path
    summary: dict
    figures: list[Path]
    report: Path


def token_labels(token_ids: Sequence[int], positions: Sequence[int] | np.ndarray, tokenizer=None) -> list[str]:
    """ "pos: 'text'" with the tokenizer, else "pos: #id"."""
    labels = []
    for p in positions:
        tid = int(token_ids[p])
        text = repr(tokenizer.decode([tid])) if tokenizer is not None else f"#{tid}"
        labels.append(f"{p}: {text}")
    return labels


def analyze(
    model: RecurrentDepthLM,
    prompts: Sequence[Prompt],
    out_dir: str | os.PathLike,
    settings: AnalysisSettings | None = None,
    tokenizer=None,
    model_name: str = "",
) -> AnalysisResult:
    if not prompts:
        raise ValueError("no prompts to analyze")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    s = settings or AnalysisSettings()
    criterion = _exit_criterion(model, s)  # first: a misspelt criterion should fail before minutes of work
    limit_steps = 4 * s.num_steps if s.limit_steps is None else s.limit_steps
    # The trajectory to max(r, limit), the path-independence runs to r, the exit steps to their cap.
    iterations = max(s.num_steps, limit_steps) + s.num_runs * s.num_steps + (s.exit_max_steps or s.num_steps)
    device = next(model.parameters()).device
    seconds = [forward_seconds(model.config, device, len(p.token_ids), 1, iterations) for p in prompts]
    check_time(sum(seconds), max(seconds), f"analyzing at r = {s.num_steps} (s* at {limit_steps} iterations)", "prompt")
    summary: dict = {"model": model_name, "settings": {**asdict(s), "limit_steps": limit_steps}, "prompts": {}}
    sections: list[Section] = []
    figures: list[Path] = []
    counts: dict[str, dict[str, int]] = {}
    for prompt in prompts:
        prompt_summary, section, prompt_figures = _analyze_prompt(model, prompt, s, limit_steps, out, tokenizer)
        summary["prompts"][prompt.name] = prompt_summary
        counts[prompt.name] = prompt_summary["dynamics_counts"]
        sections.append(section)
        figures += prompt_figures

    fig_dyn = plots.plot_dynamics_counts(counts, out / "dynamics_counts.png")
    figures.append(fig_dyn)
    summary["dynamics_counts"] = counts
    overview = [
        Section(
            title="Dynamics per prompt",
            text="",
            notes=[plots_doc_dynamics(s.thresholds)],
            figures=[Figure(fig_dyn, "Tokens labelled fixed point / orbit / slider.")],
            tables={"counts": [{"prompt": k, **v} for k, v in counts.items()]},
        )
    ]
    if criterion is not None:
        summary["exit_steps"], section, fig_exit = _exit_steps_section(model, prompts, criterion, s, out)
        figures.append(fig_exit)
        overview.append(section)

    write_json(out / "summary.json", summary)
    report = write_report(
        out / "report.html",
        title=f"Latent analysis {model_name}".strip(),
        intro=(
            f"r = {s.num_steps}, s* at r = {limit_steps}, seed {s.seed}, "
            f"init scale {s.init_scale}, {len(prompts)} prompt(s)."
        ),
        sections=overview + sections,
    )
    return AnalysisResult(out_dir=out, summary=summary, figures=figures, report=report)


def _exit_criterion(model: RecurrentDepthLM, s: AnalysisSettings):
    """The exit criterion of `s` (None without one); a gate's threshold defaults to the checkpoint's own."""
    if not s.exit_criterion:
        return None
    from rdlm.inference.exits.criteria import make_exit_criterion
    from rdlm.inference.params import check_gate

    threshold = s.exit_threshold
    if threshold is None and s.exit_criterion in ("gate", "gate-exact"):  # the checkpoint's own
        threshold = model.config.exit_threshold
    criterion = make_exit_criterion(s.exit_criterion, threshold)
    check_gate(model, criterion)
    return criterion


def _analyze_prompt(
    model: RecurrentDepthLM, prompt: Prompt, s: AnalysisSettings, limit_steps: int, out: Path, tokenizer
) -> tuple[dict, Section, list[Path]]:
    """One prompt's trajectory, convergence, dynamics and path independence: (its summary, its report
    section, its figures)."""
    ids = prompt.token_ids
    traj = record_trajectory(
        model,
        ids,
        s.num_steps,
        limit_steps=limit_steps,
        seed=s.seed,
        init_scale=s.init_scale,
        max_tokens=s.max_tokens,
        iteration_stride=s.iteration_stride,
        max_bytes=s.max_bytes,
        stream_to=out / "states" / f"{prompt.name}.npy" if s.stream else None,
    )
    labels = token_labels(ids, traj.positions, tokenizer)

    # Figure 6: PCA over all recorded tokens, chosen tokens' paths in planes (1,2), (3,4), (5,6).
    pca = trajectory_pca(traj, num_components=6)
    if s.plot_positions is not None:
        wanted = [int(p) for p in s.plot_positions]
        missing = [p for p in wanted if p not in set(traj.positions.tolist())]
        if missing:
            raise ValueError(
                f"plot positions {missing} are not among the recorded positions of "
                f"prompt {prompt.name!r} (length {len(ids)})"
            )
        rows = [int(np.flatnonzero(traj.positions == p)[0]) for p in wanted]
    else:
        rows = select_positions(traj.num_tokens, s.plot_tokens).tolist()
    projected = project_trajectory(traj, pca)
    fig_traj = plots.plot_trajectories(
        projected[rows],
        traj.iterations,
        [labels[r] for r in rows],
        pca,
        out / f"trajectories_{prompt.name}.png",
        title=f"{prompt.name}: latent paths, r = {s.num_steps}",
    )

    # Figure 5: distance to s*.
    conv = convergence(traj)
    fig_conv = plots.plot_convergence(
        conv, labels, out / f"convergence_{prompt.name}.png", title=f"{prompt.name}: ||s_i - s*||"
    )

    dynamics = classify_trajectory(traj, s.thresholds)
    pi = path_independence(
        model,
        ids,
        s.num_steps,
        num_runs=s.num_runs,
        seed=s.seed + 1,
        init_scale=s.init_scale,
        path_positions=traj.positions[rows],
        path_iterations=traj.iterations,
    )
    fig_pi = plots.plot_path_independence(
        pi,
        [labels[r] for r in rows],
        pca,
        out / f"path_independence_{prompt.name}.png",
        title=f"{prompt.name}: path independence",
    )

    prompt_summary = {
        "text": prompt.text,
        "num_tokens": len(ids),
        "category": prompt.category,
        "recorded_positions": traj.positions.tolist(),
        "recorded_iterations": traj.iterations.tolist()
        if traj.iterations.size <= 64
        else f"{traj.iterations.size} iterations, stride {int(traj.iterations[1] - traj.iterations[0])}",
        "storage": traj.storage,
        "pca_explained_ratio": [round(float(x), 4) for x in pca.explained_ratio],
        "convergence": conv.summary(),
        "dynamics_counts": count_labels(dynamics),
        "dynamics": {labels[j]: d.to_dict() for j, d in enumerate(dynamics)},
        "path_independence": pi.summary(),
    }
    section = Section(
        title=f"Prompt {prompt.name}" + (f" ({prompt.category})" if prompt.category else ""),
        text=prompt.text if prompt.text is not None else " ".join(map(str, ids)),
        notes=[
            f"storage: {'; '.join(traj.storage)}",
            f"s* is the state after {limit_steps} iterations from the same s_0",
        ],
        figures=[
            Figure(
                fig_traj,
                "Latent trajectories (Figure 6 style): PCA over all recorded "
                "tokens' states; o marks s_0, * marks s_r, colour runs with i.",
            ),
            Figure(fig_conv, "Convergence (Figure 5 style): distance of s_i to s* per token."),
            Figure(fig_pi, f"Path independence: {s.num_runs} random s_0."),
        ],
        tables={
            "dynamics": [{"token": labels[j], **d.to_dict()} for j, d in enumerate(dynamics)],
            "numbers": [
                {"quantity": k, "value": json.dumps(v)}
                for k, v in {
                    **conv.summary(),
                    **pi.summary(),
                    "pca_explained_ratio": prompt_summary["pca_explained_ratio"],
                }.items()
            ],
        },
    )
    return prompt_summary, section, [fig_traj, fig_conv, fig_pi]


def _exit_steps_section(
    model: RecurrentDepthLM, prompts: Sequence[Prompt], criterion, s: AnalysisSettings, out: Path
) -> tuple[dict, Section, Path]:
    """Figure 4: per-token exit steps by prompt group: (their summary, the report section, the figure)."""
    from rdlm.analysis.exit_steps import exit_steps

    max_steps = s.num_steps if s.exit_max_steps is None else s.exit_max_steps
    groups: dict[str, list[np.ndarray]] = {}
    for prompt in prompts:
        steps = exit_steps(model, prompt.token_ids, criterion, max_steps, seed=s.seed, init_scale=s.init_scale)
        groups.setdefault(prompt.category or prompt.name, []).append(steps)
    merged = {k: np.concatenate(v) for k, v in groups.items()}
    name = f"{criterion.name} < {criterion.threshold:g}"
    fig_exit = plots.plot_exit_histograms(merged, max_steps, name, out / "exit_steps.png")
    summary: dict[str, Any] = {
        "criterion": name,
        "max_steps": max_steps,
        "groups": {
            k: {
                "mean": float(v.mean()),
                "median": float(np.median(v)),
                "never_exited": int((v == max_steps).sum()),
                "tokens": int(v.size),
            }
            for k, v in merged.items()
        },
    }
    section = Section(
        title="Exit steps (Figure 4 style)",
        text="",
        notes=[
            (
                "Teacher-forced: the prompt is iterated as a whole and read out after every iteration; "
                f"a token's exit step is the first iteration where {name} holds (capped at {max_steps})."
            )
        ],
        figures=[Figure(fig_exit, "Distribution of per-token exit steps per group.")],
        tables={"exit steps": [{"group": k, **v} for k, v in summary["groups"].items()]},
    )
    return summary, section, fig_exit


def plots_doc_dynamics(t: DynamicsThresholds) -> str:
    return (
        f"Heuristic on the last {t.tail_fraction:.0%} of each trajectory: fixed point if the mean "
        f"step is below {t.still_tol:g} of the state norm or the step length shrinks by more than "
        f"{1 / t.shrink_tol:g}x across the tail; otherwise slider if net displacement / path length "
        f"> {t.straight_tol:g}, else orbit (see rdlm/analysis/dynamics.py)."
    )
