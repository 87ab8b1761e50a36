"""Graded tests for chapter 09 (``minserve grade ch09``). Each test's docstring is the hint a learner sees.

The parts of the prediction are checked on hand-made queues; the Retry-After with hypothesis on random ones.
The policy is then graded where it matters: in the discrete-event simulator (the engine's own scheduler on a
virtual clock, behind the same admission call the server makes), on a fixed, seeded workload at three times
the engine's capacity, against no admission at all (:func:`minserve.capacity.experiments.overload_sweep`;
the reference solution's goodput is about 7 × no admission's, and its admitted p99 TTFT 0.74 s against a
1 s SLO). Nothing here reads a clock, except the last test: the policy behind a real server, under a burst.
"""

from __future__ import annotations

import math
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import admission
from minserve.admission import AdmissionPolicy, QueueLength, QueueState, Refusal, RequestFacts
from minserve.capacity.experiments import NO_ADMISSION, OVERLOAD_SLO, overload_sweep
from minserve.config import EngineConfig, ServerConfig
from minserve.engine.async_engine import AsyncLLMEngine
from minserve.engine.service_rates import ServiceRates
from minserve.serve.api import create_app
from minserve.serve.launch import ServerThread

PROPERTY = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
RATES = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, num_steps=10, finished_per_s=4.0)
SLO_S = OVERLOAD_SLO.ttft_s  # 1 s
GOODPUT_RATIO = 4.0  # the reference solution's is about 7
REFUSED_SHARE = 0.8  # of the requests that miss the SLO; the reference solution's is 1.0


def _policy(exercise, *args, **kwargs) -> AdmissionPolicy:
    """The learner's policy: an AdmissionPolicy of their own, not one of minserve's in disguise."""
    policy = exercise.SLOAdmission(*args, **kwargs)
    assert isinstance(policy, AdmissionPolicy), "SLOAdmission must subclass AdmissionPolicy"
    own = {cls for cls in vars(admission).values() if isinstance(cls, type) and issubclass(cls, AdmissionPolicy)}
    borrowed = [cls.__name__ for cls in type(policy).__mro__ if cls in own and cls is not AdmissionPolicy]
    assert not borrowed, f"SLOAdmission must be your own policy, not a subclass of {borrowed}"
    return policy


def queue(num_waiting=0, num_running=0, queued=0, max_num_seqs=None, kv_usage=0.0, rates=RATES) -> QueueState:
    return QueueState(num_waiting, num_running, queued, rates, kv_usage, max_num_seqs)


# --- the parts, by hand -------------------------------------------------------------------------------------


@pytest.mark.points(1)
def test_init_checks_its_arguments(exercise):
    """ttft_slo_s must be a positive finite number of seconds and headroom in (0, 1]; anything else: ValueError."""
    policy = _policy(exercise, 2.0)
    assert (policy.ttft_slo_s, policy.headroom) == (2.0, 0.5)
    assert _policy(exercise, 1.0, headroom=1.0).headroom == 1.0
    for bad in (dict(ttft_slo_s=0.0), dict(ttft_slo_s=-1.0), dict(ttft_slo_s=math.inf), dict(ttft_slo_s=math.nan),
                dict(ttft_slo_s=1.0, headroom=0.0), dict(ttft_slo_s=1.0, headroom=1.5)):  # fmt: skip
        with pytest.raises(ValueError):
            exercise.SLOAdmission(**bad)


@pytest.mark.points(1)
def test_prefill_wait(exercise):
    """Queued prompt tokens over the measured prefill rate: 400 tokens at 1000 tokens/s are 0.4 s."""
    policy = _policy(exercise, SLO_S)
    assert policy.prefill_wait_s(queue(queued=400)) == pytest.approx(0.4)
    assert policy.prefill_wait_s(queue(queued=0)) == 0.0
    faster = ServiceRates(prefill_tokens_per_s=4000.0, decode_step_s=0.02)
    assert policy.prefill_wait_s(queue(queued=400, rates=faster)) == pytest.approx(0.1)


@pytest.mark.points(2)
def test_slot_wait(exercise):
    """Slots needed: num_waiting + 1; free: max_num_seqs − num_running (0 when kv_usage ≥ 0.95); the rest
    wait for finishes at rates.finished_per_s. 0.0 when max_num_seqs or the finish rate is unknown."""
    policy = _policy(exercise, SLO_S)
    # A full batch of 8, 3 waiting: the newcomer needs 4 finishes, at 4 a second.
    assert policy.slot_wait_s(queue(3, 8, 150, max_num_seqs=8)) == pytest.approx(1.0)
    # 2 free slots: 2 of the 4 fit now, 2 must wait for finishes.
    assert policy.slot_wait_s(queue(3, 6, 150, max_num_seqs=8)) == pytest.approx(0.5)
    assert policy.slot_wait_s(queue(1, 4, 50, max_num_seqs=8)) == 0.0  # slots to spare: no wait
    # The KV cache nearly full: no slot is free, whatever the batch size says.
    assert policy.slot_wait_s(queue(1, 4, 50, max_num_seqs=8, kv_usage=0.97)) == pytest.approx(0.5)
    unknown_rate = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    assert policy.slot_wait_s(queue(3, 8, 150, max_num_seqs=8, rates=unknown_rate)) == 0.0
    assert policy.slot_wait_s(queue(3, 8, 150, max_num_seqs=None)) == 0.0


