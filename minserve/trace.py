"""Chapter 02: every request's life as events on one monotonic clock, exported for Perfetto or pandas.

The engine records, per request: ``arrival``, a ``tokenize`` span (when the engine or ``LLM`` tokenized the
prompt), ``tokenized``, ``queued``, ``scheduled`` (first time it runs), ``prefill`` spans (one per prompt chunk)
and ``decode`` spans (one per step that produced a token; with speculative decoding, a decode that carried
drafts has ``drafted`` and ``accepted`` counts; a model split across processes adds ``collective_s``, the
forward's wait in all-reduces and all-gathers) for the model's forward pass, a ``sample`` span for
each step that sampled it a token, a ``detokenize`` span for each token turned into text, ``first_token``,
``preempted`` (with its mode, recompute or swap) and ``resumed``, and one end event (:data:`END_EVENTS`):
``finished``, ``cancelled``, ``deadline`` or ``failed``. Times are seconds from ``time.perf_counter``; spans
carry a duration. ``to_chrome_trace`` gives the JSON that ui.perfetto.dev and chrome://tracing open (one
track per request); ``to_dataframe`` gives a table.

The invariant the engine keeps, and chapter 02 checks on measured data: one request's spans never overlap,
and they lie between its arrival and its end event (:func:`gaps_s` are all ≥ 0). A step's spans are shared
by every request in it: the batch's sequences have ``prefill``/``decode`` spans with the same start.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

STEP_SPANS = ("prefill", "decode")  # the model's forward pass: one span per step the request ran in
SPANS = ("tokenize", *STEP_SPANS, "sample", "detokenize")  # every event with a duration
END_EVENTS = ("finished", "cancelled", "deadline", "failed")  # exactly one of these ends every request


@dataclass(frozen=True)
class TraceEvent:
    request_id: str
    name: str
    start_s: float
    duration_s: float = 0.0  # zero for an instant
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


class Tracer:
    """Collects events; the oldest are dropped past ``max_events`` so a long-running server stays bounded.

    An event takes about 400 bytes, so the default bound keeps a trace under about 80 MB: the last few
    thousand requests of a busy server.
    """

    def __init__(self, enabled: bool = True, max_events: int = 200_000) -> None:
        self.enabled = enabled
        self.events: deque[TraceEvent] = deque(maxlen=max_events)

    def instant(self, request_id: str, name: str, t_s: float, **args: Any) -> None:
        if self.enabled:
            self.events.append(TraceEvent(request_id, name, t_s, 0.0, args))

    def span(self, request_id: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        if self.enabled:
            self.events.append(TraceEvent(request_id, name, start_s, end_s - start_s, args))

    def for_request(self, request_id: str) -> list[TraceEvent]:
        return [e for e in self.events if e.request_id == request_id]

    def clear(self) -> None:
        self.events.clear()

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON: complete events ("X") for spans, instants ("i"); one thread per request."""
        if not self.events:
            return {"traceEvents": [], "displayTimeUnit": "ms"}
        origin_s = min(e.start_s for e in self.events)
        threads: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        for event in self.events:
            tid = threads.setdefault(event.request_id, len(threads) + 1)
            record = {
                "name": event.name,
                "pid": 1,
                "tid": tid,
                "ts": (event.start_s - origin_s) * 1e6,
                "args": event.args,
            }
            if event.name in SPANS:
                record.update(ph="X", dur=event.duration_s * 1e6, cat="step")
            else:
                record.update(ph="i", s="t", cat="lifecycle")
            out.append(record)
        names = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": f"request {r}"}}
            for r, t in threads.items()
        ]
        return {"traceEvents": names + out, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome_trace()))
        return path

    def to_dataframe(self) -> pd.DataFrame:
        import pandas as pd

        rows = [
            {"request_id": e.request_id, "event": e.name, "start_s": e.start_s, "duration_s": e.duration_s, **e.args}
            for e in self.events
        ]
        return pd.DataFrame(rows, columns=["request_id", "event", "start_s", "duration_s", *_arg_columns(rows)])


def _arg_columns(rows: list[dict[str, Any]]) -> list[str]:
    fixed = {"request_id", "event", "start_s", "duration_s"}
    return list(dict.fromkeys(k for row in rows for k in row if k not in fixed))


def spans_in_order(events: list[TraceEvent]) -> list[TraceEvent]:
    """One request's spans (:data:`SPANS`), by start time."""
    return sorted((e for e in events if e.name in SPANS), key=lambda e: e.start_s)


def gaps_s(events: list[TraceEvent]) -> list[float]:
    """Seconds between consecutive moments of one request: arrival → its first span, each span's end → the
    next one's start, its last span's end → its end event. All ≥ 0 when the spans are ordered and never
    overlap (up to float rounding, about 1e-12 s); a negative gap is a bug in the engine's tracing."""
    arrival = next(e.start_s for e in events if e.name == "arrival")
    end = next(e.start_s for e in events if e.name in END_EVENTS)
    spans = spans_in_order(events)
    starts = [e.start_s for e in spans] + [end]
    ends = [arrival] + [e.end_s for e in spans]
    return [b - a for a, b in zip(ends, starts)]


def stage_durations_s(events: list[TraceEvent]) -> dict[str, float]:
    """Where one request's time went, in seconds, each stage measured on its own.

    ``tokenize``, ``prefill``, ``decode``, ``sample`` and ``detokenize``: the request's spans of that name.
    ``queue``: arrival → start of its first step, less its tokenization (waiting for the prompts tokenized
    before it, then for a seat in the batch). ``between``: the gaps between its spans from its first step on
    (the scheduler, building the step's inputs, steps it sat out). ``finish``: end of its last span → its end
    event. When the spans never overlap (:func:`gaps_s` ≥ 0), the stages add up to the end-to-end latency
    by construction: a tiling, not a measurement of anything.
    """
    arrival = next(e.start_s for e in events if e.name == "arrival")
    end = next(e.start_s for e in events if e.name in END_EVENTS)
    spans = spans_in_order(events)
    first = next((i for i, e in enumerate(spans) if e.name in STEP_SPANS), len(spans))  # its first step
    ran, before = spans[first:], spans[:first]
    queue_end = ran[0].start_s if ran else end
    return {
        "queue": queue_end - arrival - sum(e.duration_s for e in before),
        **{name: sum(e.duration_s for e in spans if e.name == name) for name in SPANS},
        "between": sum(b.start_s - a.end_s for a, b in itertools.pairwise(ran)),
        "finish": end - ran[-1].end_s if ran else 0.0,
    }
