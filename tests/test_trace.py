"""Request lifecycle tracing: events on one clock, Perfetto-compatible JSON, and stages that add up."""

from __future__ import annotations

import json

import pytest

from minserve import LLM, SamplingParams
from minserve.trace import stage_durations_s


@pytest.fixture(scope="module")
def traced():
    llm = LLM(max_num_batched_tokens=32)
    long_prompt = "def parse(text):\n    tokens = text.split()\n" * 6  # > 32 tokens: prefilled in chunks
    outs = llm.generate([long_prompt, "x = 1", "import os"], SamplingParams(max_tokens=6, ignore_eos=True))
    return llm, outs


def test_every_request_records_its_lifecycle_in_order(traced):
    llm, outs = traced
    for out in outs:
        events = llm.tracer.for_request(out.request_id)
        names = [e.name for e in events]
        for name in ("arrival", "tokenized", "queued", "scheduled", "prefill", "first_token", "finished"):
            assert name in names, name
        assert names.count("decode") == len(out.token_ids) - 1
        times = [e.start_s for e in events]
        assert times == sorted(times)
        assert events[0].start_s == out.metrics.arrival_time_s


def test_long_prompt_is_prefilled_in_chunks(traced):
    llm, outs = traced
    chunks = [e for e in llm.tracer.for_request(outs[0].request_id) if e.name == "prefill"]
    assert len(chunks) >= 2 and sum(e.args["tokens"] for e in chunks) == len(outs[0].prompt_token_ids)


def test_stages_add_up_to_end_to_end_latency(traced):
    llm, outs = traced
    for out in outs:
        stages = stage_durations_s(llm.tracer.for_request(out.request_id))
        assert sum(stages.values()) == pytest.approx(out.metrics.e2e_s, abs=1e-9)
        assert all(v >= -1e-9 for v in stages.values())


def test_chrome_trace_json_is_well_formed(traced, tmp_path):
    llm, outs = traced
    path = llm.tracer.save_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "i"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert len({e["tid"] for e in events if e["ph"] == "M"}) == len(outs)


def test_dataframe_view(traced):
    llm, _ = traced
    frame = llm.tracer.to_dataframe()
    assert {"request_id", "event", "start_s", "duration_s", "tokens"} <= set(frame.columns)
    assert len(frame) == len(llm.tracer.events)


def test_cancellation_is_traced():
    llm = LLM()
    stream = llm.stream("def f():", SamplingParams(max_tokens=100, ignore_eos=True))
    first = next(stream)
    stream.close()
    names = [e.name for e in llm.tracer.for_request(first.request_id)]
    assert names[-1] == "cancelled" and "finished" not in names
