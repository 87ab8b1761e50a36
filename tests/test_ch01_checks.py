"""Chapter 01's checks (minserve.lab.contract_checks) pass where the property holds and fail where it is gone.

The engine checks run on minserve-tiny, then on an engine without the property: one seat
(``max_num_seqs=1``), a token budget too small to prefill everyone in one step, deadlines ignored. The
checks that compare timings are fed exact, made-up numbers instead (a prediction off by 2×, a step cost
that grows with the batch, a throughput that did not move), so no test depends on this machine's speed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from minserve import LLM, SamplingParams, slo
from minserve.engine.core import EngineCore
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.sampling_params import MIN_TIMEOUT_S
from minserve.lab import contract, contract_checks

PROMPTS = ["def fibonacci(n):", "class Stack:\n", "import os\n", "for line in open(path):"]
LENGTHS = [6, 2, 5, 1, 4, 3]  # not sorted: one at a time, a long one finishes before a short one


def _params(lengths: list[int] = LENGTHS) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]


def _serve(llm: LLM, lengths: list[int] = LENGTHS) -> list[slo.RequestRecord]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    return slo.records_from_outputs(llm.generate(prompts, _params(lengths)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while these tests run, as the chapter runs: on a shared two-core machine two threads
    that wait for each other make a few tiny steps take seconds. The setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM()  # loaded once: every test that needs the plain engine shares it


@pytest.fixture(scope="module")
def batched(tiny) -> list[slo.RequestRecord]:
    return _serve(tiny)


@pytest.fixture(scope="module")
def serial() -> list[slo.RequestRecord]:
    return _serve(LLM(max_num_seqs=1))


# --- the prediction: exact made-up timings ----------------------------------------------------------------------


def _step_grows(b: int) -> float:
    return 0.010 + 0.005 * b  # seconds: a step that costs more the more sequences share it


def _lockstep_records(
    lengths: list[int], ttft_s: float = 0.050, step: Callable[[int], float] = _step_grows
) -> list[slo.RequestRecord]:
    """What an engine that batches does: one shared first step, then each step costs ``step(batch)`` seconds."""
    token_times = [ttft_s]
    for b in contract.decode_occupancy(lengths):
        token_times.append(token_times[-1] + step(b))
    return [slo.RequestRecord(0.0, token_times[:n], request_id=str(i)) for i, n in enumerate(lengths)]


COSTS = contract.StepCosts((1, 8), (_step_grows(1), _step_grows(8)))  # linear, so interpolation is exact


def test_decode_occupancy_counts_who_is_still_decoding():
    assert contract.decode_occupancy([1, 3, 2]) == [2, 1]
    assert contract.decode_occupancy([4, 4]) == [2, 2, 2]
    assert contract.decode_occupancy([1]) == []


def test_prediction_holds_when_the_step_cost_is_the_one_measured():
    table = contract.prediction_table(_lockstep_records(LENGTHS), COSTS)
    assert table["measured / predicted"].tolist() == pytest.approx([1.0] * len(LENGTHS))
    assert "100% of 5 requests" in contract_checks.check_e2e_prediction(table, margin=0.3)


def test_the_median_of_three_runs_is_not_moved_by_one_slowed_run():
    slowed = _lockstep_records(LENGTHS, step=lambda b: 1.6 * _step_grows(b))  # another process took the CPU
    runs = [_lockstep_records(LENGTHS), slowed, _lockstep_records(LENGTHS)]
    table = contract.median_prediction_table(runs, COSTS)
    assert table["measured / predicted"].tolist() == pytest.approx([1.0] * len(LENGTHS))
    assert list(table.columns) == list(contract.prediction_table(runs[0], COSTS).columns)
    assert "100% of 5" in contract_checks.check_e2e_prediction(table, margin=0.3)
    both_slowed = contract.median_prediction_table([runs[0], slowed, slowed], COSTS)
    with pytest.raises(AssertionError, match="within"):  # the claim still fails when most runs miss it
        contract_checks.check_e2e_prediction(both_slowed, margin=0.3)


def test_prediction_fails_when_off_by_two():
    doubled = contract.StepCosts(COSTS.batch_sizes, tuple(2 * s for s in COSTS.step_s))
    lengths = [40, 30, 20, 10, 35, 25]  # long enough that the steps, not the TTFT, make up the E2E
    table = contract.prediction_table(_lockstep_records(lengths), doubled)
    with pytest.raises(AssertionError, match="within"):
        contract_checks.check_e2e_prediction(table, margin=0.3)


def test_prediction_fails_when_the_step_cost_is_taken_as_one_sequences():
    # Every step priced as a one-sequence step: the batch's cost is left out, and the check notices.
    flat = contract.StepCosts((1, 8), (_step_grows(1), _step_grows(1)))
    lengths = [40, 38, 36, 34, 32, 30, 28, 26]
    table = contract.prediction_table(_lockstep_records(lengths), flat)
    with pytest.raises(AssertionError, match="within"):
        contract_checks.check_e2e_prediction(table, margin=0.3)


# --- one shared first step, and the finish order -----------------------------------------------------------------


def test_shared_first_step_holds_on_the_engine(batched):
    assert contract_checks.ttft_spread_s(batched) == 0.0  # every first token came out of the same step
    contract_checks.check_shared_first_step(batched, step_s=1e-4)


def test_shared_first_step_fails_with_one_seat(serial):
    step_s = min(gap for r in serial for gap in r.itl_s)  # the fastest step there was: the test is generous
    with pytest.raises(AssertionError, match="not all prefilled in the first step"):
        contract_checks.check_shared_first_step(serial, step_s=step_s)


def test_shared_first_step_fails_when_the_token_budget_splits_the_prefill():
    llm = LLM(max_num_batched_tokens=8, enable_chunked_prefill=False)  # a prompt or two per step, not six
    records = _serve(llm)
    step_s = min(gap for r in records for gap in r.itl_s)
    with pytest.raises(AssertionError, match="TTFT spread"):
        contract_checks.check_shared_first_step(records, step_s=step_s)


def test_finish_order_follows_length_on_the_engine(batched):
    assert "6 tokens" in contract_checks.check_finish_order(batched)


def test_finish_order_fails_with_one_seat(serial):
    with pytest.raises(AssertionError, match="shorter answer did not finish first"):
        contract_checks.check_finish_order(serial)


# --- batching pays ---------------------------------------------------------------------------------------------

CHAT = slo.SLO("chat", ttft_s=0.25, tpot_s=0.06)


def _queued_records(lengths: list[int], step_s: float = 0.01) -> list[slo.RequestRecord]:
    """What a one-seat engine does: each request starts when the one in front of it has finished."""
    records, start = [], 0.0
    for i, n in enumerate(lengths):
        times = [start + step_s * (k + 1) for k in range(n)]
        records.append(slo.RequestRecord(0.0, times, request_id=str(i)))
        start = times[-1]
    return records


def test_batching_pays_on_lockstep_against_queued_numbers():
    lengths = [40, 30, 20, 10, 35, 25, 15, 5]
    together = _lockstep_records(lengths, step=lambda b: 0.010 + 0.001 * b)  # a step mostly fixed in cost
    result = contract_checks.check_batching_pays(together, _queued_records(lengths, step_s=0.011), CHAT)
    assert "× the tokens/s" in result


def test_batching_pays_fails_when_the_engine_has_one_seat(serial):
    with pytest.raises(AssertionError, match="tokens/s together"):
        contract_checks.check_batching_pays(serial, serial, CHAT)  # "together" served by one seat: no gain


# --- deadlines: real failures -----------------------------------------------------------------------------------


def _with_deadlines(llm: LLM) -> tuple[list[RequestOutput], list[float | None]]:
    # The shortest deadline a request may carry (1 ms): it passes before the requests' many tokens can be made.
    deadlines = [None, MIN_TIMEOUT_S, None, None, MIN_TIMEOUT_S, None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(LENGTHS))]
    return llm.generate(prompts, _params(), deadline_s=deadlines), deadlines


def test_deadline_failures_hold_on_the_engine(tiny):
    outputs, deadlines = _with_deadlines(tiny)
    assert "availability 0.667" in contract_checks.check_deadline_failures(outputs, deadlines, LENGTHS)
    assert [r.status for r in contract.records_with_status(outputs)].count("failed") == 2


def test_deadline_failures_fail_when_the_engine_ignores_deadlines(tiny, monkeypatch):
    monkeypatch.setattr(EngineCore, "_expire_deadlines", lambda self, now_s: [])
    outputs, deadlines = _with_deadlines(tiny)
    with pytest.raises(AssertionError, match="had a deadline"):
        contract_checks.check_deadline_failures(outputs, deadlines, LENGTHS)


# --- the real model's checks, on made-up outputs -----------------------------------------------------------------


def _output(text: str, finish_reason: str) -> RequestOutput:
    return RequestOutput("0", None, [1], text, [2, 3], finish_reason, RequestMetrics(0.0, [0.1, 0.2], 0.2))


def test_chat_reply_check():
    assert "Paris" in contract_checks.check_chat_reply(_output("The capital is Paris.", "stop"), "Paris")
    with pytest.raises(AssertionError, match="end of turn"):
        contract_checks.check_chat_reply(_output("The capital is Paris, and", "length"), "Paris")
    with pytest.raises(AssertionError, match="not in the reply"):
        contract_checks.check_chat_reply(_output("The capital is Lyon.", "stop"), "Paris")


def test_batching_gain_fails_without_a_gain():
    alone = _queued_records([10])
    assert "×" in contract_checks.check_batching_gain(alone, _lockstep_records([10] * 4, ttft_s=0.01))
    with pytest.raises(AssertionError, match="together"):
        contract_checks.check_batching_gain(alone, _queued_records([10] * 4))  # one sequence per step


# --- the measurement helpers ------------------------------------------------------------------------------------


def test_measure_decode_steps_reports_each_batch_size(tiny):
    costs = contract.measure_decode_steps(tiny, PROMPTS[0], batch_sizes=(1, 4), tokens=4)
    assert costs.batch_sizes == (1, 4) and all(s > 0 for s in costs.step_s)
    assert list(costs.table().index) == [1, 4]


def test_step_costs_are_measured_beside_each_run(tiny):
    """Each run follows its own round of step measurements: the costs come from the runs' minute."""
    steps_before_each_run: list[int] = []
    reports: list = []
    tiny.engine.core.observers.append(reports.append)
    try:
        costs, results = contract.repeat_beside_step_costs(
            tiny, PROMPTS[0], lambda: steps_before_each_run.append(len(reports)) or "ran",
            batch_sizes=(1, 2), tokens=3, rounds=2,
        )  # fmt: skip
    finally:
        tiny.engine.core.observers.remove(reports.append)
    assert results == ["ran", "ran"] and costs.batch_sizes == (1, 2)
    first, second = steps_before_each_run
    assert 0 < first < second < len(reports) + 1 and second >= 2 * first  # a full round before each run


def test_measure_decode_steps_refuses_a_batch_the_engine_cannot_hold():
    with pytest.raises(ValueError, match="no decode step of 4 sequences"):
        contract.measure_decode_steps(LLM(max_num_seqs=2), PROMPTS[0], batch_sizes=(4,), tokens=3)


def test_reading_speed_and_shared_prefix_arithmetic():
    table = contract.reading_speed_table(words_per_s=(5.0,), tokens_per_word=2.0)
    assert table.loc[5.0, "tokens/s"] == 10.0 and table.loc[5.0, "TPOT bound ms"] == pytest.approx(100.0)
    from minserve.bench.workload import LengthDist, WorkloadSpec, build_requests

    spec = WorkloadSpec(8, LengthDist("fixed", 64), shared_prefix_fraction=1.0, shared_prefix_len=16)
    summary = contract.shared_prefix_summary(build_requests(spec), 16)
    assert summary["sharing the prefix"] == 8 and summary["repeated prefix tokens"] == 7 * 16
