"""Chapter 09's experiments on a real server: overload at multiples of capacity, and a retry storm.

    client = ClientConfig("http://127.0.0.1:8000", "minserve-tiny", ignore_eos=True, timeout_s=30)
    workload = WorkloadSpec(prompt_len=LengthDist("fixed", 64), output_len=LengthDist("fixed", 32))
    capacity = measure_capacity(client, workload, concurrency=16)
    runs = run_overload(client, workload, capacity, (1, 2, 3), duration_s=30, contract=SLO(ttft_s=1.0),
                        policy="deadline")
    overload_table(runs)                                   # one row per load multiple

**Overload.** Capacity is what the server completes per second when it is kept full (a closed loop).
The overload runs then offer an open-loop Poisson stream at multiples of it, for ``duration_s`` seconds each,
and account for every request sent. Each ends in exactly one of :data:`OUTCOMES`, so succeeded + refused +
timed out + cancelled + failed = sent in the client's records; the server's ``/metrics`` (read before and
after each run by :func:`~minserve.bench.benchmark.run_benchmark`) must tell the same story
(:func:`server_buckets` against :func:`client_buckets`). A request the client lost would show there.

**Retry storm.** One fleet of users (the requests of one run share one :class:`~minserve.client.Retrier`, as
the users behind one gateway do) sends a calm stream, then a spike well over capacity for a few seconds, then
a calm stream again. Each strategy of :data:`STRATEGIES` retries what the server refuses; every attempt is
logged (:class:`AttemptLog`), so the offered load *including retries* is seen per time bin, and how long
after the spike the refusals go on (:func:`recovery_s`).

Only HTTP and ``/metrics``: it runs against any OpenAI-compatible server (vLLM too; there ``server_accounted``
is False, as vLLM does not count refusals). Times in seconds, rates in requests per second.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minserve import slo
from minserve.bench import server_metrics
from minserve.bench.arrivals import ClosedLoop, OpenLoop, timetable
from minserve.bench.benchmark import run_benchmark, salted
from minserve.bench.client import ClientConfig, RequestResult
from minserve.bench.metrics import offered_rps, to_slo_record
from minserve.bench.runner import RunResult, run_open_loop, run_sync, timed_run
from minserve.bench.workload import WorkloadSpec, build_requests
from minserve.client import Attempts, Outcome, Retrier, RetryBudget, RetryPolicy

if TYPE_CHECKING:
    import pandas as pd

OUTCOMES = ("succeeded", "refused", "timed_out", "cancelled", "failed")
OVERLOAD_COLUMNS = (
    "policy", "load_multiple", "offered_rps", "capacity_rps", "sent", "succeeded", "refused", "timed_out", "failed",
    "met_slo", "ttft_p50_s", "ttft_p99_s", "attainment_admitted", "attainment_all", "goodput_rps",
    "refusal_p50_s", "refusal_p99_s", "server_accounted",
)  # fmt: skip
DEFAULT_SLO = slo.SLO("ttft 1 s", ttft_s=1.0)
STRATEGIES = ("naive", "fixed", "jitter", "jitter+budget")
STORM_COLUMNS = ("strategy", "t_s", "attempts_per_s", "successes_per_s", "refusals_per_s")
STORM_SUMMARY_COLUMNS = ("strategy", "attempts", "successes", "amplification", "recovery_s")


# --- one request's outcome, as the client and as the server saw it -----------------------------------------


def outcome_of(result: RequestResult) -> str:
    """Which of :data:`OUTCOMES` a request ended in. Timed out: the client's own timeout, or the server's
    (a 504, or a stream that ended with a ``timeout`` error event)."""
    if result.status == "ok":
        return "succeeded"
    if result.status == "cancelled":
        return "cancelled"
    if result.error == "http_429":
        return "refused"
    if result.error in ("timeout", "http_504") or _error_code(result) == "timeout":
        return "timed_out"
    return "failed"


def _error_code(result: RequestResult) -> str | None:
    """The ``code`` of the error event a stream ended with (``None``: no such event)."""
    if result.error != "server_error" or not result.error_message:
        return None
    try:
        return json.loads(result.error_message).get("code")
    except (ValueError, AttributeError):
        return None


def client_buckets(results: Sequence[RequestResult]) -> dict[str, int]:
    """The client's requests in the four buckets the server's ``/metrics`` can count: ``succeeded``,
    ``refused`` (any answer before the engine: 429, 503 …), ``stopped`` (timed out or cancelled: the server
    aborted them) and ``failed`` (failed inside the engine, or no answer at all)."""
    buckets = dict.fromkeys(("succeeded", "refused", "stopped", "failed"), 0)
    for result in results:
        outcome = outcome_of(result)
        if outcome in ("timed_out", "cancelled"):
            outcome = "stopped"
        elif outcome == "failed" and _refused_before_engine(result):
            outcome = "refused"
        buckets[outcome] += 1
    return buckets


def _refused_before_engine(result: RequestResult) -> bool:
    return result.error is not None and (result.error.startswith("http_4") or result.error == "http_503")


def server_buckets(delta: dict[str, float]) -> dict[str, int]:
    """The same buckets from a ``/metrics`` difference: finished ``stop``/``length`` succeeded, ``abort``
    was stopped, anything else failed; every ``requests_rejected`` reason was refused."""
    finished = server_metrics.finished_by_reason(delta)
    rejected = sum(v for k, v in delta.items() if k.startswith("requests_rejected_total"))
    return {
        "succeeded": finished.get("stop", 0) + finished.get("length", 0),
        "refused": round(rejected),
        "stopped": finished.get("abort", 0),
        "failed": sum(n for reason, n in finished.items() if reason not in ("stop", "length", "abort")),
    }


# --- overload ----------------------------------------------------------------------------------------------


@dataclass
class OverloadRun:
    """One overload run: ``policy`` (the caller's label), the load as a multiple of ``capacity_rps``, the
    ``contract`` it is judged by, what the client saw (``run``) and the server's ``/metrics`` difference
    over it (``server``; ``None`` when the server has no ``/metrics``)."""

    policy: str
    load_multiple: float
    capacity_rps: float
    contract: slo.SLO
    run: RunResult
    server: dict[str, float] | None = None

    def counts(self) -> dict[str, int]:
        """Requests by :data:`OUTCOMES`; they add up to ``len(run.results)``, the requests sent."""
        found = Counter(outcome_of(r) for r in self.run.results)
        return {outcome: found[outcome] for outcome in OUTCOMES}

    @property
    def server_accounted(self) -> bool:
        """True when the server's ``/metrics`` counts every request in the same bucket as the client."""
        return self.server is not None and server_buckets(self.server) == client_buckets(self.run.results)

    def row(self) -> dict[str, Any]:
        """One row of :func:`overload_table`. ``failed`` counts cancelled requests too (none unless the
        workload cancels some), so sent = succeeded + refused + timed_out + failed."""
        results, counts = self.run.results, self.counts()
        records = [to_slo_record(r) for r in results]
        met = sum(slo.meets(record, self.contract)["all"] for record in records)
        ttft_s = slo.metric_values_s(records, "ttft")  # of the requests that succeeded
        refusal_s = [r.end_s - r.sent_s for r in results if outcome_of(r) == "refused"]
        admitted = len(results) - counts["refused"]
        return {
            "policy": self.policy,
            "load_multiple": self.load_multiple,
            "offered_rps": offered_rps(self.run),
            "capacity_rps": self.capacity_rps,
            "sent": len(results),
            **{k: counts[k] for k in ("succeeded", "refused", "timed_out")},
            "failed": counts["failed"] + counts["cancelled"],
            "met_slo": met,
            "ttft_p50_s": slo.percentile(ttft_s, 50),
            "ttft_p99_s": slo.percentile(ttft_s, 99),
            "attainment_admitted": met / admitted if admitted else math.nan,
            "attainment_all": met / len(results) if results else math.nan,
            "goodput_rps": slo.goodput_rps(records, self.contract, self.run.duration_s),
            "refusal_p50_s": slo.percentile(refusal_s, 50),
            "refusal_p99_s": slo.percentile(refusal_s, 99),
            "server_accounted": self.server_accounted,
        }


def measure_capacity(
    client: ClientConfig, workload: WorkloadSpec, concurrency: int, num_requests: int | None = None
) -> float:
    """Requests per second the server completes at saturation: a closed loop of ``concurrency`` users
    (at least the server's batch size, so it is never idle) over ``num_requests`` requests (default: the
    workload's). Only requests that succeeded count. A first round of ``concurrency`` requests warms the
    server up (its first steps are slow) and is not counted."""
    requests = build_requests(replace(workload, num_requests=(num_requests or workload.num_requests) + concurrency))
    warm, measured = requests[:concurrency], requests[concurrency:]
    run_benchmark(client, warm, [ClosedLoop(concurrency)], progress=False)
    run = run_benchmark(client, measured, [ClosedLoop(concurrency)], progress=False).runs[0]
    succeeded = sum(r.status == "ok" for r in run.results)
    if not succeeded:
        first = run.results[0]
        raise RuntimeError(f"no request succeeded, so there is no capacity to measure: {first.error}: "
                           f"{first.error_message}")  # fmt: skip
    return succeeded / run.duration_s


def run_overload(
    client: ClientConfig,
    workload: WorkloadSpec,
    capacity_rps: float,
    load_multiples: Sequence[float] = (1, 2, 3),
    duration_s: float = 30.0,
    contract: slo.SLO = DEFAULT_SLO,
    policy: str = "",
    seed: int = 0,
) -> list[OverloadRun]:
    """For each multiple, an open-loop Poisson stream at ``multiple × capacity_rps`` for about
    ``duration_s`` seconds (so ``round(rate × duration_s)`` requests of ``workload``), lowest load first.

    The client's ``timeout_s`` bounds each request; set it (a few times the SLO) so a queue that never
    drains shows up as timed-out requests, not as a run that never ends. With ``client.send_deadline`` the
    server stops a request at that timeout itself, so client and ``/metrics`` agree on which timed out.
    Each load's prompts are salted apart: the same seed's requests, none a prefix-cache hit of another load's.
    """
    if client.make_retrier is not None:
        raise ValueError("run_overload counts each request once: use a client without retries (make_retrier=None)")
    if not capacity_rps > 0 or not duration_s > 0:
        raise ValueError(f"need capacity_rps > 0 and duration_s > 0, got {capacity_rps!r}, {duration_s!r}")
    runs = []
    for multiple in load_multiples:
        rate_rps = multiple * capacity_rps
        requests = build_requests(replace(workload, num_requests=max(1, round(rate_rps * duration_s))))
        requests = salted(requests, f"# overload {policy} {multiple:g}")  # no load hits an earlier one's cache
        result = run_benchmark(client, requests, [OpenLoop(rate_rps, seed=seed)], contract, progress=False)
        server = result.summaries[0].get("server")
        runs.append(OverloadRun(policy, multiple, capacity_rps, contract, result.runs[0], server))
    return runs


def overload_table(runs: Sequence[OverloadRun]) -> pd.DataFrame:
    """One row per run, :data:`OVERLOAD_COLUMNS` (times in seconds, rates in requests/s)."""
    import pandas as pd

    return pd.DataFrame([run.row() for run in runs], columns=list(OVERLOAD_COLUMNS))


# --- the retry storm ---------------------------------------------------------------------------------------


class ImmediateRetry(RetryPolicy):
    """The naive client: retries at once, deaf to ``Retry-After``. A baseline to show, not to use."""

    def delay_s(self, retry: int, retry_after_s: float | None = None) -> float:
        return 0.0


class FixedBackoff(RetryPolicy):
    """Waits ``base_s`` before every retry, deaf to ``Retry-After``: refused together, back together."""

    def delay_s(self, retry: int, retry_after_s: float | None = None) -> float:
        return self.base_s


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt sent to the server: when it left and ended (seconds on the run's clock), and how."""

    sent_s: float
    end_s: float
    outcome: str  # one of OUTCOMES


class AttemptLog(Retrier):
    """A :class:`~minserve.client.Retrier` that logs every attempt it makes (retries included)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attempts: list[AttemptRecord] = []

    async def acall(
        self,
        attempt: Callable[[], Awaitable[RequestResult]],
        classify: Callable[[RequestResult], Outcome],
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> Attempts[RequestResult]:
        async def logged() -> RequestResult:
            result = await attempt()
            self.attempts.append(AttemptRecord(result.sent_s, result.end_s, outcome_of(result)))
            return result

        return await super().acall(logged, classify, sleep)


def make_retrier(
    strategy: str, max_attempts: int = 8, base_s: float = 0.25, cap_s: float = 8.0, budget_ratio: float = 0.1,
    seed: int = 0,
) -> AttemptLog:  # fmt: skip
    """The retrier of one of :data:`STRATEGIES`, each allowed ``max_attempts`` (the first included):
    ``naive`` retries at once; ``fixed`` waits ``base_s``; ``jitter`` is :class:`~minserve.client.RetryPolicy`
    (full jitter up to ``min(cap_s, base_s · 2ⁿ)``, after ``Retry-After``); ``jitter+budget`` adds a
    :class:`~minserve.client.RetryBudget` of ``budget_ratio`` (retries per request, over 10 s)."""
    import random

    policies = {"naive": ImmediateRetry, "fixed": FixedBackoff, "jitter": RetryPolicy, "jitter+budget": RetryPolicy}
    if strategy not in policies:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    policy = policies[strategy](max_attempts, base_s, cap_s, random.Random(seed))
    return AttemptLog(policy, RetryBudget(budget_ratio) if strategy == "jitter+budget" else None)


@dataclass(frozen=True)
class StormShape:
    """The load of a storm, as multiples of ``capacity_rps``: ``calm_multiple`` for ``before_s`` seconds,
    ``spike_multiple`` for ``spike_s``, and ``calm_multiple`` again for ``after_s``."""

    capacity_rps: float
    spike_multiple: float = 4.0
    spike_s: float = 4.0
    calm_multiple: float = 0.5
    before_s: float = 2.0
    after_s: float = 10.0

    @property
    def spike_end_s(self) -> float:
        return self.before_s + self.spike_s

    def timetable(self, seed: int = 0) -> list[float]:
        """Intended send times: Poisson within each phase, at that phase's rate."""
        phases = [(0.0, self.before_s, self.calm_multiple), (self.before_s, self.spike_s, self.spike_multiple),
                  (self.spike_end_s, self.after_s, self.calm_multiple)]  # fmt: skip
        times: list[float] = []
        for number, (start_s, length_s, multiple) in enumerate(phases):
            rate_rps = multiple * self.capacity_rps
            drawn = timetable(math.ceil(2 * rate_rps * length_s) + 2, rate_rps, seed=seed + number)
            times += [start_s + t for t in drawn if t < length_s]
        return times


@dataclass
class StormRun:
    """One strategy through one storm: every request's final result and every attempt."""

    strategy: str
    shape: StormShape
    results: list[RequestResult]
    attempts: list[AttemptRecord]
    duration_s: float


def run_retry_storm(
    client: ClientConfig, strategy: str, workload: WorkloadSpec, shape: StormShape, seed: int = 0, **retry: Any
) -> StormRun:
    """``shape``'s storm of ``workload``'s requests, retried by ``strategy`` (``retry``: the options of
    :func:`make_retrier`). Prompts are salted per run, so one strategy's prompts are not another's cache hits."""
    times = shape.timetable(seed)
    requests = salted(build_requests(replace(workload, num_requests=len(times))), f"# storm {strategy} {seed}")
    log = make_retrier(strategy, seed=seed, **retry)
    config = replace(client, make_retrier=lambda: log)
    results, duration_s, _ = run_sync(timed_run(config, functools.partial(run_open_loop, requests, times)))
    return StormRun(strategy, shape, results, log.attempts, duration_s)


def _bins(run: StormRun, bin_s: float) -> list[dict[str, float]]:
    """Per bin of ``bin_s`` seconds: attempts sent (by send time), successes and refusals (by end time)."""
    count = max(1, math.ceil(run.duration_s / bin_s))
    rows = [{"t_s": i * bin_s, "attempts": 0, "successes": 0, "refusals": 0} for i in range(count)]
    for attempt in run.attempts:
        rows[min(count - 1, int(attempt.sent_s / bin_s))]["attempts"] += 1
        ended = rows[min(count - 1, int(attempt.end_s / bin_s))]
        ended["successes"] += attempt.outcome == "succeeded"
        ended["refusals"] += attempt.outcome == "refused"
    return rows


def recovery_s(run: StormRun, bin_s: float = 0.5, tolerance: float = 0.1) -> float:
    """Seconds from the spike's end until the server is back: the end of the last bin (after the spike's
    end) in which more than ``tolerance`` of the attempts that ended were refused. 0 when no bin after the
    spike is; ``inf`` when the last bin of the run still is (it did not recover while measured)."""
    rows = _bins(run, bin_s)
    bad = [r for r in rows if r["refusals"] > tolerance * max(1, r["successes"] + r["refusals"])]
    bad_after = [r for r in bad if r["t_s"] + bin_s > run.shape.spike_end_s]
    if not bad_after:
        return 0.0
    if bad_after[-1] is rows[-1]:
        return math.inf
    return bad_after[-1]["t_s"] + bin_s - run.shape.spike_end_s


def storm_table(runs: Sequence[StormRun], bin_s: float = 0.5) -> pd.DataFrame:
    """Offered load over time: :data:`STORM_COLUMNS`, one row per strategy and bin of ``bin_s`` seconds."""
    import pandas as pd

    rows = [{"strategy": run.strategy, "t_s": r["t_s"], "attempts_per_s": r["attempts"] / bin_s,
             "successes_per_s": r["successes"] / bin_s, "refusals_per_s": r["refusals"] / bin_s}
            for run in runs for r in _bins(run, bin_s)]  # fmt: skip
    return pd.DataFrame(rows, columns=list(STORM_COLUMNS))


def storm_summary(runs: Sequence[StormRun], bin_s: float = 0.5) -> pd.DataFrame:
    """One row per strategy: :data:`STORM_SUMMARY_COLUMNS`; amplification is attempts per request."""
    import pandas as pd

    rows = [{"strategy": run.strategy, "attempts": len(run.attempts),
             "successes": sum(outcome_of(r) == "succeeded" for r in run.results),
             "amplification": len(run.attempts) / len(run.results), "recovery_s": recovery_s(run, bin_s)}
            for run in runs]  # fmt: skip
    return pd.DataFrame(rows, columns=list(STORM_SUMMARY_COLUMNS))


__all__ = [
    "OUTCOMES",
    "OVERLOAD_COLUMNS",
    "STORM_COLUMNS",
    "STORM_SUMMARY_COLUMNS",
    "STRATEGIES",
    "AttemptLog",
    "AttemptRecord",
    "FixedBackoff",
    "ImmediateRetry",
    "OverloadRun",
    "StormRun",
    "StormShape",
    "client_buckets",
    "make_retrier",
    "measure_capacity",
    "outcome_of",
    "overload_table",
    "recovery_s",
    "run_overload",
    "run_retry_storm",
    "server_buckets",
    "storm_summary",
    "storm_table",
]
