"""Chapter 02's checks (``minserve.lab.anatomy_checks``) pass on the real engine and fail on one without the
property each claims: one sequence per step, every request seated at once, overlapping stages, a refusal
that takes the others down, a cancelled request keeping its blocks, a stream of half characters.

Behaviour only: the timing checks are fed hand-made numbers, never a wall-clock threshold.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from minserve import LLM, SamplingParams
from minserve.engine.detokenizer import REPLACEMENT_CHARACTER
from minserve.lab import anatomy_checks as checks
from minserve.lab import anatomy_runs
from minserve.lab.anatomy_steps import DecodeModel, decode_steps, step_prediction_table
from minserve.trace import TraceEvent

PROMPTS = ["def f(x):", "import os", "class A:", "x = [1, 2,"]
LENGTHS = [3, 9, 5, 7]


def _batch(llm: LLM):
    llm.tracer.clear()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS]
    outs = llm.generate(PROMPTS, params)
    return list(llm.tracer.events), outs


@pytest.fixture(scope="module")
def batched():
    return _batch(LLM(max_num_seqs=4, max_num_batched_tokens=256))


@pytest.fixture(scope="module")
def one_per_step():
    """The broken engine: one sequence per step."""
    return _batch(LLM(max_num_seqs=1, max_num_batched_tokens=256))


# --- the trace ---------------------------------------------------------------------------------------------


def test_the_real_trace_passes_every_trace_check(batched):
    events, outs = batched
    checks.check_stages_never_overlap(events, min_requests=4)
    checks.check_stages_traced(events, outs)
    checks.check_shared_decode_steps(events, {o.request_id: n for o, n in zip(outs, LENGTHS)})
    assert len(decode_steps(events)) == max(LENGTHS) - 1


def test_one_sequence_per_step_fails_the_shared_steps_check(one_per_step):
    events, outs = one_per_step
    checks.check_stages_never_overlap(events, min_requests=4)  # still a well-formed trace
    with pytest.raises(AssertionError, match="prefilled in 4 steps|decode steps"):
        checks.check_shared_decode_steps(events, {o.request_id: n for o, n in zip(outs, LENGTHS)})


def _shift(event: TraceEvent, seconds: float) -> TraceEvent:
    return dataclasses.replace(event, start_s=event.start_s + seconds)


def test_overlapping_stages_are_caught(batched):
    events, _ = batched
    # A finish stamped before the last token was detokenized: what the engine did before detokenize spans.
    early_end = [
        _shift(e, -1e-3) if e.name == "finished" and e.request_id == events[0].request_id else e for e in events
    ]
    with pytest.raises(AssertionError, match="overlap"):
        checks.check_stages_never_overlap(early_end)
    # Sampling timed inside the forward pass.
    inside = [_shift(e, -e.duration_s / 2) if e.name == "sample" else e for e in events]
    with pytest.raises(AssertionError, match="overlap"):
        checks.check_stages_never_overlap(inside)
    with pytest.raises(AssertionError, match="complete requests"):
        checks.check_stages_never_overlap(events, min_requests=5)


def test_untraced_stages_are_caught(batched):
    events, outs = batched
    for name in ("tokenize", "sample", "detokenize"):
        with pytest.raises(AssertionError, match=name):
            checks.check_stages_traced([e for e in events if e.name != name], outs)
    with pytest.raises(AssertionError, match="missing spans"):
        checks.check_model_dominates([e for e in events if e.name != "sample"])


def test_sampling_as_slow_as_the_model_is_caught():
    events = [TraceEvent("a", "decode", 0.0, 1e-3), TraceEvent("a", "sample", 1e-3, 1e-3)]
    events.append(TraceEvent("a", "detokenize", 2e-3, 1e-6))
    with pytest.raises(AssertionError, match="sample"):
        checks.check_model_dominates(events)


# --- the prediction ----------------------------------------------------------------------------------------


def _model(fixed_s=1.3e-3, per_sequence_s=0.12e-3, weights_pass_s=0.3e-3) -> DecodeModel:
    return DecodeModel(fixed_s, per_sequence_s, 1e-3, weights_pass_s, 32, {1: 1e-3, 8: 1.1e-3}, ((1, 1.4e-3),))


def _steps(step_ms_by_batch: dict[int, float]) -> pd.DataFrame:
    rows = [{"start_s": float(b), "batch": b, "forward_ms": ms, "sample_ms": 0.0, "step_ms": ms}
            for b, ms in step_ms_by_batch.items()]  # fmt: skip
    return pd.DataFrame(rows)


def test_the_prediction_checks_pass_on_a_batching_engine():
    model = _model()
    table = step_prediction_table(_steps({b: model.predicted_s(b) * 1e3 for b in range(1, 9)}), model)
    checks.check_step_prediction(table)
    checks.check_batching_pays(model)
    checks.check_fixed_cost_dominates(model)


def test_a_prediction_that_misses_the_trace_fails():
    model = _model()
    one_per_step = {b: b * model.predicted_s(1) * 1e3 for b in range(1, 9)}  # what an unbatched engine measures
    with pytest.raises(AssertionError, match="within"):
        checks.check_step_prediction(step_prediction_table(_steps(one_per_step), model))
    with pytest.raises(AssertionError, match="batch 1 and above"):  # max_num_seqs=1: no batched step at all
        checks.check_step_prediction(step_prediction_table(_steps({1: 1.4}), model))


def test_one_burst_of_load_does_not_fail_the_prediction_but_a_wrong_line_does():
    model = _model()
    measured = {b: model.predicted_s(b) * 1e3 for b in range(1, 9)}
    measured[5] *= 10  # every step of one batch size slowed down by another process
    checks.check_step_prediction(step_prediction_table(_steps(measured), model))
    with pytest.raises(AssertionError):
        checks.check_step_prediction(step_prediction_table(_steps(measured), _model(per_sequence_s=1.3e-3)))


def test_no_fixed_cost_fails_the_batching_and_fixed_cost_checks():
    unbatched = _model(fixed_s=0.0, per_sequence_s=1.4e-3)  # a step costs its sequences, nothing shared
    with pytest.raises(AssertionError, match="not < 1/2"):
        checks.check_batching_pays(unbatched)
    with pytest.raises(AssertionError, match="per sequence"):
        checks.check_fixed_cost_dominates(unbatched)
    with pytest.raises(AssertionError, match="weights pass"):  # the weights, not overhead, make the fixed cost
        checks.check_fixed_cost_dominates(_model(weights_pass_s=1.0e-3))


# --- admission and queueing ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_context():
    return LLM(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=256)


def test_a_refusal_is_that_requests_alone(small_context):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    requests = [("a", "def f(x):", greedy), ("long", "x = 1\n" * 40, greedy), ("b", "import os", greedy)]
    admission = anatomy_runs.admit_and_run(small_context, requests)
    checks.check_refusal(admission, "long", "max_model_len", {"a": 4, "b": 4})
    table = anatomy_runs.admission_table(admission, ["a", "long", "b"])
    assert table["outcome"].to_list() == ["admitted", "refused", "admitted"]
    with pytest.raises(AssertionError, match="refused"):  # an engine that admitted it
        checks.check_refusal(anatomy_runs.Admission(admission.outputs, {}), "long", "max_model_len", {})
    with pytest.raises(AssertionError, match="output tokens"):  # the others cut short, or lost
        checks.check_refusal(dataclasses.replace(admission, outputs={}), "long", "max_model_len", {"a": 4, "b": 4})


def test_queueing_with_fewer_seats_than_requests(batched):
    events, _ = batched  # four seats, four requests: nobody waits
    seats = anatomy_runs.seat_table(events)
    assert (seats["first step"] == 1).all()
    with pytest.raises(AssertionError, match="nobody waited"):
        checks.check_queueing(seats, max_num_seqs=4)


def test_queueing_check_passes_when_requests_wait(small_context):
    small_context.tracer.clear()
    small_context.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS])
    seats = anatomy_runs.seat_table(small_context.tracer.events)
    checks.check_queueing(seats, max_num_seqs=2)
    with pytest.raises(AssertionError, match="expected 3"):
        checks.check_queueing(seats, max_num_seqs=3)
    jumped = seats.assign(ended_before=0)  # a request that got a seat before any had ended
    with pytest.raises(AssertionError, match="before any"):
        checks.check_queueing(jumped, max_num_seqs=2)


# --- cancellation and streaming ------------------------------------------------------------------------------


def test_cancel_and_stream_checks_fail_on_broken_data():
    during = {"kv_blocks_used": 2, "num_running": 1, "num_waiting": 0}
    after = {"kv_blocks_used": 0, "num_running": 0, "num_waiting": 0}
    checks.check_cancel_frees_blocks(during, after, "cancelled")
    with pytest.raises(AssertionError, match="still used"):
        checks.check_cancel_frees_blocks(during, {**after, "kv_blocks_used": 2}, "cancelled")
    with pytest.raises(AssertionError, match="not 'cancelled'"):
        checks.check_cancel_frees_blocks(during, after, "finished")
    checks.check_stream({"1": ["ab", "c"]}, {"1": "abc"})
    with pytest.raises(AssertionError, match="add up"):
        checks.check_stream({"1": ["ab"]}, {"1": "abc"})
    with pytest.raises(AssertionError, match="U\\+FFFD"):
        checks.check_stream({"1": ["a", REPLACEMENT_CHARACTER]}, {"1": "a" + REPLACEMENT_CHARACTER})


def test_detokenizer_check_fails_when_bytes_are_never_held_or_never_released():
    steps = pd.DataFrame({"delta": ["", "é"], "held_bytes": [1, 0], "has_U+FFFD": [False, False]})
    checks.check_detokenizer_steps(steps, "é")
    with pytest.raises(AssertionError, match="U\\+FFFD"):
        checks.check_detokenizer_steps(steps.assign(**{"has_U+FFFD": [True, False]}), "é")
    with pytest.raises(AssertionError, match="no byte"):
        checks.check_detokenizer_steps(steps.assign(held_bytes=[0, 0]), "é")
    with pytest.raises(AssertionError, match="still held"):
        checks.check_detokenizer_steps(steps.assign(held_bytes=[1, 1]), "é")
