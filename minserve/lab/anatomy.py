"""Chapter 02: a request's life drawn from the engine's trace, and the bytes behind each streamed token.

The pure functions (:func:`events_by_request`, :func:`timeline_rows`, :func:`stage_table`,
:func:`stage_breakdown`, :func:`breakdown_html`, :func:`token_bytes`, :func:`token_pieces`,
:func:`detokenizer_steps`) take trace events or token ids and return rows; the figure and the widget only
draw those rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go

from minserve.engine.detokenizer import REPLACEMENT_CHARACTER, Decoder, IncrementalDetokenizer
from minserve.lab.theme import register_course_theme
from minserve.trace import END_EVENTS, STEP_SPANS, TraceEvent, spans_in_order, stage_durations_s

# In the order a request meets them (see minserve.trace.stage_durations_s).
STAGES = ("tokenize", "queue", "prefill", "decode", "sample", "detokenize", "between", "finish")
STAGE_COLORS = {  # Okabe–Ito, distinguishable with every common colour-vision deficiency
    "tokenize": "#CC79A7",
    "queue": "#BBBBBB",
    "prefill": "#E69F00",
    "decode": "#0072B2",
    "sample": "#D55E00",
    "detokenize": "#009E73",
    "between": "#56B4E9",
    "finish": "#000000",
}


# --- the trace, per request ---------------------------------------------------------------------------------


def events_by_request(events: Iterable[TraceEvent]) -> dict[str, list[TraceEvent]]:
    """Events grouped by request, requests in order of arrival, each request's events in time order.

    Only requests that both arrived and ended (any of the trace's end events) are kept: a request still in flight
    has no end-to-end latency yet.
    """
    groups: dict[str, list[TraceEvent]] = {}
    for event in events:
        groups.setdefault(event.request_id, []).append(event)
    complete = {
        rid: sorted(evs, key=lambda e: e.start_s)
        for rid, evs in groups.items()
        if any(e.name == "arrival" for e in evs) and any(e.name in END_EVENTS for e in evs)
    }
    return dict(sorted(complete.items(), key=lambda item: _arrival_s(item[1])))


def _arrival_s(events: Sequence[TraceEvent]) -> float:
    return next(e.start_s for e in events if e.name == "arrival")


def _end_s(events: Sequence[TraceEvent]) -> float:
    return next(e.start_s for e in events if e.name in END_EVENTS)


def e2e_s(events: Sequence[TraceEvent]) -> float:
    """End-to-end latency of one request from its events: arrival → finished (or cancelled)."""
    return _end_s(events) - _arrival_s(events)


def timeline_rows(events: Sequence[TraceEvent], origin_s: float | None = None) -> list[dict[str, object]]:
    """One request's life as back-to-back spans ``{stage, start_s, end_s}``, times relative to ``origin_s``.

    Every span of the trace (``tokenize``, ``prefill``/``decode``, ``sample``, ``detokenize``) in time order;
    the gaps before its first step are ``queue``, the gaps after it ``between``, and the last span → its end
    is ``finish``. The rows tile arrival → end when the spans never overlap, so their durations add up to
    the end-to-end latency. ``origin_s`` defaults to the request's arrival.
    """
    arrival, end = _arrival_s(events), _end_s(events)
    origin = arrival if origin_s is None else origin_s
    spans = spans_in_order(list(events))
    rows: list[dict[str, object]] = []
    t, started = arrival, False

    def add(stage: str, start: float, stop: float) -> None:
        if stop > start or stage not in ("queue", "between", "finish"):  # no empty gaps
            rows.append({"stage": stage, "start_s": start - origin, "end_s": stop - origin})

    for span in spans:
        started_now = started or span.name in STEP_SPANS
        add("between" if started else "queue", t, span.start_s)
        add(span.name, span.start_s, span.end_s)
        t, started = span.end_s, started_now
    add("finish" if started else "queue", t, end)
    return rows


def stage_table(events: Iterable[TraceEvent]) -> pd.DataFrame:
    """Per request (rows, by arrival): each stage in ms, their sum, the E2E latency in ms, and steps run."""
    rows = []
    for rid, evs in events_by_request(events).items():
        stages = stage_durations_s(evs)
        row = {"request": rid, **{f"{s}_ms": stages[s] * 1e3 for s in STAGES}}
        row["sum_ms"] = sum(stages.values()) * 1e3
        row["e2e_ms"] = e2e_s(evs) * 1e3
        row["steps"] = sum(1 for e in evs if e.name in STEP_SPANS)
        rows.append(row)
    columns = ["request", *(f"{s}_ms" for s in STAGES), "sum_ms", "e2e_ms", "steps"]
    return pd.DataFrame(rows, columns=columns).set_index("request")


def request_timeline(events: Iterable[TraceEvent], title: str | None = None) -> go.Figure:
    """A Gantt-like chart: one row per request, its life as spans coloured by stage, ms from the first arrival."""
    groups = events_by_request(events)
    origin = min((_arrival_s(evs) for evs in groups.values()), default=0.0)
    by_stage: dict[str, dict[str, list]] = {s: {"y": [], "base": [], "x": []} for s in STAGES}
    for rid, evs in groups.items():
        for row in timeline_rows(evs, origin):
            bucket = by_stage[str(row["stage"])]
            bucket["y"].append(f"request {rid}")
            bucket["base"].append(float(row["start_s"]) * 1e3)  # type: ignore[arg-type]
            bucket["x"].append((float(row["end_s"]) - float(row["start_s"])) * 1e3)  # type: ignore[arg-type]
    fig = go.Figure()
    for stage, bucket in by_stage.items():
        if bucket["y"]:
            fig.add_trace(
                go.Bar(
                    name=stage,
                    orientation="h",
                    y=bucket["y"],
                    base=bucket["base"],
                    x=bucket["x"],
                    marker_color=STAGE_COLORS[stage],
                    marker_line_width=0.5,
                    marker_line_color="white",
                    hovertemplate=f"{stage}<br>start %{{base:.2f}} ms<br>%{{x:.2f}} ms<extra>%{{y}}</extra>",
                )
            )
    fig.update_layout(
        template=register_course_theme(),
        barmode="overlay",
        title=title or f"{len(groups)} request(s): where each one's time went",
        xaxis_title="time since the first arrival (ms)",
        yaxis={"autorange": "reversed", "title": ""},
        height=160 + 36 * len(groups),
        legend_traceorder="normal",
    )
    return fig


# --- the explorer: one request's stage breakdown -------------------------------------------------------------


def stage_breakdown(events: Iterable[TraceEvent], request_id: str) -> dict[str, float]:
    """Stage → milliseconds for one request, in :data:`STAGES` order. ``KeyError`` if it is not in the trace."""
    evs = events_by_request(events)[request_id]
    stages = stage_durations_s(evs)
    return {s: stages[s] * 1e3 for s in STAGES}


def breakdown_html(breakdown_ms: dict[str, float], width_px: int = 420) -> str:
    """A stacked bar (HTML) of a stage breakdown with a legend of ms and shares; shares sum to 100 %."""
    total = sum(breakdown_ms.values())
    segments, legend = [], []
    for stage, ms in breakdown_ms.items():
        share = ms / total if total > 0 else 0.0
        color = STAGE_COLORS.get(stage, "#999999")
        segments.append(
            f"<div title='{stage}' style='width:{share * width_px:.1f}px;height:22px;background:{color}'></div>"
        )
        legend.append(
            f"<tr><td><span style='color:{color}'>■</span> {stage}</td>"
            f"<td style='text-align:right;padding-left:12px'>{ms:.2f} ms</td>"
            f"<td style='text-align:right;padding-left:12px'>{share:.0%}</td></tr>"
        )
    bar = f"<div style='display:flex;width:{width_px}px;border:1px solid #ccc'>{''.join(segments)}</div>"
    footer = f"<tr><td><b>E2E</b></td><td style='text-align:right;padding-left:12px'><b>{total:.2f} ms</b></td></tr>"
    return f"{bar}<table>{''.join(legend)}{footer}</table>"


def stage_explorer(events: Iterable[TraceEvent]) -> widgets.VBox:
    """Pick a request id; see where its time went as a stacked bar."""
    events = list(events)
    ids = list(events_by_request(events))
    picker = widgets.Dropdown(options=ids, value=ids[0] if ids else None, description="request")
    readout = widgets.HTML()

    def update(_change: object = None) -> None:
        readout.value = breakdown_html(stage_breakdown(events, picker.value)) if picker.value is not None else ""

    picker.observe(update, names="value")
    update()
    return widgets.VBox([picker, readout])


# --- bytes, tokens and the incremental detokenizer ----------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: the printable character standing for each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer: Decoder, token_id: int) -> bytes:
    """The raw bytes one token stands for (byte-level BPE); other tokenizers fall back to its decoded UTF-8."""
    piece = tokenizer.id_to_token(token_id) if hasattr(tokenizer, "id_to_token") else None
    table = _byte_level_decoder()
    if piece is not None and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return tokenizer.decode([token_id]).encode("utf-8")


def token_pieces(tokenizer: Decoder, token_ids: Sequence[int]) -> pd.DataFrame:
    """One row per token: its id, its bytes in hex, and what decoding it *alone* prints (U+FFFD if partial)."""
    rows = [
        {
            "token_id": t,
            "bytes": token_bytes(tokenizer, t).hex(" "),
            "decoded alone": repr(tokenizer.decode([t])),
        }
        for t in token_ids
    ]
    return pd.DataFrame(rows, columns=["token_id", "bytes", "decoded alone"])


def detokenizer_steps(tokenizer: Decoder, token_ids: Sequence[int]) -> pd.DataFrame:
    """Feed tokens to an :class:`IncrementalDetokenizer` one at a time; a row per ``add`` (and the flush).

    Columns: ``token_id``, its ``bytes``, the ``delta`` released (maybe empty), ``held_bytes`` (bytes
    received but not yet released as text) and whether the delta contains U+FFFD.
    """
    detok = IncrementalDetokenizer(tokenizer)
    received = 0
    rows = []
    for t in token_ids:
        raw = token_bytes(tokenizer, t)
        received += len(raw)
        delta = detok.add(t)
        rows.append(_detok_row(t, raw.hex(" "), delta, received - len(detok.text.encode("utf-8"))))
    delta = detok.flush()
    rows.append(_detok_row(None, "", delta, received - len(detok.text.encode("utf-8"))))
    return pd.DataFrame(rows, columns=["token_id", "bytes", "delta", "held_bytes", "has_U+FFFD"])


def _detok_row(token_id: int | None, hex_bytes: str, delta: str, held: int) -> dict[str, object]:
    return {
        "token_id": "flush" if token_id is None else token_id,
        "bytes": hex_bytes,
        "delta": delta,
        "held_bytes": max(held, 0),
        "has_U+FFFD": REPLACEMENT_CHARACTER in delta,
    }
