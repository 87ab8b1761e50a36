"""Chapter 10's check functions fail on broken numbers: a server that never saturates, one with a single slot,
a load tester that loses or mislabels failed requests, a server that mixes up its sequences' answers.

Each test builds the numbers a healthy server gives (shaped like what the chapter measures), sees the check
pass, then breaks one property and sees it fail. No server is started here.
"""

from __future__ import annotations

import pandas as pd
import pytest

from minserve import slo
from minserve.bench.arrivals import OpenLoop
from minserve.bench.client import RequestResult
from minserve.bench.metrics import summarize
from minserve.bench.report import record_rows
from minserve.bench.runner import RunResult
from minserve.capacity.queueing import predicted_ttft_ms
from minserve.lab import loadtest_checks as checks
from minserve.lab import loadtest_failures as failures

SLOTS, TURN_S = 4, 0.8  # four batch slots; one request occupies one for 0.8 s
CAPACITY = SLOTS / TURN_S  # λ* = 5 req/s


# --- the closed loop -------------------------------------------------------------------------------------------


def _closed(rates: dict[int, float], queue_ms: dict[int, float], in_flight: float = 0.95):
    """A Little's-law table and summaries for a closed-loop sweep: throughput per concurrency, W = C / λ."""
    table = pd.DataFrame(
        {
            "concurrency C": list(rates),
            "λ req/s": list(rates.values()),
            "W mean E2E s": [c / r for c, r in rates.items()],
            "λ·W": [in_flight * c for c in rates],
        }
    )
    summaries = [
        {"server": {"request_queue_time_seconds_sum": queue_ms[c] * 32 / 1e3, "request_queue_time_seconds_count": 32}}
        for c in rates
    ]
    return table, summaries


HEALTHY_RATES = {1: 1.35, 2: 2.6, 4: CAPACITY, 8: CAPACITY}
HEALTHY_QUEUE = {1: 5.0, 2: 8.0, 4: 20.0, 8: 700.0}


def test_closed_loop_check_passes_a_server_with_four_slots():
    assert checks.closed_loop_problems(*_closed(HEALTHY_RATES, HEALTHY_QUEUE), SLOTS) == []


def test_closed_loop_check_fails_a_server_with_one_slot():
    one_slot = {1: 1.35, 2: 1.35, 4: 1.35, 8: 1.35}  # max_num_seqs=1: more users buy nothing
    queue = {1: 5.0, 2: 700.0, 4: 2000.0, 8: 4500.0}
    problems = checks.closed_loop_problems(*_closed(one_slot, queue), SLOTS)
    assert any("4 users finish 1.00×" in p for p in problems)
    assert any("at 2 users the server queued" in p for p in problems)


def test_closed_loop_check_fails_a_server_that_never_saturates():
    many_slots = {1: 1.35, 2: 2.6, 4: CAPACITY, 8: 1.8 * CAPACITY}  # max_num_seqs=64: past 4, still scaling
    problems = checks.closed_loop_problems(*_closed(many_slots, {**HEALTHY_QUEUE, 8: 20.0}), SLOTS)
    assert any("throughput moved 1.80×" in p for p in problems)
    assert any("at 8 users the server queued" in p for p in problems)


def test_closed_loop_check_fails_a_client_that_keeps_fewer_in_flight():
    problems = checks.closed_loop_problems(*_closed(HEALTHY_RATES, HEALTHY_QUEUE, in_flight=0.5), SLOTS)
    assert len(problems) == 4 and all("λ·W" in p for p in problems)


def test_closed_loop_check_needs_the_sweep_around_the_slots():
    table, summaries = _closed({1: 1.0, 2: 2.0}, {1: 1.0, 2: 1.0})
    assert checks.closed_loop_problems(table, summaries, SLOTS) == ["the sweep needs concurrency [1, 4, 8], has [1, 2]"]


def test_closed_loop_check_fails_without_server_metrics():
    table, summaries = _closed(HEALTHY_RATES, HEALTHY_QUEUE)
    problems = checks.closed_loop_problems(table, [{} for _ in summaries], SLOTS)
    assert any("at 8 users the server queued nan ms" in p for p in problems)


# --- the knee --------------------------------------------------------------------------------------------------

FACTORS = (0.25, 0.5, 1, 2, 4)
N, BASE_TTFT_MS = 48, 40.0


