"""Chapter 01: the service contract, in numbers.

A serving system is judged against a contract, not an average. This module turns token timestamps into the
numbers that contract speaks in:

* per request: TTFT, ITL, TPOT and end-to-end latency (:class:`RequestRecord`);
* over a run: percentiles (:func:`percentile`, :func:`summary_table`), SLO attainment (:func:`attainment`),
  goodput (:func:`goodput_rps`), throughput, availability and error budget;
* in money: cost per million tokens from $/accelerator-hour and measured throughput.

It is one vocabulary, which the load tester, the simulator and every chapter speak, and each definition is
short. One request's numbers (:class:`RequestRecord`, :func:`ttft_s`, :func:`itl_s`, :func:`tpot_s`) are
defined in :mod:`minserve.request_record` and named here too, so ``slo.RequestRecord`` reads as part of it.

One summary, one key scheme: :func:`summarize` nests each latency distribution under its metric
(``summary["ttft_ms"]["p99"]``, read by key path with :func:`lookup`: ``"ttft_ms.p99"``) and names the
throughputs as vLLM's benchmark does, with units (``request_throughput_rps``, ``output_throughput_tps``).
Nested because a distribution is one object (:func:`distribution_ms`): a percentile added to it reaches
every summary and table at once, and the ``summary.json`` bundles the load tester has saved already read
this way. The simulator, the lab's engine runs and the load tester (which adds only its own extras) all
call it.

Every time is in seconds (``_s``) unless a name says ``_ms``. Timestamps come from one monotonic clock
(``time.perf_counter``): only their differences mean anything. The module needs nothing beyond the standard
library, except :func:`summary_table`, which returns a pandas DataFrame and imports pandas when called.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

# One request's numbers, named here as part of the vocabulary (minserve.slo.RequestRecord, slo.ttft_s, …).
from minserve.request_record import (  # noqa: F401
    STATUSES,
    HasTimestamps,
    RequestRecord,
    Status,
    itl_s,
    record_from_metrics,
    records_from_outputs,
    tpot_from_totals_s,
    tpot_s,
    ttft_s,
)

if TYPE_CHECKING:
    import pandas as pd


DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SUMMARY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")  # the latencies a summary reports
SECONDS_PER_HOUR = 3600.0


# --- targets -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    """Latency targets one product promises, plus the availability it promises over a window.

    A target left ``None`` is not part of the contract. Each latency target is a per-request bound: a request
    meets ``ttft_s`` when its own TTFT is at most ``ttft_s`` seconds, and so on. ``max_itl_s`` bounds the
    longest gap between two tokens of one request (a visible stall), where ``tpot_s`` bounds their average.
    ``availability`` is the fraction of requests that must not fail (0.999 = "three nines").
    """

    name: str = "slo"
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    max_itl_s: float | None = None
    availability: float = 0.999

    def __post_init__(self) -> None:
        for name, value in self.targets().items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"SLO {self.name!r}: {name}_s must be a positive number of seconds, got {value!r}")
        if not 0 < self.availability <= 1:
            raise ValueError(f"SLO {self.name!r}: availability must be in (0, 1], got {self.availability!r}")

    def targets(self) -> dict[str, float]:
        """The latency targets that are set, keyed by metric name without unit: ``{"ttft": 0.5, ...}``."""
        keys = ("ttft", "tpot", "e2e", "max_itl")
        return {key: getattr(self, f"{key}_s") for key in keys if getattr(self, f"{key}_s") is not None}

    def is_looser_than(self, other: SLO) -> bool:
        """True when every target of ``self`` is also a target of ``other`` with a value at least as large.

        Then, on the same requests, ``self`` attains at least as much as ``other``: a request that meets the
        stricter contract meets every bound of the looser one.
        """
        mine, theirs = self.targets(), other.targets()
        return all(key in theirs and value >= theirs[key] for key, value in mine.items())


# --- percentiles -------------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) by linear interpolation between closest ranks (numpy's default).

    ``nan`` for no values: a run with no samples has no tail to report. Invariant: for q1 ≤ q2,
    ``percentile(v, q1) ≤ percentile(v, q2)``; p0 is the minimum and p100 the maximum.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)  # fractional position in the sorted list
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ecdf_points(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF as (sorted values, fraction of values ≤ each): ``([1, 2], [0.5, 1.0])``."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def metric_values_s(records: Iterable[RequestRecord], metric: str) -> list[float]:
    """One metric (``"ttft"``, ``"tpot"``, ``"itl"``, ``"e2e"``, ``"max_itl"``) over the ok records, seconds.

    Failed and cancelled requests are left out of latency distributions (they count in attainment and
    goodput instead); so are requests without the metric (a one-token answer has no TPOT). ``"itl"`` pools
    every gap of every request, so it has n − 1 samples per request.
    """
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl_s]
    if metric not in ("ttft", "tpot", "e2e", "max_itl"):
        raise ValueError(f"unknown metric {metric!r}; expected ttft, tpot, itl, e2e or max_itl")
    values = (getattr(r, f"{metric}_s") for r in ok)
    return [v for v in values if v is not None]


def summary_table(
    records: Sequence[RequestRecord],
    metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2e"),
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> pd.DataFrame:
    """Percentile summary in milliseconds: one row per metric, columns ``count``, ``mean``, ``p50`` … ``p99``.

    Empty metrics give a row of ``nan`` with count 0, so the table always has the same shape.
    """
    import pandas as pd  # the lab extra; kept out of module import so the core package stays pandas-free

    rows = {f"{metric}_ms": distribution_ms(metric_values_s(records, metric), percentiles) for metric in metrics}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "metric"
    return table


def distribution_ms(values_s: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """``count``, ``mean`` and ``p50`` … ``p99`` of values given in seconds, reported in milliseconds.

    The one summary of a distribution: the percentile table, the load tester's summary and
    :func:`summarize` are all made of it (empty values give ``nan`` with count 0).
    """
    values_ms = [v * 1e3 for v in values_s]
    row = {"count": len(values_ms), "mean": sum(values_ms) / len(values_ms) if values_ms else math.nan}
    return row | {f"p{q:g}": percentile(values_ms, q) for q in percentiles}


def summarize(
    records: Sequence[RequestRecord],
    slo_target: SLO | None = None,
    window: float | None = None,
    itl_values_s: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The numbers two runs are compared on: the one summary of a run, for a simulation, a measured engine run
    and a load test alike (:func:`minserve.bench.metrics.summarize` adds the load tester's extras to it).

    Keys: ``requests`` and a count per status (``ok``, ``failed``, ``cancelled``); ``ttft_ms``, ``tpot_ms``,
    ``itl_ms`` and ``e2e_ms``, each a :func:`distribution_ms` (``summary["ttft_ms"]["p90"]``, or
    ``lookup(summary, "ttft_ms.p90")``); ``request_throughput_rps`` and ``output_throughput_tps`` over
    ``window`` seconds (default: the measured window); under an SLO, ``goodput_rps`` and ``attainment``
    (per target and ``"all"``, as :func:`attainment`).

    Why nested: a distribution is one object, so a percentile added to :data:`DEFAULT_PERCENTILES` appears in
    every summary and every table at once, and the ``summary.json`` bundles already saved keep reading the
    same way. The throughput names are vLLM's benchmark names with their units.

    ``itl_values_s`` replaces the records' own inter-token gaps, for a client that sees chunks rather than
    tokens (the load tester pools the gaps between chunks, as vLLM does).
    """
    out: dict[str, Any] = {"requests": len(records)} | {s: sum(r.status == s for r in records) for s in STATUSES}
    for metric in SUMMARY_METRICS:
        own = metric != "itl" or itl_values_s is None
        out[f"{metric}_ms"] = distribution_ms(metric_values_s(records, metric) if own else itl_values_s)
    out["request_throughput_rps"] = request_throughput_rps(records, window)
    out["output_throughput_tps"] = token_throughput_tps(records, window)
    if slo_target is not None:
        out["goodput_rps"] = goodput_rps(records, slo_target, window)
        out["attainment"] = attainment(records, slo_target)
    return out