@pytest.mark.points(2)
def test_predicted_ttft_takes_the_later_wait_then_its_own_prefill(exercise):
    """max(prefill wait, slot wait) + prompt_tokens / prefill rate: the two waits overlap, so they do not add."""
    policy = _policy(exercise, SLO_S)
    request = RequestFacts(prompt_tokens=100, max_tokens=16)
    assert policy.predicted_ttft_s(request, queue(2, 4, 400)) == pytest.approx(0.5)  # 0.4 + 0.1
    assert policy.predicted_ttft_s(request, queue(3, 8, 150, max_num_seqs=8)) == pytest.approx(1.1)  # 1.0 + 0.1
    assert policy.predicted_ttft_s(request, queue(3, 8, 2000, max_num_seqs=8)) == pytest.approx(2.1)  # 2.0 + 0.1


@pytest.mark.points(1)
def test_budget_is_headroom_times_the_requests_own_timeout_or_the_slo(exercise):
    """headroom × ttft_slo_s, or × request.timeout_s where that is shorter."""
    policy = _policy(exercise, 2.0, headroom=0.5)
    assert policy.budget_s(RequestFacts(10, 10)) == pytest.approx(1.0)
    assert policy.budget_s(RequestFacts(10, 10, timeout_s=1.0)) == pytest.approx(0.5)  # a shorter timeout
    assert policy.budget_s(RequestFacts(10, 10, timeout_s=6.0)) == pytest.approx(1.0)  # a longer one: the SLO


@pytest.mark.points(2)
def test_decide_admits_within_the_budget_and_refuses_past_it(exercise):
    """Admit when the prediction is within the budget or nothing is ahead; else Refusal("ttft_slo",
    prediction − budget, message)."""
    policy = _policy(exercise, 1.0, headroom=0.5)
    request = RequestFacts(prompt_tokens=100, max_tokens=16)
    assert policy.decide(request, queue(2, 4, 400)) is None  # 0.5 s: exactly the budget
    refusal = policy.decide(request, queue(3, 4, 700))  # 0.8 s predicted, 0.5 allowed
    assert isinstance(refusal, Refusal) and refusal.reason == "ttft_slo"
    assert refusal.retry_after_s == pytest.approx(0.3) and refusal.message
    assert policy.decide(RequestFacts(5000, 16), queue()) is None  # alone: 5 s, but waiting cannot help
    assert policy.decide(RequestFacts(100, 16, timeout_s=4.0), queue(3, 4, 700)) is not None  # longer: still the SLO
    assert policy.decide(RequestFacts(100, 16, timeout_s=0.8), queue(2, 4, 400)) is not None  # shorter: 0.4 s


@pytest.mark.points(2)
@PROPERTY
@given(
    waiting=st.integers(0, 200),
    running=st.integers(0, 64),
    queued=st.integers(0, 200_000),
    prompt=st.integers(1, 4096),
    max_num_seqs=st.one_of(st.none(), st.integers(1, 64)),
    kv_usage=st.floats(0.0, 1.0),
    prefill_rate=st.floats(1.0, 1e6),
    finished_rate=st.one_of(st.none(), st.floats(0.01, 1e4)),
    timeout=st.one_of(st.none(), st.floats(0.001, 600.0)),
)
def test_retry_after_is_positive_and_finite(exercise, waiting, running, queued, prompt, max_num_seqs, kv_usage,
                                            prefill_rate, finished_rate, timeout):  # fmt: skip
    """Every refusal's retry_after_s is a positive, finite number of seconds (prediction − budget > 0)."""
    rates = ServiceRates(prefill_rate, 0.02, 10, finished_rate)
    state = QueueState(waiting, running, queued, rates, kv_usage, max_num_seqs)
    refusal = _policy(exercise, 1.0).decide(RequestFacts(prompt, 16, timeout), state)
    if refusal is not None:
        assert 0 < refusal.retry_after_s < math.inf, refusal


