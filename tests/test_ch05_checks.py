"""Chapter 05's checks (minserve.lab.scheduling_checks, minserve.lab.cancellation) pass on the engine and fail
where the property is gone: one sequence per step, chunking off, memory to spare, FCFS for priority, no
deadline, a cancel that is never processed, or deliberately broken numbers.

The engine runs use minserve-tiny on tiny configurations; the claims tested are about steps, tokens and
blocks. The two wall-clock claims of the checks (the stall's ITL ratio, a deadline met within a step) are
given margins far wider than this machine's noise, and the stall's prediction is tested on numbers made here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from minserve import LLM
from minserve.capacity.cost_model import StepCostModel
from minserve.capacity.simulator import SchedulerConfig
from minserve.engine.core import EngineCore
from minserve.lab import (
    cancellation,
    engine_runs,
    scheduling,
    scheduling_checks,
    scheduling_steps,
    simulation_figures,
)
from minserve.lab.playground import Playground, playground_result


def _engine(**options) -> LLM:
    return LLM(device="cpu", num_threads=1, **options)


@pytest.fixture(scope="module")
def vocab() -> int:
    return _engine(num_kv_blocks=8).model_config.vocab_size


# --- static against continuous batching ---------------------------------------------------------------------

OUTPUTS = [2, 2, 2, 20] * 4  # skewed: each batch of four waits for its one long request
SEATS = 4
PREDICTED_STATIC = 4 * 20
BOUND = max(-(-sum(OUTPUTS) // SEATS), max(OUTPUTS))


def _batching(vocab: int, continuous_seats: int, continuous_policy: str = "fcfs"):
    requests = engine_runs.requests_with_prompts([8] * len(OUTPUTS), OUTPUTS, vocab, seed=1)
    runs = {}
    for label, policy, seats in (("static", "static", SEATS), ("continuous", continuous_policy, continuous_seats)):
        llm = _engine(scheduling_policy=policy, max_num_seqs=seats, num_kv_blocks=64)
        runs[label] = engine_runs.run_engine(llm, requests, at_steps=[0] * len(requests))
    return runs


def test_batching_check_holds_on_the_engine(vocab):
    runs = _batching(vocab, SEATS)
    result = scheduling_checks.check_batching(runs["static"], runs["continuous"], PREDICTED_STATIC, BOUND)
    assert result["static_steps"] == PREDICTED_STATIC and result["continuous_steps"] < PREDICTED_STATIC / 1.5
    fig = scheduling.occupancy_figure(
        {"static": runs["static"], "continuous": runs["continuous"]},
        predicted_steps={"static": {"predicted": PREDICTED_STATIC}, "continuous": {"bound": BOUND}},
    )
    lines = [shape for shape in fig.layout.shapes if shape.type == "line"]
    assert sorted(line.x0 for line in lines) == [BOUND + 0.5, PREDICTED_STATIC + 0.5]


def test_batching_check_fails_with_one_sequence_per_step(vocab):
    runs = _batching(vocab, continuous_seats=1)
    assert len(runs["continuous"].steps) == sum(OUTPUTS)  # one sequence per step: a step per token
    with pytest.raises(AssertionError, match="continuous batching took"):
        scheduling_checks.check_batching(runs["static"], runs["continuous"], PREDICTED_STATIC, BOUND)


def test_batching_check_fails_when_static_is_not_static(vocab):
    runs = _batching(vocab, SEATS)
    with pytest.raises(AssertionError, match="static batching took"):
        scheduling_checks.check_batching(runs["continuous"], runs["continuous"], PREDICTED_STATIC, BOUND)


# --- chunked prefill and the stall ------------------------------------------------------------------------------

BUDGET, LONG = 32, 600
DECODERS = ["0", "1"]


def _chunk_runs(vocab: int, chunked_first: bool = True) -> dict[str, engine_runs.EngineRun]:
    requests = engine_runs.requests_with_prompts([12, 14, LONG], [30, 30, 2], vocab, seed=2)
    runs = {}
    for label, chunked in (("chunked", chunked_first), ("whole prompt", False)):
        llm = _engine(enable_chunked_prefill=chunked, max_num_batched_tokens=BUDGET, max_num_seqs=4, num_kv_blocks=64)
        runs[label] = engine_runs.run_engine(llm, requests, at_steps=[0, 0, 4])
    return runs


@pytest.fixture(scope="module")
def chunk_runs(vocab):
    return _chunk_runs(vocab)


def test_chunked_prefill_check_holds_on_the_engine(chunk_runs):
    result = scheduling_checks.check_chunked_prefill(
        chunk_runs["chunked"], chunk_runs["whole prompt"], DECODERS, BUDGET, LONG
    )
    assert result["largest_step_tokens"] == {"chunked": BUDGET, "whole": LONG + 2}


def test_chunked_prefill_check_fails_with_chunking_off(vocab):
    runs = _chunk_runs(vocab, chunked_first=False)
    with pytest.raises(AssertionError, match="chunked: the largest step"):
        scheduling_checks.check_chunked_prefill(runs["chunked"], runs["whole prompt"], DECODERS, BUDGET, LONG)


def test_step_features_rebuild_what_each_step_ran(chunk_runs):
    whole, chunked = chunk_runs["whole prompt"], chunk_runs["chunked"]
    pairs = {label: sum(f.prefill_attention_pairs for f in scheduling_checks.step_features(run).values())
             for label, run in chunk_runs.items()}  # fmt: skip
    # Causal attention over a prompt is n(n + 1) / 2 query-key pairs, however it is chunked.
    short = 12 * 13 // 2 + 14 * 15 // 2
    assert pairs["whole prompt"] == pairs["chunked"] == short + LONG * (LONG + 1) // 2
    per_token = StepCostModel({"prefill_tokens": 1e-3, "decode_seqs": 1e-3})  # 1 ms a token
    predicted = scheduling_checks.predicted_step_ms(whole, per_token)
    stall_step = int(whole.steps.loc[whole.steps["tokens"].idxmax(), "step"])
    assert predicted[stall_step] == pytest.approx(LONG + 2)
    assert scheduling_checks.predicted_step_ms(chunked, per_token).max() == pytest.approx(BUDGET)
    table = scheduling_checks.stall_table(chunk_runs, per_token, DECODERS)
    assert table.loc["whole prompt", "largest step tokens"] == LONG + 2
    assert table.loc["chunked", "predicted ms"] == pytest.approx(BUDGET)
    fig = simulation_figures.step_time_figure(chunk_runs, {k: scheduling_checks.predicted_step_ms(r, per_token)
                                                          for k, r in chunk_runs.items()})  # fmt: skip
    assert len(fig.data) == 4


def _stall(predicted_unchunked: float, predicted_chunked: float = 5.0, measured: float = 100.0) -> pd.DataFrame:
    return pd.DataFrame(
        {"predicted ms": [predicted_unchunked, predicted_chunked], "measured step ms": [measured, 10.0]},
        index=["whole prompt", "chunked"],
    ).assign(**{"predicted / measured": lambda t: t["predicted ms"] / t["measured step ms"]})


def test_stall_prediction_check_on_numbers():
    assert scheduling_checks.check_stall_prediction(_stall(120.0), "whole prompt", "chunked")["predicted_over_measured"]
    # A cost model that leaves out prompt tokens predicts a decode step for the stall: far too short.
    with pytest.raises(AssertionError, match="predicted stall"):
        scheduling_checks.check_stall_prediction(_stall(8.0), "whole prompt", "chunked")
    with pytest.raises(AssertionError, match="predicted stall"):
        scheduling_checks.check_stall_prediction(_stall(500.0), "whole prompt", "chunked")
    # Chunking off in the 'chunked' run: the cost model predicts the same stall for both.
    with pytest.raises(AssertionError, match="predicted largest step"):
        scheduling_checks.check_stall_prediction(_stall(120.0, 120.0), "whole prompt", "chunked")


# --- preemption -------------------------------------------------------------------------------------------------


def _preemption(vocab: int, tight_blocks: int):
    requests = engine_runs.requests_with_prompts([20, 24, 28, 22], 24, vocab, seed=3)
    runs, engines = {}, {}
    for label, blocks, mode in (("ample memory", 128, "recompute"), ("recompute", tight_blocks, "recompute"),
                                ("swap", tight_blocks, "swap")):  # fmt: skip
        engines[label] = _engine(block_size=8, max_num_seqs=4, num_kv_blocks=blocks, preemption_mode=mode)
        runs[label] = engine_runs.run_engine(engines[label], requests, at_steps=[0] * 4)
    return runs, engines


def test_preemption_check_holds_under_a_tiny_kv_budget(vocab):
    counts = scheduling_checks.check_preemption(*_preemption(vocab, tight_blocks=10))
    assert counts["recompute"] > 0 and counts["swap"] > 0


def test_preemption_check_fails_with_memory_to_spare(vocab):
    with pytest.raises(AssertionError, match="no preemption"):
        scheduling_checks.check_preemption(*_preemption(vocab, tight_blocks=128))


# --- priorities and deadlines -------------------------------------------------------------------------------


DEADLINE_S = 0.02  # the last background request starts after 3 rounds of 16 steps: far later than this


def _priority_runs(vocab: int, priority_policy: str = "priority", deadline_s: float | None = DEADLINE_S):
    background = engine_runs.requests_with_prompts(list(range(20, 36, 2)), 16, vocab, seed=4, priorities=[1] * 8,
                                                   deadlines_s=[None] * 7 + [deadline_s], prefix="b")  # fmt: skip
    urgent = engine_runs.requests_with_prompts([24, 24], 4, vocab, seed=5, priorities=[0, 0], prefix="u")
    runs = {}
    for label, policy in (("fcfs", "fcfs"), ("priority", priority_policy)):
        llm = _engine(scheduling_policy=policy, max_num_seqs=2, num_kv_blocks=128)
        runs[label] = engine_runs.run_engine(llm, background + urgent, at_steps=[0] * 8 + [3] * 2)
    return runs


def _check_priorities(runs):
    return scheduling_checks.check_priorities(
        runs["fcfs"], runs["priority"], ["u0", "u1"], "b7", DEADLINE_S, first_round=["b0", "b1"], last_round=["b6"]
    )


def test_priority_check_holds_on_the_engine(vocab):
    result = _check_priorities(_priority_runs(vocab))
    assert result["urgent_ttft_steps"]["priority"] < result["urgent_ttft_steps"]["fcfs"]


def test_priority_check_fails_when_priority_is_fcfs(vocab):
    with pytest.raises(AssertionError, match="urgent TTFT"):
        _check_priorities(_priority_runs(vocab, priority_policy="fcfs"))


def test_priority_check_fails_without_the_deadline(vocab):
    with pytest.raises(AssertionError, match="b7 was not stopped"):
        _check_priorities(_priority_runs(vocab, deadline_s=None))


# --- cancellation ---------------------------------------------------------------------------------------------


def _cancel(vocab: int):
    requests = engine_runs.requests_with_prompts([20, 24, 28, 32, 26], 12, vocab, seed=6)
    reference = engine_runs.run_engine(_engine(max_num_seqs=4, num_kv_blocks=64), requests, at_steps=[0] * 5)
    cancelled = cancellation.run_with_cancel(_engine(max_num_seqs=4, num_kv_blocks=64), requests, "1", 4)
    return cancelled, reference


def test_cancellation_check_holds_on_the_engine(vocab):
    cancelled, reference = _cancel(vocab)
    result = cancellation.check_cancellation(cancelled, reference)
    assert result["blocks_handed_back"] == 2  # after 4 steps: 24 prompt + 3 output tokens computed, ⌈27 / 16⌉
    assert result["seat_taken_by"] == "4" and result["ran_at_step"] == 5 and result["without_cancel"] == 13


def test_cancellation_check_fails_when_the_engine_drops_the_cancel(vocab, monkeypatch):
    monkeypatch.setattr(EngineCore, "abort", lambda self, request_id: None)  # the cancel never reaches the core
    cancelled, reference = _cancel(vocab)
    with pytest.raises(AssertionError, match="not 'cancelled'"):
        cancellation.check_cancellation(cancelled, reference)


def test_cancellation_check_fails_on_a_leaked_block(vocab):
    cancelled, reference = _cancel(vocab)
    blocks = cancelled.blocks.copy()
    blocks.loc[blocks["step"] == 5, "used_blocks"] += 2  # the victim's blocks never came back
    leaky = cancellation.CancelledRun(cancelled.run, cancelled.cancelled_id, cancelled.cancel_after_step, blocks)
    with pytest.raises(AssertionError, match="blocks are in use"):
        cancellation.check_cancellation(leaky, reference)


# --- the step is shared ---------------------------------------------------------------------------------------


def _points(*steps_ms: tuple[int, float]) -> list[SimpleNamespace]:
    return [SimpleNamespace(batch=batch, step_s=ms / 1e3) for batch, ms in steps_ms]


def test_step_shared_holds_on_the_tiny_engine():
    llm = _engine(max_num_seqs=8, num_kv_blocks=64, max_model_len=256)
    points = scheduling_steps.shared_step_points(llm, batch=8, context_tokens=16, steps=8)
    result = scheduling_checks.check_step_shared(points, at_most=3.0)
    assert result["batch 8: ms per token"] < result["batch 1: ms per token"]
    table = scheduling_steps.shared_step_table(points)
    assert list(table.index) == [1, 8] and table.loc[8, "ms per token"] == pytest.approx(table.loc[8, "step ms"] / 8)


def test_step_shared_fails_when_the_batch_runs_one_sequence_after_another():
    assert scheduling_checks.check_step_shared(_points((1, 10.0), (8, 12.0)), at_most=2.0)["batch 8: step ms"] == 12
    with pytest.raises(AssertionError, match="a step of 8 sequences took 8.00 × a step of one"):
        scheduling_checks.check_step_shared(_points((1, 10.0), (8, 80.0)), at_most=2.0)
    with pytest.raises(AssertionError, match="need batch 1 and a larger batch"):
        scheduling_checks.check_step_shared(_points((8, 12.0)))


# --- the simulator, the sweep, aging, the playground ------------------------------------------------------------


def _summary(ttft_p50: float, tpot_p50: float) -> dict:
    return {"ttft_ms": {"p50": ttft_p50}, "tpot_ms": {"p50": tpot_p50}}


def test_simulator_agreement_check():
    ratios = scheduling_checks.check_simulator_agrees(_summary(40, 10), _summary(50, 9), within=2.5)
    assert ratios == {"ttft_ms": 1.25, "tpot_ms": 0.9}
    # A simulator whose cost model left out the prompt: TTFT predicted far too short.
    with pytest.raises(AssertionError, match=r"\{'ttft_ms': 0.1\}, not within ×2.5"):
        scheduling_checks.check_simulator_agrees(_summary(40, 10), _summary(4, 9), within=2.5)


def _sweep(spf_goodput: float, spf_long_ms: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"policy": "FCFS", "rate_rps": 13.0, "goodput_rps": 4.0, "ttft_long_max_ms": 9000.0},
            {"policy": "SPF, no aging", "rate_rps": 13.0, "goodput_rps": spf_goodput, "ttft_long_max_ms": spf_long_ms},
        ]
    )


def test_overload_order_check():
    result = scheduling_checks.check_overload_order(_sweep(8.0, 20000.0), 13.0, "SPF, no aging", "FCFS")
    assert result["SPF, no aging goodput"] == 8.0
    # Shortest-first that orders like FCFS: the same goodput, the same tail.
    with pytest.raises(AssertionError, match="req/s of goodput"):
        scheduling_checks.check_overload_order(_sweep(4.0, 9000.0), 13.0, "SPF, no aging", "FCFS")
    with pytest.raises(AssertionError, match="no price was paid"):
        scheduling_checks.check_overload_order(_sweep(8.0, 9000.0), 13.0, "SPF, no aging", "FCFS")
    with pytest.raises(AssertionError, match="no rows"):
        scheduling_checks.check_overload_order(_sweep(8.0, 20000.0), 6.0, "SPF, no aging", "FCFS")


def test_aging_check():
    first = {"aged": 4.0, "unaged": 11.0}
    assert scheduling_checks.check_aging(first, {"aged": 500, "unaged": 2000}, 10.0, "aged", "unaged", 380) == {
        "aged": 500,
        "unaged": 2000,
    }
    # Aging that does not age: the long prompt waits as long as without it.
    with pytest.raises(AssertionError, match="aged made the long prompt wait 2000 steps"):
        scheduling_checks.check_aging(first, {"aged": 2000, "unaged": 2000}, 10.0, "aged", "unaged", 380)
    with pytest.raises(AssertionError, match="over 2 × the aging bound"):
        scheduling_checks.check_aging(first, {"aged": 900, "unaged": 2000}, 10.0, "aged", "unaged", 380)
    with pytest.raises(AssertionError, match="it did not starve"):
        scheduling_checks.check_aging(
            {"aged": 4.0, "unaged": 9.0}, {"aged": 5, "unaged": 9}, 10.0, "aged", "unaged", 380
        )


def test_playground_chunking_check():
    cost = StepCostModel({"base": 2e-3, "prefill_tokens": 3e-4, "decode_seqs": 2e-4})
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=2048)
    playground = Playground(cost, config, num_requests=120)
    chunked = playground_result(playground, "fcfs", 6.0)
    unchunked = playground_result(playground, "fcfs", 6.0, chunked_prefill=False)
    result = scheduling_checks.check_playground_chunking(chunked, unchunked, 256, 768, itl_ratio=2.0)
    assert result["largest step, chunked"] <= 256 < 768 <= result["largest step, unchunked"]
    # A playground whose chunking switch does nothing.
    with pytest.raises(AssertionError, match="under a 768-token prompt"):
        scheduling_checks.check_playground_chunking(chunked, chunked, 256, 768, itl_ratio=2.0)


def test_busy_step_is_the_cost_of_full_seats_and_one_short_prompt():
    per_unit = StepCostModel({"prefill_tokens": 1e-3, "decode_seqs": 1e-3})  # 1 ms a prompt token or a decode
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=64)
    assert scheduling_steps.busy_step_s(per_unit, config, prompt_tokens=40) == pytest.approx(0.055)