def lookup(summary: Mapping[str, Any], key_path: str) -> Any:
    """``lookup(s, "ttft_ms.p99")`` is ``s["ttft_ms"]["p99"]``, or ``None`` where a key is missing."""
    value: Any = summary
    for key in key_path.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


# --- attainment and goodput --------------------------------------------------------------------------------


def meets(record: RequestRecord, slo: SLO) -> dict[str, bool]:
    """Which targets of ``slo`` this request meets, plus ``"all"``. A failed or cancelled request meets none.

    A metric the request does not have (TPOT of a one-token answer) cannot be missed, so it is met; TTFT of
    an ok request with no tokens at all is missed.
    """
    targets = slo.targets()
    if not record.ok:
        return {key: False for key in targets} | {"all": False}
    result = {}
    for key, bound_s in targets.items():
        value = getattr(record, f"{key}_s")
        missing_ok = key in ("tpot", "max_itl")  # undefined for n < 2 tokens: nothing after the first to be slow
        result[key] = missing_ok if value is None else value <= bound_s
    result["all"] = all(result.values())
    return result


def attainment(records: Sequence[RequestRecord], slo: SLO) -> dict[str, float]:
    """Fraction of *all* requests (failed and cancelled included) meeting each target of ``slo``, and ``"all"``.

    Values are in [0, 1]; ``"all"`` ≤ each single target. ``nan`` for an empty run (no evidence either way).
    """
    keys = [*slo.targets(), "all"]
    if not records:
        return dict.fromkeys(keys, math.nan)
    checks = [meets(r, slo) for r in records]
    return {key: sum(check[key] for check in checks) / len(records) for key in keys}


