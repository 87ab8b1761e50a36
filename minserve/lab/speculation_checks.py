"""Chapter 08's checks: speculation's claims held against what the engine did.

Each ``check_*`` function raises ``AssertionError`` (saying what differed) unless the measurements show the
property, and returns the numbers it compared. Each fails on an engine without the property
(tests/test_ch08_checks.py shows it): a verifier that keeps every draft fails :func:`check_greedy_identity`
and :func:`check_verifier_distribution`, an engine without speculation or a proposer that never matches fails
:func:`check_greedy_identity` and :func:`check_held_out_prediction`, a sampler shifted by speculation fails
:func:`check_sampled_distribution`, a speculative step that costs more than the step curve says fails
:func:`check_held_out_prediction`, speculation that still pays past the roofline's batch fails
:func:`check_stops_paying`, and a profile whose phase split is wrong fails :func:`check_profile_predicts_lever`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minserve.capacity.levers import Lever, amdahl_speedup
from minserve.capacity.speculation import predicted_speedup
from minserve.capacity.speculation_runs import SpeculationPoint
from minserve.quality import chi_square_test, chi_square_two_sample


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_profile_predicts_lever(
    prefill_share: float, ttft: Lever, e2e: Lever, at_least: float = 2.0, low: float = 0.6, high: float = 1.5
) -> dict[str, float]:
    """The profile predicts what a prefill lever buys end to end (Amdahl): with prefill ``prefill_share`` of
    the latency and TTFT ``ttft.ratio``× faster, the request should be 1 / ((1 − s) + s / r)× faster. The
    measured end-to-end ratio lies within [``low``, ``high``] × that, the lever cut TTFT at least
    ``at_least``×, and the tokens were the same. A profile that misplaces the phase boundary fails."""
    _require(ttft.same_output and e2e.same_output, f"the lever changed the output: {ttft.row()}")
    _require(ttft.ratio >= at_least, f"TTFT only {ttft.ratio:.2f}× lower with {ttft.lever}, not ≥ {at_least}×")
    prefill_share = float(prefill_share)  # a table cell may be a numpy scalar
    predicted = amdahl_speedup(prefill_share, ttft.ratio)
    ratio = e2e.ratio / predicted
    _require(
        low <= ratio <= high,
        f"end to end {e2e.ratio:.2f}× faster, the profile (prefill {prefill_share:.0%}, TTFT {ttft.ratio:.1f}×) "
        f"predicted {predicted:.2f}×: ratio {ratio:.2f} outside [{low}, {high}]",
    )
    return {"predicted": predicted, "measured": e2e.ratio, "ratio": ratio}


def check_greedy_identity(points: Sequence[SpeculationPoint]) -> dict[str, Any]:
    """Every speculative run gave the plain run's greedy tokens, and the identity is not vacuous: in each
    run drafts were kept (α > 0) and some were refused (α < 1)."""
    _require(len(points) > 0, "no speculative runs to check")
    differing = [f"{p.proposer} k={p.k} ({p.workload}, batch {p.batch})" for p in points if not p.same_output]
    _require(not differing, f"greedy output changed under speculation: {differing}")
    vacuous = [f"{p.proposer} k={p.k} α={p.acceptance}" for p in points if not 0 < p.acceptance < 1]
    _require(not vacuous, f"runs that kept no draft or every draft check nothing: {vacuous}")
    return {"runs": len(points), "acceptance": sorted({p.acceptance for p in points})}


def check_verifier_distribution(
    target: Sequence[float], correct: Sequence[int], mistaken: Sequence[int], significance: float = 1e-3
) -> dict[str, float]:
    """The verifier's first emitted tokens pass a chi-square test against the target p at ``significance``,
    and the mistaken verifier's fail it: the test can tell them apart."""
    good, bad = chi_square_test(correct, target, significance), chi_square_test(mistaken, target, significance)
    _require(good.passed, f"the engine's verifier does not emit p: χ² = {good.statistic:.1f} > {good.critical:.1f}")
    _require(not bad.passed, f"the test did not catch the mistaken verifier: χ² = {bad.statistic:.1f}")
    return {"correct_chi2": good.statistic, "mistaken_chi2": bad.statistic, "critical": good.critical}


def check_sampled_distribution(
    plain: Sequence[int], speculative: Sequence[int], accepted_drafts: int, significance: float = 1e-3
) -> dict[str, float]:
    """Sampled tokens with and without speculation pass a two-sample chi-square test, with drafts accepted
    in the speculative run (otherwise it was plain sampling)."""
    _require(accepted_drafts > 0, "the speculative run kept no draft: nothing was verified")
    result = chi_square_two_sample(plain, speculative, significance)
    _require(
        result.passed,
        f"speculation changed the sampled distribution: χ² = {result.statistic:.1f} > {result.critical:.1f}",
    )
    return {"chi2": result.statistic, "critical": result.critical, "accepted_drafts": accepted_drafts}


def check_held_out_prediction(
    acceptance: float,
    verify_cost: float,
    measured: SpeculationPoint,
    draft_cost: float = 0.0,
    low: float = 0.6,
    high: float = 1.5,
) -> dict[str, float]:
    """A prediction made before the run holds on it: α from other (held-out) prompts, v from plain steps
    measured apart (the step curve), c from the draft's cost; the measured speedup on the run's own prompts
    is above 1 and within [``low``, ``high``] × ``predicted_speedup(α, k, c, v)``."""
    predicted = predicted_speedup(acceptance, measured.k, draft_cost, verify_cost)
    ratio = measured.measured_speedup / predicted
    _require(measured.measured_speedup > 1, f"speculation did not pay: {measured.measured_speedup:.2f}× plain")
    _require(
        low <= ratio <= high,
        f"measured {measured.measured_speedup:.2f}× is {ratio:.2f} × the prediction {predicted:.2f}× "
        f"(held-out α = {acceptance:.2f}, v = {verify_cost:.2f}, c = {draft_cost:.2f}), outside [{low}, {high}]",
    )
    return {"predicted": predicted, "measured": measured.measured_speedup, "ratio": ratio}


def check_stops_paying(
    small: SpeculationPoint, large: SpeculationPoint, predicted_batch: float, margin: float = 1.25
) -> dict[str, float]:
    """The roofline's batch where speculation stops paying, against two measured batches: the small one at
    least ``margin``× below it pays (> 1×), the large one at least ``margin``× above it loses (< 1×). Two
    batches that do not bracket the prediction could not test it, and fail too."""
    _require(
        small.batch * margin <= predicted_batch <= large.batch / margin,
        f"batches {small.batch} and {large.batch} do not bracket the predicted {predicted_batch:.1f} "
        f"by {margin}×: the measurement cannot test the prediction",
    )
    _require(small.measured_speedup > 1, f"batch {small.batch}: {small.measured_speedup:.2f}×, expected > 1")
    _require(
        large.measured_speedup < 1,
        f"batch {large.batch}: {large.measured_speedup:.2f}×, expected < 1 past the predicted {predicted_batch:.1f}",
    )
    return {"predicted_batch": predicted_batch, "small": small.measured_speedup, "large": large.measured_speedup}
