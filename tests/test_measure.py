"""minserve.measure: the experiments' layer. Seeded prompts by hand, then the step recorder, the arrivals loop
and the decode measurements on the embedded tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minserve import LLM, SamplingParams
from minserve.capacity.simulator import SimRequest
from minserve.measure import decode, prompts, steps
from minserve.measure.arrivals import serve_arrivals


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(enable_tracing=False, max_num_seqs=8, num_threads=1)


def _report(states: list[str], end_s: float, computed: int = 10) -> SimpleNamespace:
    scheduled = [SimpleNamespace(state=s, num_computed_tokens=computed, num_new_tokens=1) for s in states]
    return SimpleNamespace(scheduled=scheduled, end_s=end_s)


# --- seeded prompts -------------------------------------------------------------------------------------------


def test_random_prompts_are_seeded_in_range_and_share_only_the_asked_prefix():
    made = prompts.random_prompts([5, 9, 1], vocab_size=50, seed=3)
    assert made == prompts.random_prompts([5, 9, 1], vocab_size=50, seed=3)
    assert made != prompts.random_prompts([5, 9, 1], vocab_size=50, seed=4)
    assert [len(p) for p in made] == [5, 9, 1]
    assert all(1 <= t < 50 for p in made for t in p)
    shared = prompts.random_prompts([6, 6, 3], vocab_size=1000, seed=0, shared_prefix_tokens=4)
    assert shared[0][:4] == shared[1][:4] == [*shared[2][:3], shared[0][3]]
    assert shared[0][4:] != shared[1][4:]


def test_repeated_prompts_come_back_after_a_rewind_and_seeded_ones_do_not():
    again = prompts.RepeatedPrompts(100, seed=1)
    first = [again.fresh(8), again.fresh(8), again.fresh(4)]
    again.rewind()
    assert [again.fresh(8), again.fresh(8), again.fresh(4)] == first
    stream = prompts.SeededPrompts(100, seed=1)
    assert stream.fresh(8) == first[0] and stream.fresh(8) != first[0]


# --- reading step reports ---------------------------------------------------------------------------------------


def test_decode_periods_are_step_end_to_step_end_of_pure_decode_steps_of_that_batch():
    reports = [
        _report(["prefill", "prefill"], 1.0),
        _report(["decode", "decode"], 1.5),
        _report(["decode", "decode"], 2.25),
        _report(["decode"], 3.0),
        _report(["decode", "prefill"], 3.5),
    ]
    assert steps.decode_periods(reports, 2) == [0.5, 0.75]
    assert steps.decode_periods(reports, 1) == [0.75]
    assert not steps.is_decode(_report([], 4.0))
    assert steps.context_tokens(_report(["decode", "decode"], 0.0, computed=31)) == 32


def test_step_recorder_records_what_ran_inside_and_always_unsubscribes(llm):
    core = llm.engine.core
    recorder = steps.StepRecorder(core, probe=lambda report: report.index)
    with pytest.raises(RuntimeError, match="inside"), recorder:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        raise RuntimeError("inside")
    assert recorder not in core.observers
    assert len(recorder.reports) == 3 and recorder.probes == [r.index for r in recorder.reports]


# --- the experiments ------------------------------------------------------------------------------------------


def test_serve_arrivals_by_step_adds_each_request_after_its_steps(llm):
    planned = [SimRequest(0.0, (3, 4, 5), 4), SimRequest(0.0, (6, 7, 8, 9), 2, request_id="late")]
    added_at: list[tuple[int, int]] = []

    def on_add(i: int) -> None:
        added_at.append((i, llm.engine.core.num_steps))

    start = llm.engine.core.num_steps
    outputs = serve_arrivals(llm.engine, planned, ["a", "late"], at_steps=[0, 2], on_add=on_add)
    assert [o.request_id for o in outputs] == ["a", "late"]
    assert [len(o.token_ids) for o in outputs] == [4, 2]
    assert added_at == [(0, start), (1, start + 2)]
    with pytest.raises(ValueError, match="1 arrival steps for 2 requests"):
        serve_arrivals(llm.engine, planned, at_steps=[0])


def test_pure_decode_reports_are_decode_steps_of_the_batch_and_leave_the_engine_idle(llm):
    batch = prompts.random_prompts([12, 12, 12], llm.model_config.vocab_size, seed=5)
    reports = decode.pure_decode_reports(llm.engine, batch, steps=4)
    assert len(reports) == 4 and all(steps.is_decode(r, 3) for r in reports)
    assert all(r.step_s >= r.duration_s > 0 for r in reports)
    assert not llm.engine.has_unfinished_requests()
    assert sum(r.num_tokens for r in decode.prefill_reports(llm.engine, batch[0])) == 12


def test_step_costs_pool_rounds_and_interleave_the_runs(llm):
    calls: list[int] = []
    costs, results = decode.repeat_beside_step_costs(
        llm, "def f(x):", lambda: calls.append(1) or len(calls), (1, 2), 4, 2
    )
    assert results == [1, 2] and costs.batch_sizes == (1, 2)
    assert all(s > 0 for s in costs.step_s) and costs.at(1) == costs.step_s[0]
