"""What a benchmark leaves behind: ``records.jsonl``, ``summary.json`` and a printed table.

``records.jsonl`` holds one line per request per run (the raw evidence: every chunk time, the status, the
error kind), so any number in the summary can be recomputed from it. ``summary.json`` holds the
configuration and one summary per run. Not-a-number values (a percentile of nothing) are written as
``null``: JSON has no NaN.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minserve.bench.metrics import per_request_metrics
from minserve.bench.runner import RunResult
from minserve.slo import lookup

TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    # (header, key path in a run summary)
    ("run", "label"),
    ("ok", "ok"),
    ("fail", "failed"),
    ("canc", "cancelled"),
    ("offered", "offered_rps"),
    ("req/s", "request_throughput_rps"),
    ("tok/s", "output_throughput_tps"),
    ("good/s", "goodput_rps"),
    ("TTFT p50", "ttft_ms.p50"),
    ("TTFT p99", "ttft_ms.p99"),
    ("TPOT p50", "tpot_ms.p50"),
    ("TPOT p99", "tpot_ms.p99"),
    ("ITL p99", "itl_ms.p99"),
    ("E2E p99", "e2e_ms.p99"),
    ("lag p99", "client_lag_ms.p99"),
    ("client CPU", "client_cpu_util"),
)


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by ``None``, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def record_rows(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per request per run: its run label, what the client saw, and TTFT/TPOT/E2E in ms."""
    return [
        json_safe({"run": run.label, **result.as_dict(), **per_request_metrics(result)})
        for run in runs
        for result in run.results
    ]


def write_records(path: Path, runs: Sequence[RunResult]) -> int:
    """:func:`record_rows` as JSON lines (``records.jsonl``); returns how many."""
    rows = record_rows(runs)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def write_summary(
    path: Path, config: dict[str, Any], summaries: Sequence[dict[str, Any]], environment: dict[str, Any] | None = None
) -> None:
    """``{"config": ..., "environment": ..., "runs": [...]}`` as indented JSON."""
    document = {"config": config, "environment": environment or {}, "runs": list(summaries)}
    Path(path).write_text(json.dumps(json_safe(document), indent=2) + "\n")


def cell_text(value: Any) -> str:
    """A number as a table shows it: 3 significant digits below 10, whole numbers above; ``-`` for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per run: counts, throughput, goodput and the tail latencies (ms)."""
    rows = [[header for header, _ in TABLE_COLUMNS]]
    rows += [[cell_text(lookup(s, key)) for _, key in TABLE_COLUMNS] for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    notes = [f"{s['label']}: errors {s['errors']}" for s in summaries if s.get("errors")]
    return "\n".join([*lines, *notes])
