"""vLLM's benchmark definitions, computed with :mod:`minserve.slo` from what the client saw.

* TTFT: send → first chunk with non-empty text.
* TPOT: (E2E − TTFT) / (n − 1), n = output tokens (the server's usage count when it sent one).
* ITL: every gap between consecutive content chunks, pooled over requests.
* E2E: send → last byte.
* request and output-token throughput over the run's wall time; goodput against an :class:`~minserve.slo.SLO`.

Latencies are measured from the *actual* send time, as vLLM does; the client's own lag (actual − intended)
is reported beside them, so a client that fell behind its timetable shows it instead of hiding it.
Failed and cancelled requests leave the latency distributions but count against goodput and attainment.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minserve import slo
from minserve.bench.arrivals import ClosedLoop
from minserve.bench.client import RequestResult
from minserve.bench.runner import RunResult


def to_slo_record(result: RequestResult) -> slo.RequestRecord:
    """A :class:`minserve.slo.RequestRecord` with one timestamp per *token*, so TPOT uses the usage count.

    A chunk may carry several tokens; we do not know which, so the tokens past the chunk count share the
    last chunk's time. That placement changes none of the SLO metrics: TTFT (first chunk), E2E (end), TPOT
    (depends only on n) and max ITL (repeated times add zero gaps) are the same wherever the repeats go.
    """
    times = list(result.chunk_times_s)
    if times and result.output_tokens > len(times):
        times += [times[-1]] * (result.output_tokens - len(times))
    return slo.RequestRecord(
        arrival_s=result.sent_s,
        token_times_s=tuple(times),
        finish_s=max(result.end_s, times[-1]) if times else result.end_s,
        status=result.status,  # type: ignore[arg-type]  # the client only ever writes the three statuses
        prompt_tokens=result.prompt_tokens,
        request_id=str(result.index),
    )


def chunk_itl_s(results: Sequence[RequestResult]) -> list[float]:
    """Inter-chunk gaps of the ok requests, pooled, seconds (vLLM's ITL)."""
    return [gap for r in results if r.status == "ok" for gap in slo.itl_s(r.chunk_times_s)]


def per_request_metrics(result: RequestResult) -> dict[str, float | None]:
    """TTFT, TPOT and E2E of one request in milliseconds (``None`` where undefined)."""
    record = to_slo_record(result)
    as_ms = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s, "e2e_ms": record.e2e_s}
    return {key: None if value is None else value * 1e3 for key, value in as_ms.items()}


@dataclass(frozen=True)
class Pricing:
    """What the server's hardware costs: US dollars per accelerator-hour, times the accelerators it uses."""

    usd_per_accelerator_hour: float
    accelerators: int = 1


def verdict(records: Sequence[slo.RequestRecord], contract: slo.SLO, required_attainment: float) -> dict[str, Any]:
    """Does the run keep the contract? Both must hold:

    * at least ``required_attainment`` of the requests meet every latency target, counting the requests the
      client did not cancel on purpose (an injected cancellation says nothing about the server);
    * availability, ok / (ok + failed), is at least the contract's ``availability``.
    """
    judged = [r for r in records if r.status != "cancelled"]
    met = slo.attainment(judged, contract)["all"] if judged else math.nan
    available = slo.availability(judged)
    passed = met >= required_attainment and available >= contract.availability  # nan compares False
    return {
        "passed": bool(passed),
        "attainment": met,
        "required_attainment": required_attainment,
        "availability": available,
        "required_availability": contract.availability,
    }


def offered_rps(run: RunResult) -> float:
    """The rate an open-loop timetable actually offered: requests over the span to the last intended send.

    A few dozen random arrivals never match the nominal rate exactly; this is the rate the server got.
    ``nan`` for a closed loop (it offers whatever the server allows) and for a single request.
    """
    intended = [r.intended_s for r in run.results]
    if isinstance(run.arrival, ClosedLoop) or len(intended) < 2 or max(intended) <= 0:
        return math.nan
    return len(intended) / max(intended)


def summarize(
    run: RunResult,
    contract: slo.SLO | None = None,
    pricing: Pricing | None = None,
    required_attainment: float = 0.99,
) -> dict[str, Any]:
    """Everything the report prints for one run, as plain JSON-able values (times in ms, rates per s).

    The latencies, throughputs, goodput and attainment are :func:`minserve.slo.summarize`'s, over the run's
    wall time and with ITL between chunks; this adds only what a load tester knows: the label, error kinds,
    the offered rate, token totals, the client's lag and CPU, and with a ``contract`` the :func:`verdict`,
    with ``pricing`` the cost per million output tokens at the measured throughput.
    """
    results, window = run.results, run.duration_s
    records = [to_slo_record(r) for r in results]
    measured = slo.summarize(records, contract, window, itl_values_s=chunk_itl_s(results))
    summary: dict[str, Any] = {
        "label": run.label,
        **measured,
        "errors": dict(Counter(r.error for r in results if r.error)),
        "duration_s": window,
        "offered_rps": offered_rps(run),
        "total_prompt_tokens": sum(r.prompt_tokens for r in results if r.status == "ok"),
        "total_output_tokens": sum(r.output_tokens for r in results if r.status == "ok"),
        "output_tokens_source": dict(Counter(r.output_tokens_source for r in results)),
    }
    summary["client_lag_ms"] = slo.distribution_ms([r.client_lag_s for r in results])
    summary["client_cpu_s"] = run.client_cpu_s
    summary["client_cpu_util"] = run.client_cpu_s / window if window > 0 else math.nan
    if contract is not None:
        summary["slo"] = {"name": contract.name, **{f"{k}_ms": v * 1e3 for k, v in contract.targets().items()}}
        summary["verdict"] = verdict(records, contract, required_attainment)
    if pricing is not None:
        summary["usd_per_million_output_tokens"] = slo.cost_per_million_tokens(
            pricing.usd_per_accelerator_hour, summary["output_throughput_tps"], pricing.accelerators
        )
    return summary
