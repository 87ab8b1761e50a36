"""minserve.lab.anatomy: timelines and stage breakdowns from synthetic traces, bytes behind tokens."""

from __future__ import annotations

import itertools
import random

import pytest

from minserve.lab import anatomy
from minserve.trace import TraceEvent


def _request(rid: str, arrival: float, steps: list[tuple[str, float, float]], end: float, ended: str = "finished"):
    events = [TraceEvent(rid, "arrival", arrival), TraceEvent(rid, "queued", arrival)]
    events += [TraceEvent(rid, name, start, stop - start) for name, start, stop in steps]
    events.append(TraceEvent(rid, ended, end))
    return events


def _random_trace(seed: int) -> list[TraceEvent]:
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    for i in range(rng.randint(1, 6)):
        t = arrival = rng.uniform(0, 1)
        steps = []
        for k in range(rng.randint(0, 8)):
            start = t + rng.uniform(0, 0.05)
            t = start + rng.uniform(0.001, 0.02)
            steps.append(("prefill" if k == 0 else "decode", start, t))
        events += _request(str(i), arrival, steps, t + rng.uniform(0, 0.01), rng.choice(["finished", "cancelled"]))
    rng.shuffle(events)
    return events


def test_events_by_request_orders_by_arrival_and_drops_unfinished():
    events = _request("b", 2.0, [], 3.0) + _request("a", 1.0, [], 4.0) + [TraceEvent("c", "arrival", 0.5)]
    groups = anatomy.events_by_request(events)
    assert list(groups) == ["a", "b"]
    assert anatomy.e2e_s(groups["a"]) == pytest.approx(3.0)


def test_timeline_rows_tile_arrival_to_end():
    events = _request("0", 1.0, [("prefill", 1.5, 2.0), ("decode", 2.25, 2.5)], 3.0)
    rows = anatomy.timeline_rows(events)
    assert [r["stage"] for r in rows] == ["queue", "prefill", "between", "decode", "finish"]
    assert rows[0]["start_s"] == 0.0 and rows[-1]["end_s"] == pytest.approx(2.0)
    for a, b in itertools.pairwise(rows):
        assert a["end_s"] == pytest.approx(b["start_s"])


def test_request_with_no_steps_is_all_queue():
    rows = anatomy.timeline_rows(_request("0", 1.0, [], 1.5, "cancelled"))
    assert rows == [{"stage": "queue", "start_s": 0.0, "end_s": 0.5}]


@pytest.mark.parametrize("seed", range(20))
def test_stages_add_up_to_e2e_on_random_traces(seed):
    events = _random_trace(seed)
    table = anatomy.stage_table(events)
    assert (abs(table["sum_ms"] - table["e2e_ms"]) < 1e-6).all()
    for rid, evs in anatomy.events_by_request(events).items():
        durations = sum(r["end_s"] - r["start_s"] for r in anatomy.timeline_rows(evs))
        assert durations == pytest.approx(anatomy.e2e_s(evs), abs=1e-9)
        assert sum(anatomy.stage_breakdown(events, rid).values()) == pytest.approx(table.loc[rid, "e2e_ms"])


def test_breakdown_html_lists_every_stage_and_the_total():
    html = anatomy.breakdown_html({**dict.fromkeys(anatomy.STAGES, 0.0), "queue": 1.0, "prefill": 3.0})
    for stage in anatomy.STAGES:
        assert stage in html
    assert "4.00 ms" in html and "75%" in html
    assert "0%" in anatomy.breakdown_html(dict.fromkeys(anatomy.STAGES, 0.0))  # no division by zero


def test_request_timeline_has_one_row_per_request():
    events = _random_trace(3)
    fig = anatomy.request_timeline(events)
    rows = {y for trace in fig.data for y in trace.y}
    assert rows == {f"request {rid}" for rid in anatomy.events_by_request(events)}
    assert all(x >= 0 for trace in fig.data for x in trace.x)


def test_stage_explorer_shows_the_picked_request():
    events = _random_trace(1)
    box = anatomy.stage_explorer(events)
    picker, readout = box.children
    assert "E2E" in readout.value
    if len(picker.options) > 1:
        picker.value = picker.options[-1]
        expected = anatomy.breakdown_html(anatomy.stage_breakdown(events, picker.options[-1]))
        assert readout.value == expected


class _ByteTokenizer:
    """One token per byte, named in GPT-2's byte-level alphabet, like the embedded model's tokenizer."""

    def __init__(self) -> None:
        self.alphabet = {b: c for c, b in anatomy._byte_level_decoder().items()}

    def id_to_token(self, token_id: int) -> str:
        return self.alphabet[token_id]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def test_byte_level_alphabet_is_a_bijection():
    table = anatomy._byte_level_decoder()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["a"] == ord("a")


def test_detokenizer_steps_hold_back_partial_characters():
    tok = _ByteTokenizer()
    text = "a 世界 🐍!"
    ids = list(text.encode("utf-8"))
    pieces = anatomy.token_pieces(tok, ids)
    assert pieces["bytes"].str.replace(" ", "").str.cat() == text.encode("utf-8").hex()
    steps = anatomy.detokenizer_steps(tok, ids)
    assert "".join(steps["delta"]) == text
    assert not steps["has_U+FFFD"].any()
    assert steps["held_bytes"].max() == 3  # the emoji is four bytes: three wait for the fourth
    assert steps["held_bytes"].iloc[-1] == 0
