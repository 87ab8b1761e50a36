"""Chapter 07's checks: what the formats claim, held against what the engine measured.

Each ``check_*`` raises ``AssertionError`` (saying what differed) unless the measurements show the property,
and returns the numbers it compared; tests/test_ch07_checks.py shows each failing on data without it. A
rounding that truncates fails :func:`check_round_trip`; a quantized layer that widens its weight every step
(reading more bytes, not fewer) fails :func:`check_speed_follows_bytes`; a format that loses the model fails
:func:`check_quality`; re-gridding a 4-bit file that costs nothing would fail it too; a cache whose codes
take as many bytes as floats fails :func:`check_kv_capacity`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pandas as pd


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_round_trip(table: pd.DataFrame) -> dict[str, float]:
    """Every format brought every weight back within its bound (half a step; fp8: half an ulp)."""
    worst = table["worst error / bound"].to_dict()
    over = {f: w for f, w in worst.items() if w > 1 + 1e-5}
    _require(not over, f"round trips past their bound: {over}")
    return worst


def check_speed_follows_bytes(speed: pd.DataFrame, order: Sequence[str], int8_gain: float = 1.3) -> dict[str, float]:
    """Single-stream decode is faster wherever a step reads half the bytes or fewer: for every pair of
    ``order`` (most bytes first) whose bytes differ at least twofold, the narrower is faster. And int8 weights
    decode at least ``int8_gain`` × float32's speed: fewer bytes, and a kernel that reads them as they are.
    (Closer pairs, int8 against int4, are not judged: the rest of the step, the same in every format, and a
    shared CPU's noise are as large as what 1.4× fewer bytes save.)"""
    rates = {f: float(speed.loc[f, "tokens/s"]) for f in order}
    read = {f: float(speed.loc[f, "read per step (MB)"]) for f in order}
    _require(list(read.values()) == sorted(read.values(), reverse=True), f"{list(order)} do not read ever fewer bytes")
    judged = [(a, b) for a, b in itertools.combinations(order, 2) if read[a] >= 2 * read[b]]
    slower = [(a, b) for a, b in judged if rates[b] <= rates[a]]
    _require(bool(judged), "no two formats differ twofold in bytes: nothing to judge")
    _require(not slower, f"half the bytes or fewer, but not faster: {slower} ({rates})")
    gain = rates["int8"] / rates["fp32"]
    _require(gain >= int8_gain, f"int8 decodes {gain:.2f}× float32's speed, not ≥ {int8_gain}×")
    return rates | {"int8 / fp32": gain}


def check_quality(
    quality: pd.DataFrame, close: Sequence[str], kl_bound: float = 0.01, regridded: str = "int4-g64", kept: str = "int4"
) -> dict[str, float]:
    """Each format in ``close`` stays within ``kl_bound`` nats/token of float32 with top-1 agreement above
    90%, and re-gridding a 4-bit file (``regridded``) costs at least ten times what keeping its blocks
    (``kept``) does: a second rounding onto a misaligned grid is not free."""
    kl = quality["KL (nats/token)"].to_dict()
    far = {f: kl[f] for f in close if not kl[f] < kl_bound}
    _require(not far, f"formats beyond KL {kl_bound}: {far}")
    disagree = {f: float(quality.loc[f, "top-1 agreement"]) for f in close if quality.loc[f, "top-1 agreement"] <= 0.9}
    _require(not disagree, f"top-1 agreement at or below 90%: {disagree}")
    _require(kl[regridded] > 10 * kl[kept], f"re-gridding cost KL {kl[regridded]:.4f}, keeping {kl[kept]:.4f}")
    return {f: kl[f] for f in (*close, regridded)}


def check_activation_aware(
    quality: pd.DataFrame, aware: str = "int4-awq-g64", plain: str = "int4-g64", gain: float = 1.5
) -> dict[str, float]:
    """Activation-aware rounding (``aware``) keeps the model at least ``gain`` times closer to float32, in KL,
    than round-to-nearest at the same bits (``plain``), with a perplexity no higher: the search found the
    columns worth protecting, and folding their scales into the norms changed nothing else."""
    kl = quality["KL (nats/token)"]
    _require(
        kl[aware] * gain <= kl[plain], f"{aware} KL {kl[aware]:.4f} is not {gain}× below {plain}'s {kl[plain]:.4f}"
    )
    perplexity = quality["perplexity"]
    _require(perplexity[aware] <= perplexity[plain], f"{aware} perplexity {perplexity[aware]:.2f} > {plain}'s")
    return {aware: float(kl[aware]), plain: float(kl[plain]), "KL ratio": float(kl[plain] / kl[aware])}


def check_kv_capacity(capacity: pd.DataFrame, full: str = "float32", narrow: Sequence[str] = ("int8", "fp8")) -> dict:
    """The same KV memory holds four times the tokens in one-byte codes as in float32 (per-head scales are
    static: no bytes per token for them)."""
    tokens = capacity["tokens"].to_dict()
    ratios = {k: tokens[k] / tokens[full] for k in narrow}
    _require(all(r == 4 for r in ratios.values()), f"one-byte caches hold {ratios} × float32's tokens, not 4×")
    return ratios