def _sweep(achieved: list[float], ttft_scale: float = 1.0):
    """Summaries of an open-loop sweep at FACTORS × λ*, with TTFT p50 at ``ttft_scale`` × the fluid prediction."""
    offered = [f * CAPACITY for f in FACTORS]
    summaries = [
        {
            "label": f"rate={rate:g}",
            "request_throughput_rps": got,
            "ttft_ms": {"p50": ttft_scale * predicted_ttft_ms(rate, CAPACITY, N, BASE_TTFT_MS)},
        }
        for rate, got in zip(offered, achieved)
    ]
    return summaries, offered


def _knee(summaries, offered):
    return checks.knee_problems(summaries, offered, CAPACITY, N, BASE_TTFT_MS)


def test_knee_check_passes_a_saturating_curve():
    assert _knee(*_sweep([0.24 * CAPACITY, 0.47 * CAPACITY, 0.9 * CAPACITY, 0.97 * CAPACITY, 1.0 * CAPACITY])) == []


def test_knee_check_fails_a_curve_that_keeps_rising():
    rising = [f * CAPACITY for f in FACTORS]  # achieved = offered: no knee at λ*
    problems = _knee(*_sweep(rising))
    assert [p.split(":")[0] for p in problems] == ["rate=10", "rate=20"]


def test_knee_check_fails_a_server_that_collapses_past_the_knee():
    collapsing = [0.24 * CAPACITY, 0.47 * CAPACITY, 0.9 * CAPACITY, 0.5 * CAPACITY, 0.3 * CAPACITY]
    assert len(_knee(*_sweep(collapsing))) == 2


def test_knee_check_fails_a_server_that_cannot_keep_up_below_the_knee():
    slow = [0.1 * CAPACITY, 0.2 * CAPACITY, 0.9 * CAPACITY, CAPACITY, CAPACITY]
    assert [p.split(":")[0] for p in _knee(*_sweep(slow))] == ["rate=1.25", "rate=2.5"]


def test_knee_check_fails_when_latency_does_not_follow_the_queue():
    saturating = [0.24 * CAPACITY, 0.47 * CAPACITY, 0.9 * CAPACITY, CAPACITY, CAPACITY]
    flat = _sweep(saturating)
    for summary in flat[0]:
        summary["ttft_ms"]["p50"] = BASE_TTFT_MS  # no queue at all: the load tester measured something else
    problems = _knee(*flat)
    assert sum("predicted" in p for p in problems) == 2 and "grew only 1.0×" in problems[-1]
    assert sum("predicted" in p for p in _knee(*_sweep(saturating, ttft_scale=3.0))) == 2


def test_knee_check_says_when_the_machine_was_busy():
    summaries, offered = _sweep([0.24 * CAPACITY, 0.47 * CAPACITY, 0.9 * CAPACITY, 0.3 * CAPACITY, 0.4 * CAPACITY])
    for summary, tpot_ms in zip(summaries, (3.0, 3.0, 4.0, 12.0, 5.0)):
        summary["tpot_ms"] = {"p50": tpot_ms}
    problems = checks.knee_problems(summaries, offered, CAPACITY, N, BASE_TTFT_MS, capacity_tpot_ms=4.0)
    assert problems[0].startswith("the engine's decode steps ran 3.0× slower than when λ* was measured")
    assert len(problems) == 3  # and the two runs past the knee, out of the band
    summaries, offered = _sweep([0.24 * CAPACITY, 0.47 * CAPACITY, 0.9 * CAPACITY, CAPACITY, CAPACITY])
    assert checks.knee_problems(summaries, offered, CAPACITY, N, BASE_TTFT_MS, capacity_tpot_ms=4.0) == []


def test_knee_check_judges_each_run_at_the_speed_the_machine_ran_it():
    # Another process took CPU during the sweep: decode steps 1.7× slower than when λ* was measured, so the
    # saturated rate is λ* / 1.7. Against the unscaled λ* that looks like a collapse; at the sweep's own speed
    # it is the knee, exactly where it should be.
    slowed = [0.24 * CAPACITY, 0.47 * CAPACITY, 0.55 * CAPACITY, CAPACITY / 1.7, CAPACITY / 1.7]
    summaries, offered = _sweep(slowed)
    for summary in summaries:
        summary["tpot_ms"] = {"p50": 4.0 * 1.7}
    assert len(_knee(summaries, offered)) == 2  # without the closed loop's TPOT: both runs out of the band
    assert checks.knee_problems(summaries, offered, CAPACITY, N, BASE_TTFT_MS, capacity_tpot_ms=4.0) == []
    # A server that stops at half its capacity at an unchanged decode speed still fails.
    for summary in summaries:
        summary["tpot_ms"] = {"p50": 4.0}
    assert len(checks.knee_problems(summaries, offered, CAPACITY, N, BASE_TTFT_MS, capacity_tpot_ms=4.0)) == 2


