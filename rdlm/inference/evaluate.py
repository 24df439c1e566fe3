"""Accuracy or perplexity of a model against the number of iterations r (paper Figures 1 and 10).

    sweep = perplexity_vs_steps(model, documents, [1, 2, 4, 8, 16, 32])      # token id lists
    scores = nll_vs_steps(model, [(input_ids, labels), ...], [1, 4, 16])      # per-row NLL sums at each r
    plot_sweeps(sweeps, "saturation.png")

A recurrent-depth model should improve with r and then saturate; a flat curve from r = 1 means the
model learned to ignore its state (a failure mode the paper reports, docs/architecture.md#monitoring).

`score_targets` is the one place that turns a forward pass at r into negative log-likelihoods (per row:
the summed NLL of its targets, their number, whether each was the argmax), and `nll_vs_steps` the one
sweep over r (the same s_0 draws at every r). Perplexity here, the training run's validation loss
(rdlm.train.monitor) and lm-eval's loglikelihood requests (rdlm.integrations.lm_eval) all use them;
lm-eval task accuracy against r is `rdlm.integrations.lm_eval.accuracy_vs_steps` (same `DepthSweep`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from rdlm.checks import check_int
from rdlm.data.shards import IGNORE_INDEX
from rdlm.fileio import atomic_write, write_json
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


@dataclass
class TargetScores:
    """Per row: the negative log-likelihood of its targets, summed, their number, and whether every
    target was the most likely token."""

    nll: Tensor  # [rows] float32
    targets: Tensor  # [rows] long
    greedy: Tensor  # [rows] bool

    @property
    def mean_nll(self) -> float:
        """The NLL per target over all rows (NaN where no row has a target)."""
        return float(self.nll.double().sum()) / max(int(self.targets.sum()), 1) if self.nll.numel() else math.nan

    @classmethod
    def cat(cls, parts: Sequence[TargetScores]) -> TargetScores:
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in ("nll", "targets", "greedy")))


def score_targets(
    model: RecurrentDepthLM,
    input_ids: Tensor,
    labels: Tensor,
    num_steps: int,
    *,
    initial_state: Tensor | None = None,
    init_scale: float = 1.0,
    generator: torch.Generator | None = None,
    autocast: AbstractContextManager | None = None,
) -> TargetScores:
    """One forward pass at r = num_steps over input_ids [B, L]; labels [B, L] holds the token each
    position should predict, IGNORE_INDEX where none. s_0 is `initial_state`, else drawn with
    `init_scale` from `generator`. Log-probabilities are taken in float32 whatever the model's dtype;
    `autocast` wraps the forward pass only."""
    with autocast or nullcontext():
        logits = model(
            input_ids, num_steps=num_steps, initial_state=initial_state, init_scale=init_scale, generator=generator
        ).logits
    log_probs = F.log_softmax(logits.float(), dim=-1)
    scored = labels != IGNORE_INDEX
    picked = log_probs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    nll = -torch.where(scored, picked, 0.0).sum(dim=-1)
    greedy = ((log_probs.argmax(dim=-1) == labels) | ~scored).all(dim=-1)
    return TargetScores(nll, scored.sum(dim=-1), greedy)


@torch.no_grad()
def gate_exit_logits(
    model: RecurrentDepthLM,
    input_ids: Tensor,
    num_steps: int,
    threshold: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(logits [B, S, V], exit iteration [B, S], 1-based) of a model with a learned exit gate (Ouro),
    teacher-forced: every token runs `num_steps` iterations and is read out at the first iteration whose
    cumulative exit probability reaches `threshold` (default the checkpoint's), the last if none does.
    What the reference computes when given an exit threshold (rdlm.inference.exits.criteria, "gate-exact")."""
    from rdlm.inference.exits.criteria import make_exit_criterion
    from rdlm.inference.exits.track import ExitTrack, iterate_with_exits

    threshold = model.config.exit_threshold if threshold is None else threshold
    criterion = make_exit_criterion("gate", threshold)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    rope = model.rope(positions)
    embedded = model.embed(input_ids, rope)
    state = model.init_state(embedded)
    track = ExitTrack.start(input_ids.numel(), input_ids.device, gate=True)
    _, track = iterate_with_exits(
        lambda s, i, exited: model.step(s, embedded, i, rope),
        None,
        state,
        track,
        criterion,
        0,
        num_steps,
        num_steps,
        min_steps=1,
        freeze=False,
        gate=model.exit_probability,
    )
    assert track.exit_state is not None  # a gate track, unfrozen: it keeps each token's state at its exit
    logits = model.readout(track.exit_state.view_as(state), rope)
    return logits, track.iterations.view(input_ids.shape)


