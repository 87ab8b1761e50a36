"""The shape of a workload, in one place: when requests arrive, and how long their prompts and outputs are.

The load tester (:mod:`minserve.bench`), the simulator and the capacity planner (:mod:`minserve.capacity`),
and the chapters all draw their requests from here, so the same specification and seed give the same
arrival times and the same lengths everywhere: a simulated run and a load test of the same workload see the
same requests.

**Arrivals** are offsets in seconds from the start of a run, computed before it starts from the rate and
the seed alone (so a slow server cannot slow the sender: no coordinated omission). ``poisson`` has
exponential gaps; ``gamma`` gaps with shape ``burstiness`` and mean 1/rate (below 1 burstier than Poisson,
above 1 more regular, 1 *is* Poisson); ``constant`` equal gaps. A rate of ``inf`` sends everything at once.

**Lengths** are in tokens, drawn from a :class:`LengthDist`: ``fixed``, ``uniform`` (mean ± spread) or
``lognormal`` (mean and standard deviation), rounded and clipped to [1, max_len]. A spec is written
``"256"``, ``"uniform:256:128"`` or ``"lognormal:256:128"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVALS: tuple[str, ...] = ("poisson", "gamma", "constant")
LENGTH_KINDS: tuple[str, ...] = ("fixed", "uniform", "lognormal")
_OUTPUT_SEED_OFFSET = 1  # output lengths come from their own stream: changing one spec leaves the other alone


# --- arrivals -----------------------------------------------------------------------------------------------


def inter_arrival_gaps(
    num_gaps: int, rate_rps: float, process: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """``num_gaps`` gaps between sends, in seconds, with mean 1/rate.

    Gamma(shape k, scale 1/(k·rate)) has mean 1/rate and coefficient of variation 1/√k; k = 1 is the
    exponential distribution, so Poisson is the gamma process with burstiness 1.
    """
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    if not rate_rps > 0 or not burstiness > 0:
        raise ValueError(f"need rate > 0 and burstiness > 0, got {rate_rps!r}, {burstiness!r}")
    if math.isinf(rate_rps):
        return np.zeros(num_gaps)
    mean_s = 1.0 / rate_rps
    if process == "constant":
        return np.full(num_gaps, mean_s)
    shape = 1.0 if process == "poisson" else burstiness
    return np.random.default_rng(seed).gamma(shape, mean_s / shape, size=num_gaps)


def timetable(
    num_requests: int, rate_rps: float, process: str = "poisson", burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Intended send offsets in seconds for ``num_requests`` requests: 0, then the cumulative gaps."""
    if num_requests <= 0:
        return []
    gaps = inter_arrival_gaps(num_requests - 1, rate_rps, process, burstiness, seed)
    return [0.0, *np.cumsum(gaps).tolist()]


def poisson_arrivals(num_requests: int, rate_rps: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Arrival times in seconds, the first at 0: Poisson at ``rate_rps``, or gamma gaps when ``burstiness``
    is not 1 (:func:`timetable` of the gamma process, which is Poisson at burstiness 1)."""
    return timetable(num_requests, rate_rps, "gamma", burstiness, seed)


def parse_rates(text: str) -> list[float]:
    """``"1,2.5,inf"`` → ``[1.0, 2.5, inf]``; every rate positive (``inf``: everything at once)."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers (or inf), got {text!r}") from None
    if not rates or any(not rate > 0 or math.isnan(rate) for rate in rates):
        raise ValueError(f"--rates must list positive requests/s, got {text!r}")
    return rates


# --- lengths ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDist:
    """A distribution of lengths in tokens: ``fixed``, ``uniform`` or ``lognormal``, clipped to [1, max_len].

    ``mean`` and ``spread`` are in tokens. ``uniform`` draws in [mean − spread, mean + spread]; ``lognormal``
    has the stated mean and standard deviation ``spread`` (before clipping and rounding); ``fixed`` ignores
    ``spread``.
    """

    kind: str = "fixed"
    mean: float = 128
    spread: float = 0.0
    max_len: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length distribution must be fixed, uniform or lognormal, got {self.kind!r}")
        if self.mean < 1 or self.spread < 0 or self.max_len < 1:
            raise ValueError(f"need mean ≥ 1, spread ≥ 0 and max ≥ 1 tokens, got {self}")

    def sample(self, n: int, seed: int = 0) -> list[int]:
        """``n`` lengths in tokens, each in [1, max_len]; the same ``n`` and ``seed`` give the same lengths."""
        rng = np.random.default_rng(seed)
        if self.kind == "fixed":
            values = np.full(n, self.mean)
        elif self.kind == "uniform":
            values = rng.uniform(self.mean - self.spread, self.mean + self.spread, size=n)
        else:
            values = rng.lognormal(*lognormal_params(self.mean, self.spread), size=n)
        return np.clip(np.round(values), 1, self.max_len).astype(int).tolist()


def lognormal_params(mean: float, std: float) -> tuple[float, float]:
    """(μ, σ) of the normal under a lognormal with this mean and standard deviation: σ² = ln(1 + (std/mean)²)."""
    sigma_sq = math.log1p((std / mean) ** 2)
    return math.log(mean) - sigma_sq / 2, math.sqrt(sigma_sq)


def parse_length(spec: str, max_len: int = 1 << 20) -> LengthDist:
    """``"256"`` (fixed), ``"uniform:256:128"`` (256 ± 128) or ``"lognormal:256:128"`` (mean 256, sd 128)."""
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            return LengthDist("fixed", float(parts[0]), 0.0, max_len)
        if len(parts) == 3:
            return LengthDist(parts[0], float(parts[1]), float(parts[2]), max_len)
    except ValueError as error:
        raise ValueError(f"length spec {spec!r}: {error}") from None
    raise ValueError(f"length spec {spec!r}: expected N, uniform:MEAN:SPREAD or lognormal:MEAN:SD")


def request_lengths(prompt: LengthDist, output: LengthDist, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` (prompt tokens, output tokens) pairs: the lengths of a workload's requests, in send order.

    The one draw every user of a workload makes (the load tester, the simulator, the chapters), so a
    specification and a seed mean the same requests everywhere.
    """
    return list(zip(prompt.sample(n, seed), output.sample(n, seed + _OUTPUT_SEED_OFFSET)))