def test_knee_check_says_when_the_machine_was_busy_while_capacity_was_measured():
    # λ* measured while another process held the CPU: the sweep's full batches step 3× faster, so the "knee"
    # at 2 λ* is not a knee at all. The check fails, and says why.
    summaries, offered = _sweep([f * CAPACITY for f in (0.25, 0.5, 1.0, 1.9, 1.6)])
    for summary in summaries:
        summary["tpot_ms"] = {"p50": 4.0 / 3}
    problems = checks.knee_problems(summaries, offered, CAPACITY, N, BASE_TTFT_MS, capacity_tpot_ms=4.0)
    assert problems[0].startswith("the engine's decode steps ran 3.0× faster than when λ* was measured")


def test_knee_check_needs_a_run_past_twice_the_capacity():
    summaries, offered = _sweep([0.24 * CAPACITY, 0.47 * CAPACITY, 0.9 * CAPACITY, CAPACITY, CAPACITY])
    assert "no run reached twice the capacity" in " ".join(_knee(summaries[:3], offered[:3]))


# --- injected failures -----------------------------------------------------------------------------------------

CHAT = slo.SLO("chat", ttft_s=1.0, tpot_s=0.2, availability=0.999)


def _request(index, status="ok", error=None, span_s=0.8, answered=True):
    """One request's record; ``answered=False``: no token arrived before it ended (a refusal, a queued timeout)."""
    sent = index * 0.1
    answered = answered and error != "http_429"
    times = [sent + 0.05 + 0.03 * k for k in range(int(span_s / 0.03) - 2)] if answered else []
    return RequestResult(index, sent, sent, times, sent + span_s, status, error, output_tokens=len(times),
                         prompt_tokens=10, output_tokens_source="usage", text="x" * len(times))  # fmt: skip


def _failure_run(refused=6, timed_out=0, timeout_s=10.0, mid_answer=0):
    """20 requests: ``refused`` 429s, ``timed_out`` timeouts (the first ``mid_answer`` of them after some tokens,
    the rest while queued), the others ok; the server's counters agree, every timeout aborted."""
    results = [_request(i) for i in range(20 - refused - timed_out)]
    results += [_request(len(results) + i, "failed", "http_429", 0.004) for i in range(refused)]
    results += [_request(len(results) + i, "failed", "timeout", timeout_s + 0.01, answered=i < mid_answer)
                for i in range(timed_out)]  # fmt: skip
    run = RunResult("rate=15", OpenLoop(15.0), results, max(r.end_s for r in results), 0.1)
    summary = summarize(run, CHAT)
    ok = summary["ok"]
    summary["server"] = {
        'request_success_total{finished_reason="length"}': float(ok),
        'request_success_total{finished_reason="abort"}': float(timed_out),
        'requests_rejected_total{reason="queue_full"}': float(refused),
    }
    return summary, record_rows([run])


def test_failure_check_passes_an_honest_count():
    summary, rows = _failure_run(refused=6, timed_out=3)
    assert failures.failure_problems(summary, rows, sent=20) == []
    assert failures.refusal_problems(rows) == []
    assert failures.timeout_problems(rows, 10.0) == []
    table = failures.failure_table([summary])
    assert table.loc["rate=15", "client http_429"] == 6 and table.loc["rate=15", "server refused"] == 6
    assert table.loc["rate=15", "availability"] == pytest.approx(11 / 20) and table.loc["rate=15", "verdict"] == "FAIL"


def test_failure_check_fails_a_load_tester_that_drops_failed_requests():
    summary, rows = _failure_run(refused=6)
    kept = [row for row in rows if row["status"] == "ok"]  # the 429s never reached the records
    dropped = summarize(RunResult("rate=15", OpenLoop(15.0), [_request(r["index"]) for r in kept], 3.0), CHAT)
    dropped["server"] = summary["server"]
    problems = failures.failure_problems(dropped, kept, sent=20)
    assert problems[0] == "20 sent, 14 records, 14 in the summary"
    assert "client saw 0 429s, the server refused 6" in problems
    assert "availability 1.000, but 14 of 20 were ok" in problems


