"""What a run reports: a JSONL log, TensorBoard (optional), a progress bar, and collapse warnings.

Evaluation metrics (docs/architecture.md#monitoring): validation perplexity at several r, token-to-token
correlation of the final hidden state, and the relative change of the last iteration
||s_r - s_{r-1}|| / ||s_r||.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rdlm.data.shards import Batch
from rdlm.fileio import write_text
from rdlm.inference.evaluate import nll_vs_steps
from rdlm.model.lm import RecurrentDepthLM


class CollapseWarning(UserWarning):
    """A failure signature of recurrent-depth training (docs/architecture.md#monitoring) appeared."""


# ------------------------------------------------------------------------------------------------
# Evaluation


def token_correlation(state: Tensor) -> float:
    """Mean Pearson correlation between different tokens' state vectors in a sequence.

    Near 1 means every token carries the same hidden state: the collapse seen at scale.
    """
    x = state.float()
    x = x - x.mean(dim=-1, keepdim=True)
    x = F.normalize(x, dim=-1)
    gram = x @ x.transpose(1, 2)  # [B, S, S]
    seq = gram.shape[-1]
    if seq < 2:
        return float("nan")
    off_diagonal = gram.sum(dim=(1, 2)) - gram.diagonal(dim1=1, dim2=2).sum(dim=-1)
    return (off_diagonal / (seq * (seq - 1))).mean().item()


@torch.no_grad()
def evaluate(
    model: RecurrentDepthLM,
    batches: Sequence[Batch],
    num_steps: Sequence[int],
    seed: int = 0,
    autocast: torch.autocast | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Validation perplexity at each r (same s_0 draws every time), plus state statistics."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    metrics: dict[str, float] = {}
    try:
        scores = nll_vs_steps(
            model, [(b.input_ids, b.labels) for b in batches], num_steps, seed=seed, autocast=autocast, device=device
        )
        for r in num_steps:
            loss = scores[int(r)].mean_nll
            metrics[f"val_loss_r{r}"] = loss
            metrics[f"val_ppl_r{r}"] = math.exp(min(loss, 50))
        # State statistics at the model's mean recurrence, on the first batch.
        r = model.config.mean_recurrence
        generator = torch.Generator(device=device).manual_seed(seed)
        with autocast or contextlib.nullcontext():
            out = model(batches[0].input_ids.to(device), num_steps=r, generator=generator, return_trajectory=True)
        last, previous = out.trajectory[-1].float(), out.trajectory[-2].float()
        metrics["token_correlation"] = token_correlation(last)
        metrics["state_rel_change"] = (
            ((last - previous).norm(dim=-1) / last.norm(dim=-1).clamp_min(1e-12)).mean().item()
        )
    finally:
        model.train(was_training)
    return metrics


def collapse_signatures(
    metrics: dict[str, float], num_steps: Sequence[int], correlation_limit: float = 0.95, flat_tolerance: float = 0.01
) -> list[str]:
    """Messages for each collapse signature (docs/architecture.md#monitoring) present in `metrics`."""
    found = []
    corr = metrics.get("token_correlation")
    if corr is not None and corr > correlation_limit:
        found.append(f"hidden-state collapse: token-to-token correlation {corr:.3f} > {correlation_limit}")
    if len(num_steps) >= 2:
        low, high = metrics[f"val_ppl_r{min(num_steps)}"], metrics[f"val_ppl_r{max(num_steps)}"]
        if abs(low - high) <= flat_tolerance * high:
            found.append(
                f"the model ignores the recurrent state: validation perplexity {low:.3f} at "
                f"r={min(num_steps)} vs {high:.3f} at r={max(num_steps)}"
            )
    return found


def warn_loudly(message: str) -> None:
    bar = "!" * 80
    print(f"\n{bar}\nWARNING: {message}\n{bar}", file=sys.stderr, flush=True)
    warnings.warn(message, CollapseWarning, stacklevel=2)


# ------------------------------------------------------------------------------------------------
# Throughput

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40": 181e12, "RTX 6000 Ada": 182e12}


def peak_flops(device: torch.device, configured: float | None) -> float | None:
    """Peak bf16 FLOP/s: configured, or looked up from the GPU name; None on CPU (no MFU then)."""
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_FLOPS.items():
            if key in name:
                return value
    return None


# ------------------------------------------------------------------------------------------------
# Writers


class Monitor:
    """JSONL log (always, when there is an output directory), TensorBoard (if installed), tqdm bar."""

    def __init__(
        self,
        out_dir: str | os.PathLike | None,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool = True,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.log_file = None
        self.tb = None
        self.bar = None
        if not enabled:
            return
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            self.log_path = out / "log.jsonl"
            truncate_log(self.log_path, start_step)
            self.log_file = open(self.log_path, "a")  # noqa: SIM115 (open for the run, closed by close())
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
                except ImportError:
                    print(
                        "rdlm train: tensorboard is not installed; skipping the TensorBoard log "
                        "(pip install 'rdlm[monitor]')",
                        file=sys.stderr,
                    )
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.log_file is not None:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()
        if self.tb is not None:
            prefix = "val" if record.get("kind") == "eval" else "train"
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])
        if self.bar is not None and record.get("kind") == "train":
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", r=record["num_steps"], refresh=False)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if self.log_file is not None:
            self.log_file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()


def truncate_log(path: Path, step: int) -> None:
    """Drop records after `step` (left by a run killed after its last checkpoint), atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    write_text(path, "".join(line + "\n" for line in keep))


def read_log(path: str | os.PathLike, kind: str = "train") -> list[dict]:
    return [
        r
        for r in (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
        if r.get("kind") == kind
    ]
