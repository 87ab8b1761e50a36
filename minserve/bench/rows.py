"""What the rows of ``records.jsonl`` say, read back: one request's SLO record, its latency from the intended
or the actual send, and how many requests were in flight.

A row is one request as :func:`minserve.bench.report.record_rows` wrote it (what the client saw, times in
seconds from the run's start). These functions let a saved bundle be re-analysed exactly as the load
tester's own summary was computed, with no server and nothing in memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from minserve import slo
from minserve.bench.client import RequestResult
from minserve.bench.metrics import to_slo_record

Row = Mapping[str, Any]
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestResult))


def rows_to_records(rows: Iterable[Row]) -> list[slo.RequestRecord]:
    """:class:`minserve.slo.RequestRecord` per row, exactly as the load tester's summary computed them."""
    return [to_slo_record(RequestResult(**{k: row[k] for k in _RESULT_FIELDS if k in row})) for row in rows]


def max_in_flight(rows: Iterable[Row]) -> int:
    """The most requests in flight at once (sent, not yet ended), from the rows' send and end times."""
    events = sorted(p for row in rows for p in ((row["sent_s"], 1), (row["end_s"], -1)))  # ends sort first
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def mean_in_flight(rows: Sequence[Row], duration_s: float) -> float:
    """The time-average number of requests in flight over ``duration_s``: Σ (end − sent) / duration."""
    return sum(row["end_s"] - row["sent_s"] for row in rows) / duration_s if duration_s > 0 else math.nan


def from_intended_ms(row: Row, metric: str = "e2e") -> float | None:
    """TTFT or E2E of one row in ms, measured from when the timetable *intended* to send it.

    That is what a user who arrived on time waited: the client's lag plus what the client measured.
    """
    end_s = _end_s(row, metric)
    return None if end_s is None else (end_s - row["intended_s"]) * 1e3


def from_sent_ms(row: Row, metric: str = "e2e") -> float | None:
    """TTFT or E2E of one row in ms, from the *actual* send (what the load tester reports)."""
    end_s = _end_s(row, metric)
    return None if end_s is None else (end_s - row["sent_s"]) * 1e3


def _end_s(row: Row, metric: str) -> float | None:
    """Where ``metric`` ends: the last byte (``e2e``) or the first content chunk (``ttft``), ``None`` if none came."""
    return row["end_s"] if metric == "e2e" else (row["chunk_times_s"] or [None])[0]
