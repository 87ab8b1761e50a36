"""The retrying client: backoff with full jitter inside its bounds, Retry-After honoured, the retry budget and
the adaptive throttle's rule, on injected clocks and sleeps; then a real server that refuses everything, where
the client, and the load tester, retry and give up as configured."""

from __future__ import annotations

import asyncio
import json
import random
from datetime import datetime, timezone
from email.utils import format_datetime

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minserve.admission import QueueLength
from minserve.bench.client import ClientConfig, send_with_retries
from minserve.bench.workload import BenchRequest
from minserve.cli import main
from minserve.client import (
    AdaptiveThrottle,
    Outcome,
    RequestFailed,
    Retrier,
    RetryBudget,
    RetryPolicy,
    complete,
    parse_retry_after,
)
from minserve.config import ServerConfig
from tests.servers import MODEL, RunningServer


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Fixed(random.Random):
    """A "random" generator that always draws ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


# --- backoff --------------------------------------------------------------------------------------------------


@given(base_s=st.floats(0.001, 5.0), cap_s=st.floats(0.001, 60.0), retry=st.integers(0, 40), seed=st.integers(0, 2**32))
def test_every_backoff_lies_within_zero_and_the_capped_exponential(base_s, cap_s, retry, seed):
    base_s = min(base_s, cap_s)
    policy = RetryPolicy(max_attempts=3, base_s=base_s, cap_s=cap_s, rng=random.Random(seed))
    bound = min(cap_s, base_s * 2**retry)
    draws = [policy.backoff_s(retry) for _ in range(50)]
    assert all(0 <= d <= bound for d in draws)
    assert len(set(draws)) > 1  # jittered: clients refused together do not return together


def test_the_backoff_grows_exponentially_up_to_the_cap():
    policy = RetryPolicy(base_s=0.5, cap_s=4.0, rng=random.Random(1))
    means = [sum(policy.backoff_s(n) for _ in range(4000)) / 4000 for n in range(6)]
    # Full jitter: uniform in [0, bound], so the mean is half the bound: 0.25, 0.5, 1, 2, then the cap's 2.
    assert means == pytest.approx([0.25, 0.5, 1.0, 2.0, 2.0, 2.0], rel=0.06)


@given(retry_after_s=st.floats(0.0, 100.0), retry=st.integers(0, 10))
def test_a_delay_is_never_shorter_than_the_servers_retry_after(retry_after_s, retry):
    policy = RetryPolicy(base_s=0.1, cap_s=1.0, rng=random.Random(retry))
    assert retry_after_s <= policy.delay_s(retry, retry_after_s) <= retry_after_s + 1.0


def test_retry_after_reads_seconds_and_http_dates():
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    date = format_datetime(datetime.fromtimestamp(1_000_120, tz=timezone.utc), usegmt=True)
    assert parse_retry_after(date, now_s=1_000_000) == pytest.approx(120)


# --- budget and throttle -------------------------------------------------------------------------------------


def test_the_budget_allows_its_share_of_retries_over_its_window_and_no_more():
    clock = Clock()
    budget = RetryBudget(ratio=0.1, window_s=10.0, min_retries=0, clock=clock)
    for _ in range(100):
        budget.record_request()
    assert [budget.try_retry() for _ in range(11)] == [True] * 10 + [False]
    clock.now_s = 10.5  # the window has passed: the requests and retries in it no longer count
    assert not budget.try_retry()  # … and neither do any requests: nothing to retry a share of
    budget.record_request()
    assert RetryBudget(ratio=0.1, min_retries=2, clock=clock).try_retry()  # a lone request may still retry


def test_the_throttle_rejects_with_the_sre_books_probability():
    clock = Clock()
    throttle = AdaptiveThrottle(k=2.0, window_s=120.0, clock=clock, rng=Fixed(0.999))
    for _ in range(100):
        assert throttle.allow()  # the draw (0.999) is above every probability here
    for _ in range(40):
        throttle.record_accept()
    assert throttle.rejection_probability() == pytest.approx((100 - 2 * 40) / 101)
    for _ in range(10):
        throttle.record_accept()  # accepts = requests / k: no rejection at all
    assert throttle.rejection_probability() == 0.0
    clock.now_s = 121.0
    assert throttle.counts() == (0, 0)
    low = AdaptiveThrottle(k=2.0, clock=clock, rng=Fixed(0.0))
    low.allow()  # 0 requests so far: probability 0, and 0.0 < 0 is false: sent
    assert not low.allow()  # 1 request, 0 accepts: probability 1/2, and the draw is below it


# --- the retry loop ------------------------------------------------------------------------------------------


def script(*outcomes: Outcome):
    """An attempt function that answers ``outcomes`` in turn, and the sleeps it was made to wait."""
    answers, slept = list(outcomes), []
    return (lambda: answers.pop(0)), (lambda outcome: outcome), slept.append, slept


def test_the_loop_retries_refusals_honouring_retry_after_and_stops_at_success():
    attempt, classify, sleep, slept = script(
        Outcome(False, True, retry_after_s=2.0), Outcome(False, True), Outcome(True, False)
    )
    tries = Retrier(RetryPolicy(max_attempts=5, base_s=0.1, cap_s=1.0, rng=random.Random(0))).call(
        attempt, classify, sleep
    )
    assert tries.num_attempts == 3 and tries.stopped_by is None and tries.result.accepted
    assert slept[0] >= 2.0 and 0 <= slept[1] <= 0.2 and tries.waited_s == pytest.approx(sum(slept))


@pytest.mark.parametrize(
    ("retrier", "attempts", "stopped_by"),
    [
        (Retrier(RetryPolicy(max_attempts=3)), 3, "max_attempts"),
        (Retrier(RetryPolicy(max_attempts=9), RetryBudget(ratio=0.0, min_retries=1)), 2, "budget"),
        (Retrier(RetryPolicy(max_attempts=9), throttle=AdaptiveThrottle(k=1.0, rng=Fixed(0.0))), 1, "throttled"),
    ],
)
def test_the_loop_gives_up_as_configured(retrier, attempts, stopped_by):
    attempt, classify, sleep, _ = script(*[Outcome(False, True)] * 9)
    tries = retrier.call(attempt, classify, sleep)
    assert tries.num_attempts == attempts and tries.stopped_by == stopped_by


def test_a_failure_that_retrying_cannot_fix_is_not_retried():
    attempt, classify, sleep, slept = script(Outcome(True, False))
    assert Retrier(RetryPolicy(max_attempts=5)).call(attempt, classify, sleep).num_attempts == 1 and not slept


# --- a server that refuses everything ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    running = RunningServer(ServerConfig(admission=QueueLength(0), retry_after_s=2), num_kv_blocks=16)
    yield running
    running.stop()


def test_the_client_retries_a_refusing_server_and_gives_up_as_configured(server):
    slept = []
    retrier = Retrier(RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.01, rng=random.Random(0)))
    with pytest.raises(RequestFailed) as failed:
        complete(server.url, MODEL, "def f():", max_tokens=2, retrier=retrier, sleep=slept.append)
    error = failed.value
    assert error.status == 429 and error.body["error"]["code"] == "queue_full"
    assert error.attempts.num_attempts == 3 and error.attempts.stopped_by == "max_attempts"
    assert len(slept) == 2 and all(2.0 <= s <= 2.01 for s in slept)  # Retry-After: 2, plus the jitter
    budgeted = Retrier(RetryPolicy(max_attempts=5), RetryBudget(ratio=0.0, min_retries=1))
    with pytest.raises(RequestFailed) as failed:
        complete(server.url, MODEL, "def f():", retrier=budgeted, sleep=slept.append)
    assert failed.value.attempts.num_attempts == 2 and failed.value.attempts.stopped_by == "budget"
    refused = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'minserve:requests_rejected_total{reason="queue_full"} 5.0' in refused


def test_the_load_tester_records_each_requests_attempts(server):
    slept = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def run():
        config = ClientConfig(server.url, MODEL)
        retrier = Retrier(RetryPolicy(max_attempts=2, base_s=0.01, cap_s=0.01))
        async with httpx.AsyncClient(timeout=30) as http:
            request = BenchRequest(index=0, prompt="def f():", max_tokens=2)
            return await send_with_retries(http, config, request, 0.0, lambda: 0.0, retrier, sleep)

    result = asyncio.run(run())
    assert result.status == "failed" and result.error == "http_429" and result.retry_after_s == 2.0
    assert result.attempts == 2 and result.retries_stopped_by == "max_attempts" and slept[0] >= 2.0


def test_bench_serve_retries_on_the_command_line(server, tmp_path):
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--rates", "inf", "--prompt-len",
            "8", "--output-len", "2", "--retries", "1", "--retry-cap-s", "0.01", "--retry-base-s", "0.01",
            "--no-bundle", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["attempts"] for r in records] == [2, 2] and {r["error"] for r in records} == {"http_429"}
