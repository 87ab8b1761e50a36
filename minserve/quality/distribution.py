"""Is a sampler's output distributed as it should be? Pearson's chi-square test, with no scipy.

Speculative decoding promises the target model's distribution, unchanged (chapter 08). The promise is
tested the way a statistician would: draw many samples, count each token, and compare the counts with the
expected ones. Under the null hypothesis (the sampler is right) the statistic

    X² = Σ (observed − expected)² / expected

follows a chi-square distribution with (categories − 1) degrees of freedom, so a value above its
1 − ``alpha`` quantile happens by chance with probability ``alpha`` only. The quantile comes from the
Wilson–Hilferty approximation (accurate to about 1% from 3 degrees of freedom up), built on the standard
library's normal distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

MIN_EXPECTED = 5.0  # the usual rule: pool categories expected fewer times than this


@dataclass(frozen=True)
class ChiSquareResult:
    """``statistic`` against ``critical`` (the 1 − ``alpha`` quantile with ``df`` degrees of freedom);
    ``passed`` when the statistic is at most the critical value: no evidence against the distribution."""

    statistic: float
    df: int
    critical: float
    alpha: float

    @property
    def passed(self) -> bool:
        return self.statistic <= self.critical


def chi_square_quantile(df: int, quantile: float) -> float:
    """The ``quantile`` point of the chi-square distribution with ``df`` degrees of freedom (Wilson–Hilferty)."""
    if df < 1 or not 0 < quantile < 1:
        raise ValueError(f"need df ≥ 1 and 0 < quantile < 1, got {df} and {quantile}")
    z = NormalDist().inv_cdf(quantile)
    spread = 2.0 / (9.0 * df)
    return df * (1.0 - spread + z * math.sqrt(spread)) ** 3


def chi_square_test(observed: Sequence[int], probabilities: Sequence[float], alpha: float = 1e-3) -> ChiSquareResult:
    """Test counts ``observed[i]`` of category i against the probabilities it should have.

    Categories expected fewer than :data:`MIN_EXPECTED` times are pooled into one, so the approximation
    holds; a category with probability 0 that was observed fails the test outright (infinite statistic).
    """
    if len(observed) != len(probabilities):
        raise ValueError(f"{len(observed)} counts against {len(probabilities)} probabilities")
    total = sum(observed)
    if total == 0 or not math.isclose(sum(probabilities), 1.0, rel_tol=1e-6):
        raise ValueError("need at least one observation and probabilities that sum to 1")
    if any(count > 0 and p == 0 for count, p in zip(observed, probabilities)):
        return ChiSquareResult(math.inf, max(len(observed) - 1, 1), math.nan, alpha)
    cells = [(count, p * total) for count, p in zip(observed, probabilities) if p > 0]
    big = [cell for cell in cells if cell[1] >= MIN_EXPECTED]
    small = [cell for cell in cells if cell[1] < MIN_EXPECTED]
    if small:
        big.append((sum(c for c, _ in small), sum(e for _, e in small)))
    if len(big) < 2:
        raise ValueError("too few observations for a test: fewer than two categories expected 5 times")
    statistic = sum((count - expected) ** 2 / expected for count, expected in big)
    df = len(big) - 1
    return ChiSquareResult(statistic, df, chi_square_quantile(df, 1 - alpha), alpha)


def chi_square_two_sample(counts_a: Sequence[int], counts_b: Sequence[int], alpha: float = 1e-3) -> ChiSquareResult:
    """Test whether two samplers draw from one distribution, from their counts per category (homogeneity).

    With no known probabilities, each category's expected count in each sample is its pooled share of that
    sample's size. Categories the pooled share expects fewer than :data:`MIN_EXPECTED` times in either sample
    are pooled into one. The statistic sums over both samples and has (categories − 1) degrees of freedom.
    """
    if len(counts_a) != len(counts_b):
        raise ValueError(f"{len(counts_a)} categories against {len(counts_b)}")
    size_a, size_b = sum(counts_a), sum(counts_b)
    if size_a == 0 or size_b == 0:
        raise ValueError("need observations in both samples")
    share_a = size_a / (size_a + size_b)
    cells = [(a, b) for a, b in zip(counts_a, counts_b) if a + b > 0]
    smallest_share = min(share_a, 1 - share_a)
    big = [cell for cell in cells if sum(cell) * smallest_share >= MIN_EXPECTED]
    small = [cell for cell in cells if sum(cell) * smallest_share < MIN_EXPECTED]
    if small:
        big.append((sum(a for a, _ in small), sum(b for _, b in small)))
    if len(big) < 2:
        raise ValueError("too few observations for a test: fewer than two categories expected 5 times")
    statistic = 0.0
    for a, b in big:
        expected_a, expected_b = (a + b) * share_a, (a + b) * (1 - share_a)
        statistic += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    df = len(big) - 1
    return ChiSquareResult(statistic, df, chi_square_quantile(df, 1 - alpha), alpha)