def window_s(records: Sequence[RequestRecord]) -> float:
    """The measured window: first arrival → last finish, seconds (0.0 for an empty run)."""
    if not records:
        return 0.0
    return max(r.finish_s for r in records) - min(r.arrival_s for r in records)


def _rate(count: float, records: Sequence[RequestRecord], window: float | None) -> float:
    window = window_s(records) if window is None else window
    if window < 0:
        raise ValueError(f"window_s must be ≥ 0, got {window!r}")
    return count / window if window > 0 else 0.0


def request_throughput_rps(records: Sequence[RequestRecord], window: float | None = None) -> float:
    """Completed (ok) requests per second over ``window`` seconds (default: the measured window)."""
    return _rate(sum(r.ok for r in records), records, window)


def token_throughput_tps(records: Sequence[RequestRecord], window: float | None = None) -> float:
    """Output tokens per second of ok requests over ``window`` seconds (default: the measured window)."""
    return _rate(sum(r.output_tokens for r in records if r.ok), records, window)


def goodput_rps(records: Sequence[RequestRecord], slo: SLO, window: float | None = None) -> float:
    """Goodput: requests per second that finished ok *and* met every target of ``slo``.

    Failed and cancelled requests count against it: they take their share of the window and add nothing.
    Invariant: 0 ≤ goodput ≤ request throughput. 0.0 for an empty run or a zero window.
    """
    return _rate(sum(meets(r, slo)["all"] for r in records), records, window)


# --- availability and error budget -------------------------------------------------------------------------


def in_window(records: Iterable[RequestRecord], start_s: float | None, end_s: float | None) -> list[RequestRecord]:
    """Records that arrived in ``[start_s, end_s)``; ``None`` leaves that side open."""
    return [
        r for r in records if (start_s is None or r.arrival_s >= start_s) and (end_s is None or r.arrival_s < end_s)
    ]


def availability(records: Iterable[RequestRecord], start_s: float | None = None, end_s: float | None = None) -> float:
    """Fraction of requests arriving in the window that the service did not fail: ok / (ok + failed).

    Cancelled requests are left out: the client chose to leave, so they say nothing about whether the
    service was up (they still count against goodput). ``nan`` when the window holds no ok or failed request.
    """
    chosen = in_window(records, start_s, end_s)
    ok = sum(r.status == "ok" for r in chosen)
    failed = sum(r.status == "failed" for r in chosen)
    return ok / (ok + failed) if ok + failed else math.nan


