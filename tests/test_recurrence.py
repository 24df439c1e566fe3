import math

import pytest
import torch

from rdlm.model.recurrence import SAMPLERS, draw_for_microbatch, sample_num_steps

STOCHASTIC = [s for s in SAMPLERS if s != "fixed"]


def draws(sampler: str, mean: float, n: int = 4000, sigma: float = 0.5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([sum(sample_num_steps(mean, 8, sampler, sigma, g)) for _ in range(n)],
                        dtype=torch.float64)


@pytest.mark.parametrize("sampler", STOCHASTIC)
def test_sampler_mean_is_mean_plus_one(sampler):
    r = draws(sampler, 8)
    assert r.min() >= 1
    # Standard error of the mean is below 0.1 for every sampler here at n=4000.
    assert abs(r.mean().item() - 9.0) < 0.4, (sampler, r.mean().item())


def test_lognormal_poisson_is_mostly_below_mean_with_heavy_tail():
    r = draws("lognormal-poisson", 32, n=6000)
    median = r.median().item()
    assert median < r.mean().item() < 34  # right-skewed: median below the mean
    # Heavy tail: more than 2% of draws beyond twice the mean, far more than a Poisson(32) gives (~1e-6).
    assert (r > 66).double().mean().item() > 0.02
    assert r.max().item() > 100


def test_tails_differ_between_samplers():
    uniform, irwin = draws("uniform", 8), draws("irwin-hall", 8)
    geometric = draws("geometric", 8)
    # Bounded samplers never exceed 1 + 2m; the geometric one does, often.
    assert uniform.max() <= 17 and irwin.max() <= 17
    assert (geometric > 17).double().mean() > 0.05
    # Irwin-Hall concentrates mass in the middle compared with the uniform.
    assert irwin.std() < 0.75 * uniform.std()
    gamma = draws("gamma", 8, sigma=0.5)
    assert abs(gamma.std().item() / 8 - 0.5) < 0.08  # relative spread sigma


def test_fixed_and_split():
    assert sample_num_steps(6, 4, "fixed") == (2, 4)
    assert sample_num_steps(3, 8, "fixed") == (0, 3)  # fewer steps than the backprop depth
    with pytest.raises(ValueError, match="unknown recurrence sampler 'bogus'"):
        sample_num_steps(4, 2, "bogus")
    with pytest.raises(ValueError, match="mean recurrence"):
        sample_num_steps(0, 2)


def test_microbatch_draws_are_reproducible_and_vary():
    a = [draw_for_microbatch(7, i, 16, 8) for i in range(50)]
    b = [draw_for_microbatch(7, i, 16, 8) for i in range(50)]
    c = [draw_for_microbatch(8, i, 16, 8) for i in range(50)]
    assert a == b
    assert a != c
    assert len({sum(x) for x in a}) > 5
    assert all(k == min(8, n + k) for n, k in a)
    assert not math.isnan(sum(sum(x) for x in a))
