"""Chapter 07's checks: what the formats claim, held against what the engine measured.

Each ``check_*`` raises ``AssertionError`` (saying what differed) unless the measurements show the property,
and returns the numbers it compared; tests/test_ch07_checks.py shows each failing on data without it. A
rounding that truncates fails :func:`check_round_trip`; a quantized layer that widens its weight every step
(reading more bytes, not fewer) fails :func:`check_speed_follows_kernels`, and so does a narrower format whose
kernel keeps up with the wider one's but whose decode is not faster; a format that loses the model fails
:func:`check_quality`; int4 no farther from a true float model than int8 fails :func:`check_bits_order`;
re-gridding a 4-bit file that costs nothing fails :func:`check_regridding`; a migration that does not help
fails :func:`check_smoothing`; a cache that stores wider codes, or scales beside every token, fails
:func:`check_kv_bytes`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pandas as pd

from minserve.lab.checks import require


def check_round_trip(table: pd.DataFrame) -> dict[str, float]:
    """Every format brought every weight back within its bound (half a step; fp8: half an ulp)."""
    worst = table["worst error / bound"].to_dict()
    over = {f: w for f, w in worst.items() if w > 1 + 1e-5}
    require(not over, f"round trips past their bound: {over}")
    return worst


def check_speed_follows_kernels(
    speed: pd.DataFrame,
    kernel_gb_s: dict[str, float],
    order: Sequence[str],
    kernel_time_at_most: float = 0.65,
    packed: Sequence[str] = ("int8", "int4"),
    packed_gain: float = 1.0,
) -> dict:
    """Fewer bytes decode faster wherever the narrower format's kernel delivers them. For every pair of
    ``order`` (most bytes first) whose bytes a step differ at least twofold, the one-row kernels' time is
    bytes / the GB/s each streamed (``kernel_gb_s``, per format); where the narrower kernel's time is at most
    ``kernel_time_at_most`` × the wider's, the narrower format decodes faster. A pair whose narrower kernel is
    not that much faster is reported, not judged: the roofline bounds time from below, and a kernel that
    streams its weight slowly misses it, whatever the bytes. And the packed formats (``packed``) decode more
    than ``packed_gain`` × float32's speed (1: faster at all): a format that widens its weight every call,
    moving more bytes than float32, is slower and fails. (Pairs closer than twofold, int8 against int4, are
    not judged: the rest of the step and a shared CPU's noise are as large as what 1.4× fewer bytes save.)"""
    rates = {f: float(speed.loc[f, "tokens/s"]) for f in order}
    read = {f: float(speed.loc[f, "read per step (MB)"]) for f in order}
    require(list(read.values()) == sorted(read.values(), reverse=True), f"{list(order)} do not read ever fewer bytes")
    slow = {f: round(rates[f] / rates["fp32"], 2) for f in packed if not rates[f] > packed_gain * rates["fp32"]}
    require(not slow, f"packed formats decode only {slow} × float32's speed, not > {packed_gain}×")
    kernel_time = {f: read[f] / kernel_gb_s[f] for f in order}  # ms a step's matmuls would take at that rate
    twofold = [(a, b) for a, b in itertools.combinations(order, 2) if read[a] >= 2 * read[b]]
    judged = [(a, b) for a, b in twofold if kernel_time[b] <= kernel_time_at_most * kernel_time[a]]
    slower = [(a, b) for a, b in judged if rates[b] <= rates[a]]
    require(not slower, f"half the bytes or fewer, a kernel that delivers them, but not faster: {slower} ({rates})")
    behind = [(a, b) for a, b in twofold if (a, b) not in judged]
    return {"tokens/s": rates, "judged": judged, "kernel not faster (not judged)": behind}


def check_kv_bytes(
    capacity: pd.DataFrame,
    full: str = "float32",
    narrow: Sequence[str] = ("int8", "fp8"),
    ratio: float = 4.0,
    slack: float = 0.01,
) -> dict[str, float]:
    """Each one-byte cache's allocated bytes per token (codes and scales, as the engine allocated them)
    are at most (1 + ``slack``) / ``ratio`` of the ``full`` cache's: one byte per element where float32
    spends four, and scales that cost (almost) nothing per token. Codes wider than a byte, or a scale stored
    beside every token's head (2 or 4 bytes per 64 elements: +3% or +6%), break it."""
    per_token = capacity["allocated bytes/token"].to_dict()
    shares = {k: per_token[k] / per_token[full] for k in narrow}
    over = {k: round(v, 4) for k, v in shares.items() if v > (1 + slack) / ratio}
    require(not over, f"one-byte caches allocate {over} of {full}'s bytes a token, more than {(1 + slack) / ratio:.4f}")
    return shares


def check_quality(
    quality: pd.DataFrame, close: Sequence[str], kl_bound: float = 0.01, top1_above: float = 0.9
) -> dict[str, float]:
    """Each format in ``close`` stays within ``kl_bound`` nats/token of the float model with top-1 agreement
    above ``top1_above``."""
    kl = quality["KL (nats/token)"].to_dict()
    far = {f: kl[f] for f in close if not kl[f] < kl_bound}
    require(not far, f"formats beyond KL {kl_bound}: {far}")
    top1 = quality["top-1 agreement"]
    disagree = {f: float(top1[f]) for f in close if not top1[f] > top1_above}
    require(not disagree, f"top-1 agreement at or below {top1_above}: {disagree}")
    return {f: kl[f] for f in close}


def check_bits_order(
    quality: pd.DataFrame, narrow: str = "int4-g64", wide: str = "int8", at_least: float = 3.0
) -> dict:
    """Against a model whose weights were never narrower than float, fewer bits cost more: ``narrow``'s KL is
    at least ``at_least`` × ``wide``'s."""
    kl = quality["KL (nats/token)"]
    require(
        kl[narrow] >= at_least * kl[wide], f"{narrow} KL {kl[narrow]:.5f} is not {at_least}× {wide}'s {kl[wide]:.5f}"
    )
    return {narrow: float(kl[narrow]), wide: float(kl[wide]), "ratio": float(kl[narrow] / kl[wide])}


def check_regridding(
    quality: pd.DataFrame, regridded: str = "int4-g64", kept: str = "int4", factor: float = 10.0
) -> dict:
    """On a file already in 4-bit blocks, re-gridding onto other groups (``regridded``) costs at least
    ``factor`` × what keeping the file's blocks (``kept``) does: a second rounding onto a misaligned grid."""
    kl = quality["KL (nats/token)"]
    require(kl[regridded] > factor * kl[kept], f"re-gridding cost KL {kl[regridded]:.4f}, keeping {kl[kept]:.4f}")
    return {regridded: float(kl[regridded]), kept: float(kl[kept])}


def check_smoothing(
    quality: pd.DataFrame, plain: str = "w8a8", smoothed: str = "w8a8-smooth-0.5", gain: float = 2.0
) -> dict:
    """SmoothQuant's migration brings W8A8 at least ``gain`` × closer to the float model, in KL, with top-1
    agreement no lower: the outlier channels, divided down, no longer take the per-token grid."""
    kl, top1 = quality["KL (nats/token)"], quality["top-1 agreement"]
    require(
        kl[smoothed] * gain <= kl[plain],
        f"{smoothed} KL {kl[smoothed]:.4f} is not {gain}× below {plain}'s {kl[plain]:.4f}",
    )
    require(top1[smoothed] >= top1[plain], f"{smoothed} agrees on top-1 less often than {plain}")
    return {plain: float(kl[plain]), smoothed: float(kl[smoothed]), "KL ratio": float(kl[plain] / kl[smoothed])}


def check_activation_aware(
    quality: pd.DataFrame, aware: str = "int4-awq-g64", plain: str = "int4-g64", gain: float = 1.5
) -> dict[str, float]:
    """Activation-aware rounding (``aware``) keeps the model at least ``gain`` times closer to float32, in KL,
    than round-to-nearest at the same bits (``plain``), with a perplexity no higher: the search found the
    columns worth protecting, and folding their scales into the norms changed nothing else."""
    kl = quality["KL (nats/token)"]
    require(kl[aware] * gain <= kl[plain], f"{aware} KL {kl[aware]:.4f} is not {gain}× below {plain}'s {kl[plain]:.4f}")
    perplexity = quality["perplexity"]
    require(perplexity[aware] <= perplexity[plain], f"{aware} perplexity {perplexity[aware]:.2f} > {plain}'s")
    return {aware: float(kl[aware]), plain: float(kl[plain]), "KL ratio": float(kl[plain] / kl[aware])}
