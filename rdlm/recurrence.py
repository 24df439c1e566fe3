"""Sampling the number of recurrence steps r for training (SPEC section 3).

Every micro-batch draws one r; only the last `backprop_depth` iterations keep gradients (truncated
backpropagation), so a draw is returned as the split (steps without gradient, steps with gradient).
This is the one place in the code where r is drawn.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

Sampler = Callable[[float, float, torch.Generator | None], int]


def _lognormal_poisson(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    # tau ~ N(log(mean) - sigma^2/2, sigma), r ~ Poisson(exp(tau)) + 1: mostly below the mean, heavy tail.
    tau = math.log(mean) - sigma**2 / 2 + sigma * torch.randn((), generator=generator).item()
    rate = torch.tensor(math.exp(tau), dtype=torch.float64)
    return int(torch.poisson(rate, generator=generator).item()) + 1


def _fixed(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    return max(1, round(mean))


SAMPLERS: dict[str, Sampler] = {
    "lognormal-poisson": _lognormal_poisson,
    "fixed": _fixed,
}


def sample_num_steps(mean: float, backprop_depth: int, sampler: str = "lognormal-poisson",
                     sigma: float = 0.5, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Draw r and split it into (r - k, k) with k = min(backprop_depth, r)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown recurrence sampler {sampler!r}; available: {sorted(SAMPLERS)}")
    if mean < 1:
        raise ValueError(f"mean recurrence must be >= 1, got {mean}")
    r = SAMPLERS[sampler](mean, sigma, generator)
    with_grad = min(backprop_depth, r)
    return r - with_grad, with_grad
