"""Graded tests for chapter 09 (``minserve grade ch09``). Each test's docstring is the hint a learner sees.

The design is the learner's, so only behaviour is checked: sense at the edges on hand-made and random queues
(an idle server admits, a heavier queue never admits more, a client's timeout counts), the Retry-After with
hypothesis on random ones. The policy is then graded where it matters: in the discrete-event simulator
(the engine's own scheduler on a virtual clock, behind the same admission call the server makes), on a
fixed, seeded workload at three times the engine's capacity, against no admission at all
(:func:`minserve.capacity.experiments.overload_sweep`; the reference solution's goodput is about 7 × no
admission's, and its admitted p99 TTFT 0.74 s against a 1 s SLO). Nothing here reads a clock, except the
last test: the policy behind a real server, under a burst.
"""

from __future__ import annotations

import math
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import admission
from minserve.admission import AdmissionPolicy, QueueLength, QueueState, RequestFacts
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


# --- sense at the edges, on hand-made queues ------------------------------------------------------------------


@pytest.mark.points(1)
def test_init_checks_its_argument(exercise):
    """ttft_slo_s must be a positive finite number of seconds: 0, −1, inf and nan raise ValueError."""
    _policy(exercise, 2.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            exercise.SLOAdmission(ttft_slo_s=bad)


@pytest.mark.points(1)
@PROPERTY
@given(prompt=st.integers(1, 8192), running=st.integers(0, 7), slo=st.floats(0.001, 10.0))
def test_an_idle_server_admits_any_request(exercise, prompt, running, slo):
    """Nothing queued ahead and a free slot: admit, whatever the prompt (refusing it cannot make it faster)."""
    state = queue(0, running, 0, max_num_seqs=8)
    assert _policy(exercise, slo).decide(RequestFacts(prompt, 16), state) is None


@pytest.mark.points(2)
@PROPERTY
@given(
    waiting=st.integers(0, 64),
    running=st.integers(0, 16),
    queued=st.integers(0, 50_000),
    more_waiting=st.integers(0, 32),
    more_queued=st.integers(0, 50_000),
    slowdown=st.floats(1.0, 8.0),
    prompt=st.integers(1, 2048),
)
def test_a_heavier_queue_never_admits_what_a_lighter_one_refused(
    exercise, waiting, running, queued, more_waiting, more_queued, slowdown, prompt
):
    """More requests or prompt tokens waiting ahead, or a slower measured prefill, must not turn a refusal
    into an admission: the prediction can only grow with the work ahead."""
    policy, request = _policy(exercise, SLO_S), RequestFacts(prompt, 16)
    light = queue(waiting, running, queued, max_num_seqs=16)
    slower = ServiceRates(RATES.prefill_tokens_per_s / slowdown, RATES.decode_step_s, 10, RATES.finished_per_s)
    heavy = queue(waiting + more_waiting, running, queued + more_queued, max_num_seqs=16, rates=slower)
    if policy.decide(request, light) is not None:
        assert policy.decide(request, heavy) is not None, (light, heavy)


@pytest.mark.points(1)
def test_refuses_behind_more_prefill_than_the_slo(exercise):
    """Slots to spare, but 5 s of prompts queued ahead (5000 tokens at 1000 tokens/s) under a 1 s SLO: refuse.
    A batch slot is not the only wait: the prompts ahead are prefilled first."""
    state = queue(3, 2, 5000, max_num_seqs=16)
    assert _policy(exercise, SLO_S).decide(RequestFacts(100, 16), state) is not None


@pytest.mark.points(1)
def test_a_clients_shorter_timeout_is_honoured(exercise):
    """A request that sent timeout_s = 0.05 s is refused behind 0.1 s of queued prefill, where the same request
    without a timeout (SLO 1 s) is admitted; a timeout longer than the SLO does not loosen it."""
    policy, state = _policy(exercise, SLO_S), queue(1, 4, 100, max_num_seqs=16)  # 0.1 s of prefill ahead
    assert policy.decide(RequestFacts(100, 16), state) is None
    assert policy.decide(RequestFacts(100, 16, timeout_s=0.05), state) is not None
    swamped = queue(20, 16, 20_000, max_num_seqs=16)  # 20 s of prefill ahead
    assert policy.decide(RequestFacts(100, 16, timeout_s=600.0), swamped) is not None


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
        self.engine = AsyncLLMEngine(EngineConfig.from_options(model=MODEL, **engine_options))
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
