"""Goodness-of-fit checks shared by the speculative-sampling tests (no scipy here)."""

from __future__ import annotations

import math

import torch

_Z_999 = 3.090232306167813  # standard normal quantile at 0.999


def chi2_bound(df: int) -> float:
    """The 99.9% quantile of the chi-square distribution with df degrees of freedom (no scipy here).

    Wilson-Hilferty: (X / df) ** (1/3) is close to normal with mean 1 - 2/(9 df) and variance
    2/(9 df), so the quantile is df * (1 - 2/(9 df) + z * sqrt(2/(9 df))) ** 3 with z the normal
    99.9% quantile. Against the exact values: df=1 11.16 (10.83), df=5 20.75 (20.52), df=10 29.76
    (29.59), df=30 59.81 (59.70): a little above, i.e. on the lenient side by < 3%.
    """
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + _Z_999 * math.sqrt(a)) ** 3


def assert_fits(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Pearson chi-square goodness of fit of `counts` (any shape) to `probs` (same shape, sums to 1).

    Cells with p = 0 must be empty. Cells of expected count < 5 are pooled into one bin (merged into
    the smallest regular bin when the pool itself expects < 5). The statistic must stay below the
    99.9% quantile of chi-square with (bins - 1) degrees of freedom. Every draw in these tests comes
    from a fixed seed, so the outcome is deterministic (no flakes), and a 1-in-1000 bound is what a
    correct sampler has to pass for the seed chosen.
    """
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert abs(float(probs.sum()) - 1.0) < 1e-6
    probs = probs / probs.sum()
    n = float(counts.sum())
    impossible = int(counts[probs == 0].sum())
    assert impossible == 0, f"{what}: {impossible} draws landed on tokens of probability 0"
    expected = probs * n
    big = expected >= 5.0
    obs, exp = counts[big].tolist(), expected[big].tolist()
    small_obs, small_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if small_exp >= 5.0:
        obs.append(small_obs)
        exp.append(small_exp)
    elif small_exp > 0.0:
        j = min(range(len(exp)), key=exp.__getitem__)
        obs[j] += small_obs
        exp[j] += small_exp
    df = len(exp) - 1
    assert df >= 1, f"{what}: too few bins to test"
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    bound = chi2_bound(df)
    assert stat < bound, f"{what}: chi-square {stat:.1f} >= {bound:.1f} (df={df}), counts {obs}, expected {exp}"


def assert_rate(successes: int, trials: int, p: float, what: str) -> None:
    """A binomial count within 4 standard deviations of its mean (deterministic draws)."""
    sigma = math.sqrt(trials * p * (1.0 - p))
    assert abs(successes - trials * p) <= 4.0 * sigma + 1e-9, \
        f"{what}: {successes}/{trials} = {successes / trials:.4f}, expected {p:.4f}"