def test_failure_check_fails_a_load_tester_that_counts_429_as_ok():
    summary, rows = _failure_run(refused=6)
    mislabelled = {**summary, "ok": 20, "failed": 0, "errors": {}}
    problems = failures.failure_problems(mislabelled, rows, sent=20)
    assert "client saw 0 429s, the server refused 6" in problems
    assert "client: 20 ok and 0 given up on; server: 14 completed and 0 aborted" in problems


def _finished(summary, completed, aborted):
    """``summary`` with the server's counters saying ``completed`` requests finished and ``aborted`` were aborted."""
    return {**summary, "server": {**summary["server"], 'request_success_total{finished_reason="length"}': completed,
                                  'request_success_total{finished_reason="abort"}': aborted}}  # fmt: skip


def test_failure_check_fails_a_server_that_works_on_for_clients_gone():
    summary, rows = _failure_run(refused=0, timed_out=4, mid_answer=1)
    assert failures.failure_problems(_finished(summary, 20.0, 0.0), rows, sent=20) == [
        "the server completed 20 and aborted 0; the client had 16 ok and gave up on 4, 3 of them before their "
        "first token"
    ]
    lost = _finished(summary, 16.0, 0.0)  # neither completed nor aborted: the server lost track of them
    assert failures.failure_problems(lost, rows, sent=20) == [
        "client: 16 ok and 4 given up on; server: 16 completed and 0 aborted",
        "the server completed 16 and aborted 0; the client had 16 ok and gave up on 4, 3 of them before their "
        "first token",
    ]
    # The one given up on mid-answer finished as its client's timer ran out: a race, not a fault.
    assert failures.failure_problems(_finished(summary, 17.0, 3.0), rows, sent=20) == []
    # One of those given up on while queued was completed for a client long gone.
    assert "3 of them before their first token" in failures.failure_problems(_finished(summary, 18.0, 2.0), rows,
                                                                             sent=20)[0]  # fmt: skip


def test_failure_check_fails_failures_without_a_kind_and_a_passing_verdict():
    summary, rows = _failure_run(refused=2)
    unnamed = {**summary, "errors": {}, "verdict": {**summary["verdict"], "passed": True}}
    problems = failures.failure_problems(unnamed, rows, sent=20)
    assert "2 failed but 0 with a kind: {}" in problems and "requests failed and the verdict still passed" in problems


def test_refusal_check_fails_without_refusals_or_with_slow_ones():
    _, rows = _failure_run(refused=0)
    assert failures.refusal_problems(rows) == [
        "no request was refused: the queue limit was never reached (or 429s went uncounted)"
    ]
    _, rows = _failure_run(refused=3)
    slow = [{**row, "end_s": row["sent_s"] + 0.5} if row["error"] == "http_429" else row for row in rows]
    assert "the median 429 took 500 ms" in failures.refusal_problems(slow)[0]


def test_timeout_check_fails_a_timeout_that_is_not_enforced():
    _, rows = _failure_run(refused=0, timed_out=0)
    problems = failures.timeout_problems(rows, 0.2)
    assert problems[0] == "no request timed out" and "ok requests took longer than the 0.2 s timeout" in problems[1]
    _, rows = _failure_run(refused=0, timed_out=2, timeout_s=3.0)
    assert "2 timed out away from 1.0 s" in failures.timeout_problems(rows, 1.0)[0]
    _, rows = _failure_run(refused=0, timed_out=2, mid_answer=2)  # no queued request's abort was tried
    assert failures.timeout_problems(rows, 10.0) == ["no request timed out before its first token: every timeout "
                                                     "came mid-answer"]  # fmt: skip


# --- output quality --------------------------------------------------------------------------------------------


def _served(texts):
    return [{"index": i, "status": "ok", "output_tokens": 8, "text": t} for i, t in enumerate(texts)]


