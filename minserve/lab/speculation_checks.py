"""Chapter 08's checks: speculation's claims held against what the engine did.

Each ``check_*`` function raises ``AssertionError`` (saying what differed) unless the measurements show the
property, and returns the numbers it compared. Each fails on an engine without the property
(tests/test_ch08_checks.py shows it): a verifier that keeps a wrong draft fails :func:`check_greedy_identity`,
one that resamples from p fails :func:`check_verifier_distribution`, a sampler shifted by speculation fails
:func:`check_sampled_distribution`, a speculative step that costs k + 1 plain ones fails
:func:`check_speedup`, a verification whose cost does not grow with the batch fails
:func:`check_falls_with_batch`, a profile whose dominant phase is not the one named fails
:func:`check_profile`, and one that puts the time in the wrong phase fails :func:`check_amdahl`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from minserve.capacity.levers import Lever, amdahl_speedup, mean_e2e_s
from minserve.capacity.speculation_runs import SpeculationPoint
from minserve.engine.outputs import RequestOutput
from minserve.lab.checks import require
from minserve.quality import chi_square_test, chi_square_two_sample


def check_profile(table: pd.DataFrame, dominant: Mapping[str, str], share: float = 0.6) -> dict[str, float]:
    """Each workload's named phase (``"prefill"`` or ``"decode"``) took more than ``share`` of its mean
    request's latency: the lever is chosen for that phase."""
    shares = {}
    for workload, phase in dominant.items():
        prefill = float(table.loc[workload, "prefill share"])
        shares[workload] = prefill if phase == "prefill" else 1 - prefill
        require(
            shares[workload] > share, f"{workload}: {phase} took {shares[workload]:.0%} of latency, not > {share:.0%}"
        )
    return shares


def check_amdahl(
    table: pd.DataFrame,
    workload: str,
    lever: Lever,
    runs: Mapping[str, Sequence[RequestOutput]],
    band: tuple[float, float] = (0.8, 1.2),
) -> dict[str, float]:
    """The profile predicts what a lever buys: with ``workload``'s share of latency in the lever's phase
    (from ``table``, :func:`~minserve.lab.speculation.phase_table`) and the lever's measured speedup of that
    phase, Amdahl's law gives the end-to-end speedup; the one measured (mean E2E of ``runs["without"]``
    over ``runs["with"]``) lies within ``band`` × that prediction. A profile that put the time in the wrong
    phase (a TTFT stamped too early, say) predicts the wrong gain."""
    prefill = float(table.loc[workload, "prefill share"])
    share = prefill if lever.phase == "prefill" else 1 - prefill
    predicted = amdahl_speedup(share, lever.ratio)
    measured = mean_e2e_s(runs["without"]) / mean_e2e_s(runs["with"])
    ratio = measured / predicted
    require(
        band[0] <= ratio <= band[1],
        f"{lever.lever} on {workload}: {measured:.2f}× end to end, Amdahl's law from the profile "
        f"({share:.0%} in {lever.phase}, that phase {lever.ratio:.1f}× faster) predicts {predicted:.2f}× "
        f"(ratio {ratio:.2f}, outside {band})",
    )
    return {"share": share, "phase_speedup": lever.ratio, "predicted": predicted, "measured": measured}


def check_greedy_identity(points: Sequence[SpeculationPoint]) -> dict[str, Any]:
    """Every speculative run gave the plain run's greedy tokens, and the identity is not vacuous: in each
    run drafts were kept (α > 0) and some were refused (α < 1)."""
    require(len(points) > 0, "no speculative runs to check")
    differing = [f"{p.proposer} k={p.k} ({p.workload}, batch {p.batch})" for p in points if not p.same_output]
    require(not differing, f"greedy output changed under speculation: {differing}")
    vacuous = [f"{p.proposer} k={p.k} α={p.acceptance}" for p in points if not 0 < p.acceptance < 1]
    require(not vacuous, f"runs that kept no draft or every draft check nothing: {vacuous}")
    return {"runs": len(points), "acceptance": sorted({p.acceptance for p in points})}


def check_verifier_distribution(
    target: Sequence[float], correct: Sequence[int], mistaken: Sequence[int], significance: float = 1e-3
) -> dict[str, float]:
    """The verifier's first emitted tokens pass a chi-square test against the target p at ``significance``,
    and the mistaken verifier's fail it: the test can tell them apart."""
    good, bad = chi_square_test(correct, target, significance), chi_square_test(mistaken, target, significance)
    require(good.passed, f"the engine's verifier does not emit p: χ² = {good.statistic:.1f} > {good.critical:.1f}")
    require(not bad.passed, f"the test did not catch the mistaken verifier: χ² = {bad.statistic:.1f}")
    return {"correct_chi2": good.statistic, "mistaken_chi2": bad.statistic, "critical": good.critical}


def check_sampled_distribution(
    plain: Sequence[int], speculative: Sequence[int], accepted_drafts: int, significance: float = 1e-3
) -> dict[str, float]:
    """Sampled tokens with and without speculation pass a two-sample chi-square test, with drafts accepted
    in the speculative run (otherwise it was plain sampling)."""
    require(accepted_drafts > 0, "the speculative run kept no draft: nothing was verified")
    result = chi_square_two_sample(plain, speculative, significance)
    require(
        result.passed,
        f"speculation changed the sampled distribution: χ² = {result.statistic:.1f} > {result.critical:.1f}",
    )
    return {"chi2": result.statistic, "critical": result.critical, "accepted_drafts": accepted_drafts}


def check_speedup(point: SpeculationPoint, predicted: float, low: float = 0.5, high: float = 1.15) -> dict[str, float]:
    """A speculative run was faster than plain decoding, and its measured speedup lies within
    [``low``, ``high``] × ``predicted``, a prediction made without this run (α from held-out requests, v from
    the roofline). The roofline is a ceiling, so ``high`` only leaves room for α differing between the two
    sets of requests; ``low`` for what it leaves out (steps where prompt lookup found nothing to draft)."""
    ratio = point.measured_speedup / predicted
    require(point.measured_speedup > 1, f"speculation did not pay: {point.measured_speedup:.2f}× plain")
    require(
        low <= ratio <= high,
        f"measured {point.measured_speedup:.2f}× is {ratio:.2f} × the prediction {predicted:.2f}×, "
        f"outside [{low}, {high}]",
    )
    return {"measured": point.measured_speedup, "predicted": predicted, "ratio": ratio}


def check_falls_with_batch(points: Sequence[SpeculationPoint], drop: float = 0.9) -> dict[int, float]:
    """The speedup at the largest measured batch is below ``drop`` × the speedup at the smallest: a batch
    uses up the spare compute that verification spends. (Where it crosses 1 depends on how close the
    engine's step comes to the compute roof; the roofline's stopping batch is a first guess.)"""
    require(len({p.batch for p in points}) >= 2, f"need two batch sizes, got {[p.batch for p in points]}")
    small, large = min(points, key=lambda p: p.batch), max(points, key=lambda p: p.batch)
    require(
        large.measured_speedup < drop * small.measured_speedup,
        f"batch {large.batch}: {large.measured_speedup:.2f}×, not below {drop} × batch {small.batch}'s "
        f"{small.measured_speedup:.2f}×",
    )
    return {p.batch: p.measured_speedup for p in points}