@pytest.mark.points(1)
@PROPERTY
@given(queued=st.integers(1, 100_000), prompt=st.integers(1, 4096), rate=st.floats(10.0, 1e5))
def test_after_retry_after_the_same_request_is_admitted(exercise, queued, prompt, rate):
    """retry_after_s is how long until enough of the queued work has drained: then the same request fits."""
    policy = _policy(exercise, 1.0)
    rates = ServiceRates(rate, 0.02)
    refusal = policy.decide(RequestFacts(prompt, 16), queue(queued=queued, rates=rates))
    if refusal is None:
        return
    drained = max(0, queued - math.ceil(refusal.retry_after_s * rate * (1 + 1e-9)))
    assert policy.decide(RequestFacts(prompt, 16), queue(queued=drained, rates=rates)) is None


# --- at three times the engine's capacity, in the simulator ---------------------------------------------------


@pytest.fixture(scope="module")
def no_admission_row():
    (row,) = overload_sweep(policies={"none": QueueLength(NO_ADMISSION)}, load_multiples=(3.0,))
    return row


def _row_at_3x(policy: AdmissionPolicy) -> dict:
    (row,) = overload_sweep(policies={"yours": policy}, load_multiples=(3.0,))
    return row


@pytest.mark.points(3)
def test_goodput_at_three_times_capacity(exercise, no_admission_row):
    """Refuse what cannot be served in time, and the rest is: goodput (requests/s meeting the SLO) at 3 × capacity
    must be ≥ 4 × no admission's. Admitting everything, or nothing, is far from it."""
    mine = _row_at_3x(_policy(exercise, SLO_S))
    assert mine["goodput_rps"] >= GOODPUT_RATIO * no_admission_row["goodput_rps"], (
        f"goodput {mine['goodput_rps']:.1f} requests/s against no admission's {no_admission_row['goodput_rps']:.1f}"
        f" (capacity {mine['capacity_rps']:.1f}); refused {mine['refused']} of {mine['sent']}"
    )


@pytest.mark.points(2)
def test_admitted_requests_meet_the_slo(exercise):
    """The requests you admit at 3 × capacity must have a p99 TTFT within the SLO (1 s); aiming at the SLO itself
    (headroom 1) is not enough: the queue settles where the prediction equals the budget."""
    mine = _row_at_3x(_policy(exercise, SLO_S))
    assert mine["admitted"] > 0, "nothing was admitted"
    assert mine["ttft_p99_s"] <= SLO_S, f"admitted p99 TTFT {mine['ttft_p99_s']:.2f} s over the {SLO_S:g} s SLO"


@pytest.mark.points(2)
def test_refuses_fast_rather_than_failing_late(exercise):
    """Of the requests that miss the SLO at 3 × capacity, ≥ 80% must be refused at the door (a 429 costs the
    client nothing), not admitted and served too late."""
    mine = _row_at_3x(_policy(exercise, SLO_S))
    missed = mine["sent"] - mine["met_slo"]
    assert missed > 0 and mine["refused"] >= REFUSED_SHARE * missed, (
        f"refused {mine['refused']} of the {missed} requests that missed the SLO"
    )


# --- the real server ----------------------------------------------------------------------------------------

MODEL = "minserve-tiny"


class _Server:
    """The real server with the learner's policy, on a free loopback port, in a thread."""

    def __init__(self, policy: AdmissionPolicy, **engine_options) -> None:
        self.engine = AsyncLLMEngine(EngineConfig(model=MODEL, **engine_options))
        self.serving = ServerThread(create_app(self.engine, MODEL, ServerConfig(admission=policy)), 30.0)
        self.url = self.serving.url

    def stop(self) -> None:
        self.serving.stop()


def _burst(url: str, body: dict, n: int) -> list[httpx.Response]:
    """``n`` requests sent at once, each from its own thread; their responses."""
    responses: list[httpx.Response | None] = [None] * n
    start = threading.Barrier(n)

    def send(i: int) -> None:
        start.wait()
        responses[i] = httpx.post(url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return [r for r in responses if r is not None]


@pytest.mark.points(2)
def test_the_real_server_refuses_with_429_and_retry_after(exercise):
    """Plugged into the real server (ServerConfig(admission=policy)), with one slot and a burst of requests,
    the ones behind a queued prompt are refused: 429, your reason as the error code, Retry-After ≥ 1 second."""
    server = _Server(_policy(exercise, 0.01), max_num_seqs=1, num_kv_blocks=256)
    try:
        # Long prompts: each one queued ahead predicts tens of ms of prefill against a 5 ms budget, however
        # fast this machine prefills, so the refusals do not hang on timing.
        body = {"model": MODEL, "prompt": "def count(): " * 128, "max_tokens": 48, "ignore_eos": True}
        responses = _burst(server.url, body, 6)
    finally:
        server.stop()
    codes = sorted(r.status_code for r in responses)
    assert len(responses) == 6 and 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.json()["error"]["code"] == "ttft_slo"
        assert int(refused.headers["retry-after"]) >= 1
