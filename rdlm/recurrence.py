"""Sampling the number of recurrence steps r for training (SPEC section 3, paper section 3.3).

Every micro-batch draws one r; only the last `backprop_depth` iterations keep gradients (truncated
backpropagation), so a draw is returned as the split (steps without gradient, steps with gradient).
This is the one place in the code where r is drawn.

Samplers (all draw from a `torch.Generator`, so a seed reproduces them):

    lognormal-poisson   tau ~ N(log m - sigma^2/2, sigma), r = 1 + Poisson(e^tau)   (the paper's default)
    fixed               r = m
    uniform             r = 1 + U{0, ..., 2m}
    geometric           r = 1 + Geometric(p = 1/(m + 1)) on {0, 1, ...}
    exponential         r = 1 + round(Exp(mean m))
    gamma               r = 1 + round(Gamma(shape 1/sigma^2, scale m sigma^2))  (relative spread sigma)
    irwin-hall          r = 1 + round(m * (U_1 + U_2 + U_3) * 2/3)  (sum of 3 uniforms, range 0..2m)

Every stochastic sampler has E[r] = m + 1 (m on average, plus the one step every draw gets), as the
paper's log-normal Poisson does, so ablations compare distributions of equal mean compute.

Data-parallel workers must run the same r for a micro-batch (locked-step): `draw_for_microbatch`
derives the draw from a shared seed and the micro-batch index alone, so it is the same on every worker
and after a resume.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

Sampler = Callable[[float, float, torch.Generator | None], int]


def _uniform01(generator: torch.Generator | None) -> float:
    return torch.rand((), generator=generator, dtype=torch.float64).item()


def _normal(generator: torch.Generator | None) -> float:
    return torch.randn((), generator=generator, dtype=torch.float64).item()


def _lognormal_poisson(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    # tau ~ N(log(mean) - sigma^2/2, sigma), r ~ Poisson(exp(tau)) + 1: mostly below the mean, heavy tail.
    tau = math.log(mean) - sigma**2 / 2 + sigma * _normal(generator)
    rate = torch.tensor(math.exp(tau), dtype=torch.float64)
    return int(torch.poisson(rate, generator=generator).item()) + 1


def _fixed(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    return max(1, round(mean))


def _uniform(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    high = round(2 * mean)
    return 1 + int(torch.randint(0, high + 1, (), generator=generator).item())


def _geometric(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    # Number of failures before the first success, p = 1/(mean+1), by inversion.
    p = 1.0 / (mean + 1.0)
    u = 1.0 - _uniform01(generator)  # in (0, 1]
    return 1 + int(math.floor(math.log(u) / math.log1p(-p)))


def _exponential(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    u = 1.0 - _uniform01(generator)
    return 1 + round(-mean * math.log(u))


def _standard_gamma(shape: float, generator: torch.Generator | None) -> float:
    """Marsaglia-Tsang (2000), driven by `generator` (torch's own gamma takes none)."""
    if shape < 1:  # boost: G(a) = G(a+1) * U^(1/a)
        return _standard_gamma(shape + 1, generator) * (1.0 - _uniform01(generator)) ** (1 / shape)
    d = shape - 1 / 3
    c = 1 / math.sqrt(9 * d)
    while True:
        x = _normal(generator)
        v = (1 + c * x) ** 3
        if v <= 0:
            continue
        u = 1.0 - _uniform01(generator)
        if math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
            return d * v


def _gamma(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    if sigma <= 0:
        return 1 + round(mean)
    shape = 1 / sigma**2
    return 1 + round(_standard_gamma(shape, generator) * mean / shape)


def _irwin_hall(mean: float, sigma: float, generator: torch.Generator | None) -> int:
    total = sum(_uniform01(generator) for _ in range(3))  # Irwin-Hall(3): mean 1.5, range [0, 3]
    return 1 + round(mean * total * 2 / 3)


SAMPLERS: dict[str, Sampler] = {
    "lognormal-poisson": _lognormal_poisson,
    "fixed": _fixed,
    "uniform": _uniform,
    "geometric": _geometric,
    "exponential": _exponential,
    "gamma": _gamma,
    "irwin-hall": _irwin_hall,
}


def sample_num_steps(mean: float, backprop_depth: int, sampler: str = "lognormal-poisson",
                     sigma: float = 0.5, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Draw r and split it into (r - k, k) with k = min(backprop_depth, r)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown recurrence sampler {sampler!r}; available: {sorted(SAMPLERS)}")
    if mean < 1:
        raise ValueError(f"mean recurrence must be >= 1, got {mean}")
    if backprop_depth < 1:
        raise ValueError(f"backprop_depth must be >= 1, got {backprop_depth}")
    r = SAMPLERS[sampler](mean, sigma, generator)
    with_grad = min(backprop_depth, r)
    return r - with_grad, with_grad


def microbatch_seed(seed: int, index: int, stream: int = 0) -> int:
    """A 63-bit seed for micro-batch `index` of a run seeded `seed`; `stream` separates uses (r, s_0)."""
    # splitmix64-style mixing so that neighbouring (seed, index) pairs give unrelated generators.
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


def draw_for_microbatch(seed: int, index: int, mean: float, backprop_depth: int,
                        sampler: str = "lognormal-poisson", sigma: float = 0.5) -> tuple[int, int]:
    """The (no-grad, with-grad) split for global micro-batch `index`: the same on every worker."""
    generator = torch.Generator().manual_seed(microbatch_seed(seed, index))
    return sample_num_steps(mean, backprop_depth, sampler, sigma, generator)
