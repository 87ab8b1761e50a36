"""Request lifecycle tracing: events on one clock, Perfetto-compatible JSON, and stages that add up."""

from __future__ import annotations

import json

import pytest

from minserve import LLM, SamplingParams
from minserve.trace import SPANS, gaps_s, stage_durations_s


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
        for name in ("arrival", "tokenize", "tokenized", "queued", "scheduled", "prefill", "first_token", "finished"):
            assert name in names, name
        assert names.count("decode") == len(out.token_ids) - 1
        assert names.count("sample") == names.count("detokenize") == len(out.token_ids)
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
        assert set(SPANS) <= set(stages) and stages["tokenize"] > 0 and stages["sample"] > 0


def test_spans_never_overlap_and_end_before_the_request_does(traced):
    """The forward pass ends where sampling starts; a request ends after its last token is detokenized."""
    llm, outs = traced
    for out in outs:
        events = llm.tracer.for_request(out.request_id)
        assert min(gaps_s(events)) >= -1e-9
        last_detokenize = max(e.end_s for e in events if e.name == "detokenize")
        assert last_detokenize <= out.metrics.finish_time_s
        steps = {e.start_s: e for e in events if e.name in ("prefill", "decode")}
        for sample in (e for e in events if e.name == "sample"):
            assert any(step.end_s == pytest.approx(sample.start_s, abs=1e-12) for step in steps.values())


def test_a_batch_shares_its_steps():
    llm = LLM(max_num_seqs=4)
    outs = llm.generate(["a = 1", "b = 2", "c = 3"], SamplingParams(max_tokens=5, ignore_eos=True))
    starts = [{e.start_s for e in llm.tracer.for_request(o.request_id) if e.name == "decode"} for o in outs]
    assert starts[0] == starts[1] == starts[2] and len(starts[0]) == 4


def test_tracing_off_records_nothing_and_times_no_sampling():
    llm = LLM(enable_tracing=False)
    out = llm.generate("def f():", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(llm.tracer.events) == 0 and llm.engine.runner.sampling_started_s is None
    assert len(out.token_ids) == 4 and out.metrics.finish_time_s >= out.metrics.token_times_s[-1]


def test_engine_add_request_traces_its_own_tokenizing():
    llm = LLM()
    rid = llm.engine.add_request("def g(x):", SamplingParams(max_tokens=2, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    [tokenize] = [e for e in llm.tracer.for_request(rid) if e.name == "tokenize"]
    assert tokenize.duration_s > 0 and tokenize.args["tokens"] > 0


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
