"""Admission control: the policies on synthetic queues (no server), the measured service rates, and one real
server that refuses by predicted TTFT and stops a request at the timeout the request itself sent."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minserve.admission import (
    AdmissionPolicy,
    DeadlineAware,
    FirstRefusal,
    QueueLength,
    QueueState,
    Refusal,
    RequestFacts,
    TokenBudget,
    make_admission,
    retry_after_header,
)
from minserve.config import ServerConfig
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.service_rates import PRIOR, ServiceRateMeter, ServiceRates
from minserve.engine.step_report import ScheduledSeq, StepReport
from tests.servers import MODEL, RunningServer

RATE = ServiceRates(prefill_tokens_per_s=100.0, decode_step_s=0.02, num_steps=10)


def queue(num_waiting: int = 0, queued_prompt_tokens: int = 0, rates: ServiceRates = RATE) -> QueueState:
    return QueueState(num_waiting=num_waiting, num_running=4, queued_prompt_tokens=queued_prompt_tokens, rates=rates)


# --- the policies, on synthetic queues ---------------------------------------------------------------------


def test_queue_length_refuses_at_the_limit_and_predicts_when_the_excess_has_drained():
    policy = QueueLength(8)
    assert policy.decide(RequestFacts(50, 16), queue(7, 700)) is None
    refusal = policy.decide(RequestFacts(50, 16), queue(10, 1000))
    # 10 waiting, limit 8: 3 must leave, at 100 tokens each on average, prefilled at 100 tokens/s.
    assert refusal.reason == "queue_full" and refusal.retry_after_s == pytest.approx(3.0)
    assert QueueLength(0).decide(RequestFacts(1, 1), queue(0, 0)).reason == "queue_full"  # 0: nothing waits


def test_token_budget_counts_the_requests_own_prompt_and_never_starves_a_long_one():
    policy = TokenBudget(1000)
    assert policy.decide(RequestFacts(200, 16), queue(3, 800)) is None  # exactly at the budget
    refusal = policy.decide(RequestFacts(201, 16), queue(3, 900))
    assert refusal.reason == "token_budget" and refusal.retry_after_s == pytest.approx(101 / 100)
    assert policy.decide(RequestFacts(5000, 16), queue(0, 0)) is None  # alone, a prompt over the budget runs


def test_deadline_aware_predicts_ttft_from_the_queue_and_the_measured_rate():
    policy = DeadlineAware(ttft_slo_s=1.0)
    assert policy.decide(RequestFacts(50, 16), queue(2, 40)) is None  # (40 + 50) / 100 = 0.9 s
    refusal = policy.decide(RequestFacts(50, 16), queue(2, 110))  # 1.6 s predicted
    assert refusal.reason == "ttft_slo" and refusal.retry_after_s == pytest.approx(0.6)
    assert "1.60 s" in refusal.message
    # The request's own timeout can only shorten the budget: longer changes nothing, shorter refuses.
    assert policy.decide(RequestFacts(50, 16, timeout_s=2.0), queue(2, 110)).reason == "ttft_slo"
    assert policy.decide(RequestFacts(50, 16, timeout_s=0.5), queue(2, 40)).reason == "ttft_slo"
    # A faster engine, measured, admits the same queue.
    assert policy.decide(RequestFacts(50, 16), queue(2, 110, ServiceRates(1000.0, 0.02))) is None
    assert policy.decide(RequestFacts(500, 16), queue(0, 0)) is None  # nothing ahead: waiting cannot help


def test_deadline_aware_aims_at_its_headroom_of_the_budget():
    """The server's policy aims at half the budget: a prediction of 0.9 s under a 1 s SLO is refused."""
    policy = DeadlineAware.from_config(ServerConfig(ttft_slo_ms=1000.0))
    assert policy.headroom == 0.5
    assert policy.decide(RequestFacts(10, 16), queue(2, 30)) is None  # (30 + 10) / 100 = 0.4 s
    refusal = policy.decide(RequestFacts(50, 16), queue(2, 40))  # 0.9 s, over 0.5 s
    assert refusal.reason == "ttft_slo" and refusal.retry_after_s == pytest.approx(0.4)
    assert "0.5 of the 1 s budget" in refusal.message
    with pytest.raises(ValueError, match="admission_headroom"):
        ServerConfig(admission_headroom=1.5)