@dataclass(frozen=True)
class ErrorBudget:
    """How many failures an availability target allows over a window, and how much of that is left.

    ``allowed_failures = (1 − target) × eligible requests``. ``remaining`` is the unspent fraction of the
    budget: 1.0 untouched, 0.0 spent, negative when overspent (the contract is broken for this window).
    """

    target: float
    eligible_requests: int
    failures: int
    allowed_failures: float
    remaining: float


def error_budget(
    records: Iterable[RequestRecord], target: float, start_s: float | None = None, end_s: float | None = None
) -> ErrorBudget:
    """The error budget of an availability ``target`` (e.g. 0.999) over the requests arriving in a window."""
    if not 0 < target <= 1:
        raise ValueError(f"availability target must be in (0, 1], got {target!r}")
    chosen = [r for r in in_window(records, start_s, end_s) if r.status != "cancelled"]
    failures = sum(r.status == "failed" for r in chosen)
    allowed = (1 - target) * len(chosen)
    return ErrorBudget(target, len(chosen), failures, allowed, _budget_left(failures, allowed))


def _budget_left(failures: int, allowed: float) -> float:
    if allowed > 0:
        return 1 - failures / allowed
    # A 100 % target, or no requests: any failure overspends the budget, none leaves it whole.
    return 1.0 if failures == 0 else -math.inf


# --- cost --------------------------------------------------------------------------------------------------


def cost_per_million_tokens(usd_per_accelerator_hour: float, tokens_per_s: float, accelerators: int = 1) -> float:
    """US dollars per million tokens: what the hardware costs per second, divided by tokens per second.

    ``usd_per_accelerator_hour × accelerators / 3600 / tokens_per_s × 10⁶``. ``tokens_per_s`` is the
    *measured* throughput of the whole deployment (all its accelerators together). Halving the throughput
    doubles the cost; ``inf`` when nothing was produced.
    """
    if usd_per_accelerator_hour < 0 or accelerators < 1 or tokens_per_s < 0:
        raise ValueError("need usd_per_accelerator_hour ≥ 0, accelerators ≥ 1 and tokens_per_s ≥ 0")
    if tokens_per_s == 0:
        return math.inf
    usd_per_s = usd_per_accelerator_hour * accelerators / SECONDS_PER_HOUR
    return usd_per_s / tokens_per_s * 1e6


# --- one line per contract ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContractReport:
    """A run judged against one SLO: attainment, goodput next to throughput, availability, cost."""

    slo: SLO
    requests: int
    attainment: dict[str, float]
    goodput_rps: float
    request_throughput_rps: float
    tokens_per_s: float
    availability: float
    usd_per_million_tokens: float | None

    def as_row(self) -> dict[str, float | int | str | None]:
        """A flat dict for a table: ``attainment_<target>`` columns, the rest as they are."""
        row: dict[str, float | int | str | None] = {"contract": self.slo.name}
        for f in fields(self):
            if f.name == "attainment":
                row |= {f"attainment_{key}": value for key, value in self.attainment.items()}
            elif f.name != "slo":
                row[f.name] = getattr(self, f.name)
        return row


def evaluate(
    records: Sequence[RequestRecord],
    slo: SLO,
    window: float | None = None,
    usd_per_accelerator_hour: float | None = None,
    accelerators: int = 1,
) -> ContractReport:
    """Judge ``records`` against ``slo`` over ``window`` seconds (default: the measured window)."""
    tokens_per_s = token_throughput_tps(records, window)
    cost = None
    if usd_per_accelerator_hour is not None:
        cost = cost_per_million_tokens(usd_per_accelerator_hour, tokens_per_s, accelerators)
    return ContractReport(
        slo=slo,
        requests=len(records),
        attainment=attainment(records, slo),
        goodput_rps=goodput_rps(records, slo, window),
        request_throughput_rps=request_throughput_rps(records, window),
        tokens_per_s=tokens_per_s,
        availability=availability(records),
        usd_per_million_tokens=cost,
    )
