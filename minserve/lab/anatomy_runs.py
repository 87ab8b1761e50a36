"""Chapter 02: admission and queueing, run on the real engine.

:func:`admit_and_run` adds requests one at a time, as a server does with requests that come in one by one:
one that can never run (an empty prompt, a prompt longer than the context) is refused at once with a
``ValueError`` saying why, and the others are admitted and run to the end. :func:`seat_table` reads, from
the trace, when each request got a seat in the running batch: with more requests than ``max_num_seqs``,
the later ones wait in the queue until an earlier one finishes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams
from minserve.lab.anatomy import events_by_request
from minserve.trace import END_EVENTS, STEP_SPANS, TraceEvent, stage_durations_s

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


@dataclass
class Admission:
    """What came of a list of requests: the outputs of the admitted ones (by id, finished) and the message of
    each refused one (by id)."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def admit_and_run(llm: LLM, requests: Sequence[tuple[str, str | list[int], SamplingParams]]) -> Admission:
    """Add each ``(request_id, prompt, params)`` to the engine in turn; keep the message of each refusal;
    then step the engine until every admitted request has finished."""
    result = Admission()
    for request_id, prompt, params in requests:
        try:
            llm.engine.add_request(prompt, params, request_id=request_id)
        except ValueError as error:
            result.refused[request_id] = str(error)
    admitted = {rid for rid, _, _ in requests} - set(result.refused)
    while len(result.outputs) < len(admitted):
        for output in llm.engine.step():
            if output.finished and output.request_id in admitted:
                result.outputs[output.request_id] = output
    return result


def admission_table(admission: Admission, order: Iterable[str]) -> pd.DataFrame:
    """One row per request: ``admitted`` or ``refused``, its finish reason and output tokens, or why not."""
    rows = []
    for rid in order:
        out = admission.outputs.get(rid)
        rows.append(
            {
                "request": rid,
                "outcome": "refused" if rid in admission.refused else "admitted",
                "finish_reason": out.finish_reason if out else None,
                "output tokens": len(out.token_ids) if out else 0,
                "message": admission.refused.get(rid, ""),
            }
        )
    return pd.DataFrame(rows).set_index("request")


def seat_table(events: Iterable[TraceEvent]) -> pd.DataFrame:
    """Per request (by arrival): the step it first ran in (1 = the first step of the trace), its queue time,
    when it started and ended (ms since the first arrival), and how many requests had ended before it started.

    ``ended_before`` is the evidence of a seat handed on: a request that waited for one starts only after
    some request has ended.
    """
    groups = events_by_request(events)
    step_starts = sorted({e.start_s for evs in groups.values() for e in evs if e.name in STEP_SPANS})
    step_index = {start: i + 1 for i, start in enumerate(step_starts)}
    ends = {rid: _end(evs) for rid, evs in groups.items()}
    origin = min((e.start_s for evs in groups.values() for e in evs if e.name == "arrival"), default=0.0)
    rows = []
    for rid, evs in groups.items():
        first = min((e.start_s for e in evs if e.name in STEP_SPANS), default=None)
        rows.append(
            {
                "request": rid,
                "first step": step_index.get(first, 0) if first is not None else 0,
                "queue ms": stage_durations_s(evs)["queue"] * 1e3,
                "start ms": (first - origin) * 1e3 if first is not None else float("nan"),
                "end ms": (ends[rid] - origin) * 1e3,
                "ended_before": _ended_by(ends, rid, first),
            }
        )
    return pd.DataFrame(rows).set_index("request")


def _ended_by(ends: dict[str, float], rid: str, time_s: float | None) -> int:
    """How many requests other than ``rid`` had ended by ``time_s`` (none, if it never ran)."""
    return 0 if time_s is None else sum(1 for other, end in ends.items() if other != rid and end <= time_s)


def _end(events: Sequence[TraceEvent]) -> float:
    return next(e.start_s for e in events if e.name in END_EVENTS)