def test_deadline_aware_waits_for_a_slot_when_the_batch_is_full():
    """A full batch: the newcomer runs only once the requests ahead of it and one more have finished."""
    policy = DeadlineAware(ttft_slo_s=1.0)
    rates = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, finished_per_s=2.0)
    full = QueueState(num_waiting=3, num_running=8, queued_prompt_tokens=150, rates=rates, max_num_seqs=8)
    assert full.slot_wait_s() == pytest.approx(2.0)  # (3 ahead + itself) / 2 finishes a second
    refusal = policy.decide(RequestFacts(50, 16), full)
    assert refusal.reason == "ttft_slo" and refusal.retry_after_s == pytest.approx(2.05 - 1.0)
    assert "2.00 s until a slot frees" in refusal.message
    # The same prefill work with slots to spare waits for nothing but prefill: 0.2 s.
    roomy = QueueState(num_waiting=3, num_running=4, queued_prompt_tokens=150, rates=rates, max_num_seqs=8)
    assert roomy.slot_wait_s() == 0 and policy.decide(RequestFacts(50, 16), roomy) is None
    # A cache nearly out of blocks is as full as the batch; an unmeasured finish rate predicts no wait.
    blocked = QueueState(3, 4, 150, rates, kv_usage=0.97, max_num_seqs=8)
    assert blocked.slot_wait_s() == pytest.approx(2.0)
    unmeasured = QueueState(3, 8, 150, ServiceRates(1000.0, 0.02), max_num_seqs=8)
    assert unmeasured.slot_wait_s() == 0 and policy.decide(RequestFacts(50, 16), unmeasured) is None


@given(
    queued=st.integers(1, 100_000),
    prompt=st.integers(1, 4_000),
    limit=st.integers(1, 50_000),
    rate=st.floats(10.0, 1e6),
    slo_s=st.floats(1e-3, 10.0),
)
def test_a_refused_request_fits_once_retry_after_s_of_prefill_has_drained(queued, prompt, limit, rate, slo_s):
    """Retry-After means something: had the queue drained at the measured rate for that long (and nothing
    new arrived), the same request would be admitted."""
    rates = ServiceRates(rate, 0.02)
    for policy in (TokenBudget(limit), DeadlineAware(slo_s)):
        refusal = policy.decide(RequestFacts(prompt, 16), queue(1, queued, rates))
        if refusal is None:
            continue
        drained = max(0, math.floor(queued - refusal.retry_after_s * rate * (1 + 1e-9)))
        assert policy.decide(RequestFacts(prompt, 16), queue(1, drained, rates)) is None, policy


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one():
    assert retry_after_header(0.0) == "1"
    assert retry_after_header(0.2) == "1"
    assert retry_after_header(2.01) == "3"
    assert retry_after_header(0.4, floor_s=2) == "2" and retry_after_header(5.5, floor_s=2) == "6"


def test_policies_are_chosen_by_name_behind_the_queue_limit_or_plugged_in_whole():
    config = ServerConfig(admission="token-budget", max_queued_prompt_tokens=100, max_waiting_requests=2)
    policy = make_admission(config)
    assert isinstance(policy, FirstRefusal)
    assert policy.decide(RequestFacts(10, 1), queue(2, 10)).reason == "queue_full"  # the hard limit holds
    assert policy.decide(RequestFacts(95, 1), queue(1, 10)).reason == "token_budget"
    assert isinstance(make_admission(ServerConfig()), QueueLength)
    assert make_admission(ServerConfig()).max_waiting_requests == 256  # today's default, unchanged
    deadline = make_admission(ServerConfig(admission="deadline", ttft_slo_ms=250)).policies[1]
    assert deadline.ttft_slo_s == 0.25

    class Never(AdmissionPolicy):
        def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
            return Refusal("never", 1.0, "no")

    mine = Never()
    assert make_admission(ServerConfig(admission=mine)) is mine
    with pytest.raises(ValueError, match="deadline.*queue-length.*token-budget"):
        make_admission(ServerConfig(admission="fifo"))


# --- the measured rates --------------------------------------------------------------------------------------


def report(step_s: float, *scheduled: tuple[int, str]) -> StepReport:
    seqs = [ScheduledSeq(f"r{i}", n, 0, state) for i, (n, state) in enumerate(scheduled)]
    return StepReport(1, 0.0, 0.0, step_s, step_s, seqs, [], [], 0, [], [], len(seqs))


def test_the_meter_starts_from_the_prior_and_follows_the_engines_steps():
    meter = ServiceRateMeter(weight=0.5)
    assert meter.rates == PRIOR
    meter(report(0.5, (400, "prefill"), (600, "prefill")))  # 1000 prompt tokens in 0.5 s
    assert meter.rates.prefill_tokens_per_s == pytest.approx(2000) and meter.rates.decode_step_s == PRIOR.decode_step_s
    meter(report(0.02, (1, "decode"), (1, "decode")))
    assert meter.rates.decode_step_s == pytest.approx(0.02)
    # A mixed step counts whole: its decodes slowed the prefill down, as they will while serving.
    meter(report(1.5, (1000, "prefill"), (1, "decode")))  # tokens → 1000, seconds → 1.0
    assert meter.rates.prefill_tokens_per_s == pytest.approx(1000)
    meter(report(0.04, (1, "decode")))
    assert meter.rates.decode_step_s == pytest.approx(0.03) and meter.rates.num_steps == 4
    assert meter.rates.finished_per_s is None  # nothing has finished yet: no rate, not a guess


