"""Sampling the number of recurrence steps r for training (docs/architecture.md#sampling-r, paper section 3.3).

Every micro-batch draws one r; only the last `backprop_depth` iterations keep gradients (truncated
backpropagation), so a draw is returned as the split (steps without gradient, steps with gradient).
This is the one place in the code where r is drawn.

Samplers (numpy's distributions, seeded from a `torch.Generator`, so a torch seed reproduces them):

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
from collections.abc import Callable

import numpy as np
import torch

# A sampler maps (mean m, spread sigma, random generator) to a draw of r >= 1.
Sampler = Callable[[float, float, np.random.Generator], int]


def _lognormal_poisson(mean: float, sigma: float, rng: np.random.Generator) -> int:
    # tau ~ N(log(mean) - sigma^2/2, sigma), r ~ Poisson(exp(tau)) + 1: mostly below the mean, heavy tail.
    tau = rng.normal(math.log(mean) - sigma**2 / 2, sigma)
    return int(rng.poisson(math.exp(tau))) + 1


def _fixed(mean: float, sigma: float, rng: np.random.Generator) -> int:
    return max(1, round(mean))


def _uniform(mean: float, sigma: float, rng: np.random.Generator) -> int:
    return 1 + int(rng.integers(0, round(2 * mean), endpoint=True))


def _geometric(mean: float, sigma: float, rng: np.random.Generator) -> int:
    # numpy counts trials up to the first success (>= 1); with p = 1/(m+1) its mean is m + 1.
    return int(rng.geometric(1.0 / (mean + 1.0)))


def _exponential(mean: float, sigma: float, rng: np.random.Generator) -> int:
    return 1 + round(rng.exponential(mean))


def _gamma(mean: float, sigma: float, rng: np.random.Generator) -> int:
    if sigma <= 0:
        return 1 + round(mean)
    shape = 1 / sigma**2  # relative spread sigma
    return 1 + round(rng.gamma(shape, mean / shape))


def _irwin_hall(mean: float, sigma: float, rng: np.random.Generator) -> int:
    total = rng.random(3).sum()  # Irwin-Hall(3): mean 1.5, range [0, 3]
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


def sample_num_steps(
    mean: float,
    backprop_depth: int,
    sampler: str = "lognormal-poisson",
    sigma: float = 0.5,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Draw r and split it into (r - k, k) with k = min(backprop_depth, r)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown recurrence sampler {sampler!r}; available: {sorted(SAMPLERS)}")
    if mean < 1:
        raise ValueError(f"mean recurrence must be >= 1, got {mean}")
    if backprop_depth < 1:
        raise ValueError(f"backprop_depth must be >= 1, got {backprop_depth}")
    # One draw from the torch generator seeds the numpy one, so torch seeding reproduces r.
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (), generator=generator)))
    r = SAMPLERS[sampler](mean, sigma, rng)
    with_grad = min(backprop_depth, r)
    return r - with_grad, with_grad


def microbatch_seed(seed: int, index: int, stream: int = 0) -> int:
    """A 63-bit seed for micro-batch `index` of a run seeded `seed`; `stream` separates uses (r, s_0).

    numpy's SeedSequence mixes the three numbers, so neighbouring micro-batches get unrelated draws.
    """
    return int(np.random.SeedSequence([seed, index, stream]).generate_state(1, np.uint64)[0] >> 1)


def draw_for_microbatch(
    seed: int, index: int, mean: float, backprop_depth: int, sampler: str = "lognormal-poisson", sigma: float = 0.5
) -> tuple[int, int]:
    """The (no-grad, with-grad) split for global micro-batch `index`: the same on every worker."""
    generator = torch.Generator().manual_seed(microbatch_seed(seed, index))
    return sample_num_steps(mean, backprop_depth, sampler, sigma, generator)