@torch.no_grad()  # scores only: no graph (a caller in training mode would otherwise keep one per batch)
def nll_vs_steps(
    model: RecurrentDepthLM,
    batches: Iterable[tuple[Tensor, Tensor]],
    num_steps: Sequence[int],
    *,
    seed: int = 0,
    init_scale: float = 1.0,
    autocast: AbstractContextManager | None = None,
    device: torch.device | None = None,
    progress: bool = False,
) -> dict[int, TargetScores]:
    """`score_targets` of every (input_ids, labels) batch at each r, rows in order. s_0 comes from one
    generator seeded with `seed` afresh at every r, so every r starts from the same draws. `progress`: a
    bar on stderr, weighted by iterations (a batch at r = 32 is 32 times one at r = 1)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device if device is None else device
    batches = list(batches)
    scores = {}
    with tqdm(
        total=sum(map(int, num_steps)) * len(batches),
        disable=not progress,
        unit="it",
        leave=False,
        dynamic_ncols=True,
        desc="batch iterations",
    ) as bar:
        for r in num_steps:
            generator = torch.Generator(device=device).manual_seed(seed)
            bar.set_postfix_str(f"r={r}")
            parts = []
            for ids, labels in batches:
                parts.append(
                    score_targets(
                        model,
                        ids.to(device),
                        labels.to(device),
                        int(r),
                        init_scale=init_scale,
                        generator=generator,
                        autocast=autocast,
                    )
                )
                bar.update(int(r))
            scores[int(r)] = TargetScores.cat(parts)
    return scores


def check_steps(num_steps: Sequence[int]) -> list[int]:
    steps = [int(r) for r in num_steps]
    if not steps or any(r < 1 for r in steps):
        raise ValueError(f"num_steps must be a non-empty list of integers >= 1, got {list(num_steps)}")
    return steps


def check_sweep_fits(
    config, device: torch.device, lengths: Sequence[int], steps: Sequence[int], batch_size: int, seq_len: int
) -> None:
    """Refuse a sweep whose one batch cannot fit in memory or whose batches cannot end (rdlm.resources:
    lower bounds); warn when long. `lengths`: the predicted tokens of each window (or one per request)."""
    width = min(max(lengths), seq_len)
    check_memory(
        batch_size * width * config.vocab_size * 4,
        device,
        f"--batch-size {batch_size}: the logits of {batch_size} x {width} tokens",
    )
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
            pieces.append(list(doc[start : start + seq_len + 1]))
    return [p for p in pieces if len(p) > 1]


@torch.inference_mode()
def perplexity_vs_steps(
    model: RecurrentDepthLM,
    documents: Sequence[Sequence[int]],
    num_steps: Sequence[int],
    *,
    seq_len: int | None = None,
    batch_size: int = 8,
    init_scale: float = 1.0,
    seed: int = 0,
    task: str = "text",
    progress: bool = False,
) -> DepthSweep:
    """exp(mean next-token negative log-likelihood) over `documents` (token id lists) at each r; `progress`:
    a bar on stderr."""
    steps = check_steps(num_steps)
    if seq_len is not None:
        check_int("seq_len", seq_len, note=" (None: the model's context)")
    check_int("batch_size", batch_size)
    if not math.isfinite(init_scale) or init_scale < 0:
        raise ValueError(f"init_scale must be a finite number >= 0, got {init_scale!r}")
    seq_len = min(model.config.context_length if seq_len is None else seq_len, model.config.context_length)
    pieces = windows(documents, seq_len)
    if not pieces:
        raise ValueError("no document has two or more tokens: nothing to predict")
    device = next(model.parameters()).device
    check_sweep_fits(model.config, device, [len(p) - 1 for p in pieces], steps, batch_size, seq_len)
    batches = []
    for start in range(0, len(pieces), batch_size):
        batch = pieces[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width - 1), IGNORE_INDEX, dtype=torch.long)
        for row, piece in enumerate(batch):
            ids[row, : len(piece)] = torch.tensor(piece)
            labels[row, : len(piece) - 1] = torch.tensor(piece[1:])
        batches.append((ids[:, :-1], labels))
    model.eval()
    sweep = DepthSweep(task=task, metric="perplexity", higher_is_better=False)
    for r, scores in nll_vs_steps(model, batches, steps, seed=seed, init_scale=init_scale, progress=progress).items():
        nll = scores.mean_nll
        if not math.isfinite(nll):
            raise FloatingPointError(
                f"{task}: the model's logits are not finite at r={r} (an overflow in this "
                "dtype, or weights may be NaN: "
                f"{getattr(model, 'source', None) or 'the model'}); no perplexity"
            )
        sweep.num_steps.append(r)
        sweep.values.append(math.exp(nll))
    return sweep


def plot_sweeps(sweeps: Sequence[DepthSweep], path: str | os.PathLike, title: str | None = None) -> Path:
    """One panel per metric, one line per task, r on a log2 axis (as in the paper's Figures 1 and 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(dict.fromkeys(s.metric for s in sweeps))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
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