def test_the_meter_measures_how_fast_requests_finish():
    meter = ServiceRateMeter(weight=0.5)
    finished = [RequestOutput(f"r{i}", None, [1], "", [2], "length", RequestMetrics(0.0)) for i in range(2)]
    meter(dataclasses.replace(report(0.1, (1, "decode"), (1, "decode")), outputs=finished))  # 2 in 0.1 s
    assert meter.rates.finished_per_s == pytest.approx(20.0)
    meter(report(0.1, (1, "decode")))  # none finished: EWMAs 1 request in 0.1 s
    assert meter.rates.finished_per_s == pytest.approx(10.0)
    assert meter.rates.finishing_s(5) == pytest.approx(0.5) and meter.rates.finishing_s(0) == 0


# --- a real server -----------------------------------------------------------------------------------------

LONG = {"model": MODEL, "prompt": "def long():", "max_tokens": 1500, "ignore_eos": True, "stream": True}
NEARLY_NOTHING_MS = 1e-6  # any prefill work queued ahead predicts a TTFT over it


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(admission="deadline", ttft_slo_ms=NEARLY_NOTHING_MS)
    running = RunningServer(config, num_kv_blocks=512, max_num_seqs=2)
    yield running
    running.stop()


class Streaming:
    """A streamed request held open in a thread until ``close``; ``running`` is set at its first chunk."""

    def __init__(self, url: str, body: dict) -> None:
        self.running, self.stop, self.status = threading.Event(), threading.Event(), None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.running.set()
                if self.stop.is_set():
                    return  # leaving the stream disconnects: the server cancels the request

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def running(url: str, body: dict) -> Streaming:
    """A stream that has had its first token (so its prompt is no longer queued work)."""
    stream = Streaming(url, body)
    assert stream.running.wait(60), f"the request was not admitted: {stream.status}"
    return stream


def test_a_request_refused_by_its_predicted_ttft_gets_429_and_retry_after_at_once(server):
    streams = [running(server.url, LONG)]
    try:
        streams.append(running(server.url, LONG))  # both slots of the batch are taken now
        streams.append(Streaming(server.url, LONG | {"prompt": "def waits_for_a_slot(): " * 20}))
        _wait_for(lambda: server.engine.num_queued_prompt_tokens > 0)  # its prefill is the work ahead
        body = {"model": MODEL, "prompt": "def refused():", "max_tokens": 4, "stream": True}
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "ttft_slo" and "predicted time to first token" in refused.text
        assert int(refused.headers["retry-after"]) >= 1
        # A longer timeout of its own does not loosen the server's SLO: refused the same.
        patient = httpx.post(server.url + "/v1/completions", json=body | {"timeout": 60.0}, timeout=60)
        assert patient.status_code == 429 and patient.json()["error"]["code"] == "ttft_slo"
    finally:
        for stream in streams:
            stream.close()
    server.wait_until_idle()
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'minserve:requests_rejected_total{reason="ttft_slo"} 2.0' in text
    rate = next(line for line in text.splitlines() if line.startswith("minserve:prefill_tokens_per_second "))
    assert float(rate.split()[1]) > 0


def test_a_request_stops_at_its_own_timeout_from_the_body_or_the_header_and_frees_its_blocks(server):
    busy = running(server.url, LONG)
    try:
        body = {"model": MODEL, "prompt": "def slow():", "max_tokens": 1500, "ignore_eos": True}
        plain = httpx.post(server.url + "/v1/completions", json=body | {"timeout": 0.5}, timeout=60)
        assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
        assert "0.5 s" in plain.json()["error"]["message"]
        header = {"X-Request-Timeout": "0.5"}
        streamed = httpx.post(server.url + "/v1/completions", json=body | {"stream": True}, headers=header, timeout=60)
        events = [line for line in streamed.text.splitlines() if line.startswith("data:")]
        assert '"timeout"' in events[-1] and "[DONE]" not in events[-1]
    finally:
        busy.close()
    server.wait_until_idle()
    assert server.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_a_timeout_header_that_is_not_a_positive_number_is_a_400_naming_it(server, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    answer = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Timeout": value}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "X-Request-Timeout"
