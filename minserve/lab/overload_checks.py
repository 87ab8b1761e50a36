"""Chapter 09's checks: what admission, fast refusals, accounting and careful retries claim, held against
what the simulator and the server measured.

Each ``check_*`` raises ``AssertionError`` (saying what differed) unless the data show the property, and
returns the numbers it compared; tests/test_ch09_checks.py shows each failing on data without it. A server
that admits everything at 3× its capacity, or whose admission refuses everything, fails
:func:`check_admission_keeps_slo`; one whose admission buys no goodput fails :func:`check_goodput`; refusals
that wait in the queue like the requests they turn away fail :func:`check_fast_refusals`; a request that
failed, one counted differently by client and server, or a server whose memory grows with the excess fails
:func:`check_nothing_lost`; a careful
retry strategy that sends as many attempts as naive retries fails :func:`check_retry_storm`; an engine that
runs slower than the planner predicted fails :func:`check_envelope_confirmed`.

The tables are those of :mod:`minserve.lab.overload_figures`: one row per (``policy``, ``load_multiple``).
Times are seconds, rates requests per second.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd

from minserve.capacity.confirmation import EngineCheck
from minserve.lab.checks import require


def at_load(table: pd.DataFrame, policy: str, load_multiple: float) -> pd.Series:
    """The row of ``policy`` at ``load_multiple`` × capacity."""
    rows = table[(table["policy"] == policy) & (table["load_multiple"] == load_multiple)]
    require(
        len(rows) == 1,
        f"expected one row for {policy!r} at {load_multiple:g}×, found {len(rows)} "
        f"(policies: {sorted(set(table['policy']))}, loads: {sorted(set(table['load_multiple']))})",
    )
    return rows.iloc[0]


def _is(value: float) -> bool:
    """A number that was measured (not NaN: a share of no requests is NaN)."""
    return value is not None and not math.isnan(value)


def check_admission_keeps_slo(
    table: pd.DataFrame,
    slo_ttft_s: float,
    admitting: str,
    without: str,
    load_multiple: float = 3.0,
    min_attainment: float = 0.9,
    ttft_p99_factor: float = 1.0,
    collapsed_attainment: float = 0.5,
) -> dict:
    """At ``load_multiple`` × capacity, the ``admitting`` policy admitted requests (some, and refused some)
    and at least ``min_attainment`` of them met the SLO, their p99 TTFT within ``ttft_p99_factor`` × the
    TTFT SLO; ``without`` admission the admitted requests' attainment collapsed to at most
    ``collapsed_attainment``, their p99 TTFT over the SLO. Returns the numbers compared."""
    good, bad = at_load(table, admitting, load_multiple), at_load(table, without, load_multiple)
    where = f"at {load_multiple:g}× capacity"
    admitted = good["sent"] - good["refused"]
    require(
        admitted > 0,
        f"{admitting} {where} admitted none of {good['sent']} requests: refusing everything "
        "keeps no SLO, it serves nobody",
    )
    require(good["refused"] > 0, f"{admitting} {where} refused nothing: it did not shed the excess load")
    require(
        _is(good["attainment_admitted"]) and good["attainment_admitted"] >= min_attainment,
        f"{admitting} {where}: {good['attainment_admitted']:.0%} of admitted requests met the SLO, "
        f"need ≥ {min_attainment:.0%}",
    )
    require(
        good["ttft_p99_s"] <= ttft_p99_factor * slo_ttft_s,
        f"{admitting} {where}: admitted p99 TTFT {good['ttft_p99_s']:.3g} s, over {ttft_p99_factor:g} × the "
        f"{slo_ttft_s:g} s SLO",
    )
    require(
        bad["attainment_admitted"] <= collapsed_attainment,
        f"{without} {where}: {bad['attainment_admitted']:.0%} of admitted requests met the SLO; without "
        f"admission the queue should grow until most miss (≤ {collapsed_attainment:.0%})",
    )
    require(
        bad["ttft_p99_s"] > slo_ttft_s,
        f"{without} {where}: p99 TTFT {bad['ttft_p99_s']:.3g} s is within the "
        f"{slo_ttft_s:g} s SLO: the load did not overload it",
    )
    return {
        f"{admitting}: admitted meeting the SLO": round(float(good["attainment_admitted"]), 3),
        f"{admitting}: admitted p99 TTFT s": round(float(good["ttft_p99_s"]), 3),
        f"{admitting}: refused": int(good["refused"]),
        f"{without}: admitted meeting the SLO": round(float(bad["attainment_admitted"]), 3),
        f"{without}: p99 TTFT s": round(float(bad["ttft_p99_s"]), 3),
    }


def check_goodput(
    table: pd.DataFrame,
    admitting: str,
    without: str,
    load_multiple: float = 3.0,
    min_ratio: float = 1.5,
    min_capacity_share: float = 0.5,
) -> dict:
    """At ``load_multiple`` × capacity, goodput (requests/s meeting the SLO) with admission is at least
    ``min_ratio`` × goodput without, and at least ``min_capacity_share`` of the capacity: refusing the
    excess keeps the replica doing useful work, not just refusing. Returns both goodputs."""
    good, bad = at_load(table, admitting, load_multiple), at_load(table, without, load_multiple)
    capacity = float(good["capacity_rps"])
    require(
        good["goodput_rps"] >= min_ratio * bad["goodput_rps"],
        f"at {load_multiple:g}×: goodput {good['goodput_rps']:.3g} req/s with {admitting}, "
        f"{bad['goodput_rps']:.3g} without: need ≥ {min_ratio:g}×",
    )
    require(
        good["goodput_rps"] >= min_capacity_share * capacity,
        f"at {load_multiple:g}×: goodput {good['goodput_rps']:.3g} req/s with {admitting} is under "
        f"{min_capacity_share:.0%} of the capacity, {capacity:.3g} req/s",
    )
    return {
        f"{admitting} goodput rps": round(float(good["goodput_rps"]), 2),
        f"{without} goodput rps": round(float(bad["goodput_rps"]), 2),
        "capacity rps": round(capacity, 2),
    }


def check_fast_refusals(
    served: pd.DataFrame, policy: str, slo_ttft_s: float, load_multiple: float = 3.0, max_share_of_slo: float = 0.25
) -> dict:
    """At ``load_multiple`` × capacity, ``policy`` refused requests, and the refusals' p99 (seconds from
    send to the 429) is under ``max_share_of_slo`` of the TTFT SLO and under the admitted requests' median
    TTFT: a refusal tells the client at once, it does not wait in the queue. Returns the refusal times."""
    row = at_load(served, policy, load_multiple)
    require(row["refused"] > 0, f"{policy} at {load_multiple:g}× refused nothing: no refusal to time")
    p99, bound = float(row["refusal_p99_s"]), max_share_of_slo * slo_ttft_s
    require(
        p99 <= bound,
        f"{policy} at {load_multiple:g}×: refusal p99 {p99 * 1e3:.0f} ms, over "
        f"{max_share_of_slo:g} × the {slo_ttft_s:g} s SLO ({bound * 1e3:.0f} ms)",
    )
    require(
        p99 < row["ttft_p50_s"],
        f"{policy} at {load_multiple:g}×: refusal p99 {p99 * 1e3:.0f} ms is not "
        f"faster than an admitted request's median TTFT, {row['ttft_p50_s'] * 1e3:.0f} ms",
    )
    return {
        "refused": int(row["refused"]),
        "refusal p50 ms": round(float(row["refusal_p50_s"]) * 1e3, 1),
        "refusal p99 ms": round(p99 * 1e3, 1),
        "admitted TTFT p50 ms": round(float(row["ttft_p50_s"]) * 1e3),
    }


def check_nothing_lost(
    served: pd.DataFrame, memory_growth: Mapping[str, float], max_memory_growth: float = 1.5
) -> dict:
    """Overload cost the server nothing but refusals: in every run no request failed (an error, a dropped
    connection: what an overloaded server that runs out of memory or threads gives), the server's
    ``/metrics`` counted the same outcomes as the client (``server_accounted``: none vanished between the
    two), and each server's resident memory grew at most ``max_memory_growth`` × while it was driven past
    capacity (``memory_growth``: largest sample over the first, per policy; a server that queues the excess
    without bound grows). Returns the requests, refusals and the largest growth."""
    problems = []
    for row in served.itertuples():
        where = f"{row.policy} at {row.load_multiple:g}×"
        if row.failed:
            problems.append(f"{where}: {row.failed} failed")
        if not row.server_accounted:
            problems.append(f"{where}: /metrics counted other outcomes than the client")
    problems += [
        f"{policy}: server memory grew {growth:.2f}×, over {max_memory_growth:g}×"
        for policy, growth in memory_growth.items()
        if growth > max_memory_growth
    ]
    require(not problems, "; ".join(problems))
    return {
        "requests": int(served["sent"].sum()),
        "refused": int(served["refused"].sum()),
        "largest memory growth": round(max(memory_growth.values(), default=1.0), 2),
    }


def check_retry_storm(summary: pd.DataFrame, naive: str = "naive", careful: str = "jitter+budget") -> dict:
    """The same clients and the same spike: the ``careful`` strategy (full jitter and a retry budget) sent
    fewer attempts than ``naive`` immediate retries, a smaller amplification (attempts per request), and no
    fewer successes than half of naive's. Returns each strategy's attempts and amplification."""
    rows = summary.set_index("strategy")
    require({naive, careful} <= set(rows.index), f"need {naive!r} and {careful!r}, got {sorted(rows.index)}")
    a, b = rows.loc[careful], rows.loc[naive]
    require(
        a["attempts"] < b["attempts"],
        f"{careful} sent {a['attempts']:.0f} attempts, {naive} {b['attempts']:.0f}: the careful strategy "
        "must send fewer",
    )
    require(
        a["amplification"] < b["amplification"],
        f"amplification {a['amplification']:.2f} with {careful}, {b['amplification']:.2f} with {naive}",
    )
    require(
        a["successes"] >= 0.5 * b["successes"],
        f"{careful} served {a['successes']:.0f} requests, {naive} {b['successes']:.0f}: sending fewer attempts "
        "must not mean serving almost nobody",
    )
    return {
        name: {"attempts": int(r["attempts"]), "amplification": round(float(r["amplification"]), 2)}
        for name, r in rows.iterrows()
    }


def check_envelope_confirmed(
    checks: Sequence[EngineCheck], required_attainment: float, tolerance: float = 0.2, slack: float = 0.1
) -> dict:
    """The planner's prediction, confirmed on the engine: up to the knee (``share_of_max`` ≤ 1) the measured
    attainment is within ``tolerance`` of the simulator's for the same requests, and below it the engine met
    the SLO for at least ``required_attainment − slack``; past the knee attainment falls, so the highest
    rate's is no better than the lowest's. (Past the knee only the direction is held: there attainment falls
    off a cliff whose place moves with any change in the machine's speed, another process's load included.)
    Returns the (predicted, measured) attainment per rate."""
    require(len(checks) >= 2, f"need at least two rates, got {len(checks)}")
    by_rate = sorted(checks, key=lambda c: c.rate_rps)
    for check in by_rate:
        predicted, measured = check.predicted.attainment["all"], check.measured.attainment["all"]
        require(
            check.share_of_max > 1 or abs(predicted - measured) <= tolerance,
            f"at {check.rate_rps:.3g} req/s the engine met the SLO for {measured:.0%} of requests, the "
            f"simulator predicted {predicted:.0%}: more than {tolerance:.0%} apart",
        )
        if check.share_of_max < 1:
            required = required_attainment - slack
            require(
                measured >= required,
                f"below the knee ({check.rate_rps:.3g} req/s) the engine met the SLO "
                f"for only {measured:.0%} of requests, need ≥ {required:.0%}",
            )
    low, high = by_rate[0].measured.attainment["all"], by_rate[-1].measured.attainment["all"]
    require(high <= low, f"measured attainment rose with the rate: {low:.0%} at the lowest, {high:.0%} at the highest")
    return {
        f"{c.rate_rps:.3g} req/s": (round(c.predicted.attainment["all"], 3), round(c.measured.attainment["all"], 3))
        for c in by_rate
    }