def test_quality_check_passes_identical_answers_and_fails_mixed_up_ones():
    offline = [f"def f{i}(x):\n    return x + {i}" for i in range(20)]
    agreement = failures.output_agreement([*_served(offline), {"index": 99, "status": "failed"}], offline)
    assert agreement["equal"].all() and (agreement["first difference"] == -1).all()
    assert failures.quality_problems(agreement) == []
    swapped = offline[1:] + offline[:1]  # a server that hands each request another one's answer
    mixed = failures.output_agreement(_served(swapped), offline)
    assert not mixed["equal"].any() and mixed.loc[0, "first difference"] == 5
    assert failures.quality_problems(mixed) == ["only 0% of the served answers equal the offline engine's (need 95%)"]
    drifted = failures.output_agreement(_served([t[:-1] + "?" for t in offline[:2]] + offline[2:]), offline)
    assert failures.quality_problems(drifted) == [
        "only 90% of the served answers equal the offline engine's (need 95%)"
    ]
    assert failures.quality_problems(failures.output_agreement([], [])) == ["no ok answer to compare"]
    with pytest.raises(ValueError, match="2 ok rows but 1 offline texts"):
        failures.output_agreement(_served(offline[:2]), offline[:1])


def test_quality_threshold_is_passed_from_the_cell():
    offline = [f"x{i}" for i in range(20)]
    drifted = failures.output_agreement(_served(["?", *offline[1:]]), offline)  # 19 of 20 equal
    assert failures.check_answers_agree(drifted, at_least=0.95) == 0.95
    with pytest.raises(AssertionError, match="need 100%"):  # a batch-invariant engine would be held to all of them
        failures.check_answers_agree(drifted, at_least=1.0)


# --- coordinated omission ----------------------------------------------------------------------------------------


def _omission_rows(workers: int | None, stamp_late_sends_as_intended: bool = False):
    """Rows for 24 requests arriving at 3 λ* (every 1/15 s) at a server with SLOTS slots of TURN_S each.

    ``workers=None``: an open-loop client, sending on time, so the queue is in the server. ``workers=k``: a
    closed loop of k workers walking the same timetable, so a request leaves only when a worker is free and
    never waits in the server. ``stamp_late_sends_as_intended``: that closed loop, writing its late send as
    the intended one (what a load tester that hides the omission from its own records does).
    """
    intended = [i / (3 * CAPACITY) for i in range(24)]
    free = [0.0] * (workers or SLOTS)  # when each worker (or, open loop, each server slot) is next free
    rows = []
    for i, t in enumerate(intended):
        k = min(range(len(free)), key=free.__getitem__)
        sent = max(t, free[k]) if workers else t
        start = max(sent, free[k])
        free[k] = start + TURN_S
        chunks = [start + 0.05 + 0.03 * j for j in range(20)]
        rows.append({"run": "open loop" if workers is None else "closed loop", "index": i, "status": "ok",
                     "intended_s": sent if stamp_late_sends_as_intended else t, "sent_s": sent,
                     "chunk_times_s": chunks, "end_s": start + TURN_S, "output_tokens": 20})  # fmt: skip
    return rows


def _co_table(closed_rows):
    from minserve.lab import loadtest_tables as tables

    return tables.coordinated_omission_table([*_omission_rows(None), *closed_rows])


def test_sent_on_time_passes_an_open_loop_and_fails_a_closed_one():
    assert checks.check_sent_on_time(_omission_rows(None), max_lag_ms=50) == 0
    with pytest.raises(AssertionError, match="requests left over 50 ms late"):
        checks.check_sent_on_time(_omission_rows(SLOTS), max_lag_ms=50)


def test_omission_check_passes_when_the_wait_moved_into_the_client():
    medians = checks.check_omission_shown(
        _co_table(_omission_rows(SLOTS)), "open loop", "closed loop", hidden_at_least=1.5, moved_at_least=0.5
    )
    assert medians["closed intended"] >= medians["open"] > 1.5 * medians["closed actual"]


def test_omission_check_fails_a_closed_loop_that_hides_the_wait_in_its_records():
    hidden = _co_table(_omission_rows(SLOTS, stamp_late_sends_as_intended=True))
    with pytest.raises(AssertionError, match="its records hide the wait"):
        checks.check_omission_shown(hidden, "open loop", "closed loop", hidden_at_least=1.5, moved_at_least=0.5)


def test_omission_check_fails_when_nothing_queued():
    from minserve.lab import loadtest_tables as tables

    calm = [row | {"run": "closed loop"} for row in _omission_rows(None)[:SLOTS]]  # four requests: no queue
    table = tables.coordinated_omission_table([*_omission_rows(None)[:SLOTS], *calm])
    with pytest.raises(AssertionError, match="no omission to see"):
        checks.check_omission_shown(table, "open loop", "closed loop", hidden_at_least=1.5, moved_at_least=0.5)


# --- goodput recomputed from raw records ----------------------------------------------------------------------


