"""Accuracy or perplexity of a model against the number of iterations r (paper Figures 1 and 10).

    sweep = perplexity_vs_steps(model, documents, [1, 2, 4, 8, 16, 32])      # token id lists
    sweeps = accuracy_vs_steps("path/to/model", ["arc_challenge"], [4, 8, 16, 32])   # via lm-eval
    plot_sweeps(sweeps, "saturation.png")

A recurrent-depth model should improve with r and then saturate; a flat curve from r = 1 means the
model learned to ignore its state (SPEC section 3's failure mode).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from rdlm.fileio import atomic_write, write_json
from rdlm.model.huginn import read_config
from rdlm.model.lm import RecurrentDepthLM
from rdlm.resources import check_memory, check_time, forward_seconds


@dataclass
class DepthSweep:
    """One metric of one task at each r."""
    task: str
    metric: str
    num_steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    higher_is_better: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def check_steps(num_steps: Sequence[int]) -> list[int]:
    steps = [int(r) for r in num_steps]
    if not steps or any(r < 1 for r in steps):
        raise ValueError(f"num_steps must be a non-empty list of integers >= 1, got {list(num_steps)}")
    return steps


def check_sweep_fits(config, device: torch.device, lengths: Sequence[int], steps: Sequence[int], batch_size: int,
                     seq_len: int) -> None:
    """Refuse a sweep whose one batch cannot fit in memory or whose batches cannot end (rdlm.resources:
    lower bounds); warn when long. `lengths`: the predicted tokens of each window (or one per request)."""
    width = min(max(lengths), seq_len)
    check_memory(batch_size * width * config.vocab_size * 4, device,
                 f"--batch-size {batch_size}: the logits of {batch_size} x {width} tokens")
    calls = math.ceil(len(lengths) / batch_size)
    total = sum(forward_seconds(config, device, sum(lengths), calls, r) for r in steps)
    unit = forward_seconds(config, device, batch_size * width, 1, max(steps))
    check_time(total, unit, f"evaluating at r = {','.join(map(str, steps))}", "batch")


def windows(documents: Sequence[Sequence[int]], seq_len: int) -> list[list[int]]:
    """Cut each document into pieces of at most seq_len + 1 tokens that overlap by one token, so every
    token after the first of a document is predicted exactly once."""
    pieces = []
    for doc in documents:
        for start in range(0, max(len(doc) - 1, 0), seq_len):
            pieces.append(list(doc[start:start + seq_len + 1]))
    return [p for p in pieces if len(p) > 1]


@torch.inference_mode()
def perplexity_vs_steps(model: RecurrentDepthLM, documents: Sequence[Sequence[int]], num_steps: Sequence[int],
                        *, seq_len: int | None = None, batch_size: int = 8, init_scale: float = 1.0,
                        seed: int = 0, task: str = "text") -> DepthSweep:
    """exp(mean next-token negative log-likelihood) over `documents` (token id lists) at each r."""
    steps = check_steps(num_steps)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len must be an integer >= 1 (None: the model's context), got {seq_len!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not math.isfinite(init_scale) or init_scale < 0:
        raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale!r}")
    seq_len = min(model.config.context_length if seq_len is None else seq_len, model.config.context_length)
    pieces = windows(documents, seq_len)
    if not pieces:
        raise ValueError("no document has two or more tokens: nothing to predict")
    device = next(model.parameters()).device
    check_sweep_fits(model.config, device, [len(p) - 1 for p in pieces], steps, batch_size, seq_len)
    model.eval()
    sweep = DepthSweep(task=task, metric="perplexity", higher_is_better=False)
    for r in steps:
        generator = torch.Generator(device).manual_seed(seed)  # the same s_0 draws at every r
        total, count = 0.0, 0
        for start in range(0, len(pieces), batch_size):
            batch = pieces[start:start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            labels = torch.full((len(batch), width - 1), -100, dtype=torch.long)
            for row, piece in enumerate(batch):
                ids[row, :len(piece)] = torch.tensor(piece)
                labels[row, :len(piece) - 1] = torch.tensor(piece[1:])
            logits = model(ids[:, :-1].to(device), num_steps=r, init_scale=init_scale, generator=generator).logits
            nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten().to(device), ignore_index=-100,
                                  reduction="sum")
            total += nll.item()
            if not math.isfinite(total):
                raise FloatingPointError(f"{task}: the model's logits are not finite at r={r} (an overflow in "
                                         "this dtype, or weights may be NaN: "
                                         f"{getattr(model, 'source', None) or 'the model'}); no perplexity")
            count += int((labels != -100).sum())
        sweep.num_steps.append(r)
        sweep.values.append(math.exp(total / count))
    return sweep


def accuracy_vs_steps(pretrained: str | os.PathLike, tasks: Sequence[str], num_steps: Sequence[int], *,
                      include_path: str | os.PathLike | None = None, metric: str | None = None,
                      model_args: str = "", batch_size: int = 8, limit: int | None = None,
                      device: str | None = None) -> list[DepthSweep]:
    """Run lm-eval tasks with the `rdlm` model type at each r; one sweep per (task, metric).

    metric: keep only this metric (e.g. "acc_norm"); default every numeric metric the task reports.
    """
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager

        import rdlm.integrations.lm_eval  # noqa: F401  (registers the model type)
    except ImportError as err:
        raise ImportError(f"{err}; accuracy needs lm-eval: pip install 'rdlm[eval]'") from err
    steps = check_steps(num_steps)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    # Requests are not known before lm-eval builds them: at least one request of one token per task.
    check_sweep_fits(read_config(pretrained), torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")),
                     [1] * len(tasks), steps, 1, 1)
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    sweeps: dict[tuple[str, str], DepthSweep] = {}
    for r in steps:
        args = f"pretrained={pretrained},num_steps={r}" + (f",{model_args}" if model_args else "")
        out = lm_eval.simple_evaluate(model="rdlm", model_args=args, tasks=list(tasks), task_manager=manager,
                                      batch_size=batch_size, limit=limit, device=device)
        higher = out.get("higher_is_better", {})
        for task, values in out["results"].items():
            for key, value in values.items():
                name, _, _filter = key.partition(",")
                if not isinstance(value, (int, float)) or name.endswith("_stderr") or name == "sample_len":
                    continue
                if metric is not None and name != metric:
                    continue
                sweep = sweeps.setdefault((task, name), DepthSweep(
                    task=task, metric=name, higher_is_better=bool(higher.get(task, {}).get(name, True))))
                sweep.num_steps.append(r)
                sweep.values.append(float(value))
    if not sweeps:
        raise ValueError(f"the tasks reported no metric{f' named {metric!r}' if metric else ''}")
    return list(sweeps.values())


def plot_sweeps(sweeps: Sequence[DepthSweep], path: str | os.PathLike, title: str | None = None) -> Path:
    """One panel per metric, one line per task, r on a log2 axis (as in the paper's Figures 1 and 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(dict.fromkeys(s.metric for s in sweeps))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for sweep in (s for s in sweeps if s.metric == metric):
            ax.plot(sweep.num_steps, sweep.values, marker="o", label=sweep.task)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("recurrence r (core iterations at test time)")
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path, "wb") as handle:
            fig.savefig(handle, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def write_results(sweeps: Sequence[DepthSweep], path: str | os.PathLike) -> Path:
    return write_json(path, [s.to_dict() for s in sweeps])