def test_goodput_recomputed_agrees_with_the_load_tester_and_catches_a_wrong_summary():
    summary, rows = _failure_run(refused=6, timed_out=3)
    runs = {"rate=15": (rows, summary["duration_s"], summary["goodput_rps"])}
    recomputed = checks.check_goodput_recomputed(runs, ttft_s=CHAT.ttft_s, tpot_s=CHAT.tpot_s)
    assert recomputed["rate=15"] == pytest.approx(summary["ok"] / summary["duration_s"])
    # A summary that counted every request it sent as good (the 429s and timeouts included):
    inflated = {"rate=15": (rows, summary["duration_s"], 20 / summary["duration_s"])}
    with pytest.raises(AssertionError, match="reported"):
        checks.check_goodput_recomputed(inflated, ttft_s=CHAT.ttft_s, tpot_s=CHAT.tpot_s)
    # And one whose TPOT target the requests miss: the records say none was good.
    with pytest.raises(AssertionError, match="reported"):
        checks.check_goodput_recomputed(runs, ttft_s=CHAT.ttft_s, tpot_s=0.001)


# --- the other checks of the cell --------------------------------------------------------------------------------


def test_prompt_tokens_check_fails_a_load_tester_with_another_tokenizer():
    rows = [{"index": i, "prompt_tokens": 10 + i} for i in range(4)]
    checks.check_prompt_tokens(rows, [10, 11, 12, 13])
    with pytest.raises(AssertionError, match="differ"):
        checks.check_prompt_tokens(rows, [12, 14, 15, 17])  # counted in words, or by another tokenizer


def test_server_queue_check_fails_when_the_wait_is_not_in_the_server():
    knee = pd.DataFrame({"server queue ms": [2.0, 900.0], "TTFT p50": [40.0, 1200.0]})
    assert checks.check_wait_in_server_queue(knee, at_least=0.5) == 0.75
    knee.loc[1, "server queue ms"] = 30.0  # the wait was somewhere else: the client, or the network
    with pytest.raises(AssertionError, match="queued 30 ms"):
        checks.check_wait_in_server_queue(knee, at_least=0.5)


def test_prefix_hits_check_fails_without_a_cache():
    hits = pd.DataFrame({"hit rate": [0.02, 0.8], "TTFT p50": [90.0, 40.0]}, index=["plain", "shared"])
    checks.check_prefix_hits(hits, "shared", "plain", shared_at_least=0.7, unshared_at_most=0.1)
    no_cache = pd.DataFrame({"hit rate": [0.0, 0.0], "TTFT p50": [90.0, 88.0]}, index=["plain", "shared"])
    with pytest.raises(AssertionError, match="shared: hit rate 0.00"):
        checks.check_prefix_hits(no_cache, "shared", "plain", shared_at_least=0.7, unshared_at_most=0.1)


def _cancel_summary(aborted: int, kv: float = 0.0):
    server = {'request_success_total{finished_reason="abort"}': float(aborted), "kv_cache_usage_perc": kv,
              "num_requests_running": 0.0}  # fmt: skip
    return {"cancelled": 2, "server": server}


def test_cancellation_check_fails_a_server_that_keeps_working_for_clients_gone():
    rows = [{"status": "cancelled", "chunk_times_s": [0.1, 0.2, 0.3, 0.4]}] * 2 + [
        {"status": "ok", "chunk_times_s": []}
    ]
    assert checks.check_cancellations(_cancel_summary(2), rows, after_chunks=4) == 2
    with pytest.raises(AssertionError, match="server aborted 0"):
        checks.check_cancellations(_cancel_summary(0), rows, after_chunks=4)
    with pytest.raises(AssertionError, match="KV usage 0.25"):
        checks.check_cancellations(_cancel_summary(2, kv=0.25), rows, after_chunks=4)


def test_bundle_check_fails_a_bundle_that_lost_records_or_loads_from_the_network():
    groups = {"rate=1": [{}] * 48, "rate=2": [{}] * 48}
    checks.check_bundle_complete(groups, sent_per_run=48, report_html="<html><script>x</script></html>")
    with pytest.raises(AssertionError, match="records per run"):
        checks.check_bundle_complete(groups | {"rate=4": [{}] * 40}, 48, "<html></html>")
    with pytest.raises(AssertionError, match="network"):
        checks.check_bundle_complete(groups, 48, '<script src="https://cdn.plot.ly/plotly.js"></script>')
