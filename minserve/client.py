"""A client that is kind to a server under load: retries with capped exponential backoff and full jitter that
honour ``Retry-After``, a retry budget, and adaptive throttling.

    from minserve.client import AdaptiveThrottle, RetryBudget, Retrier, RetryPolicy, complete

    retrier = Retrier(RetryPolicy(max_attempts=4), RetryBudget(ratio=0.1), AdaptiveThrottle(k=2))
    answer = complete("http://127.0.0.1:8000", "minserve-tiny", "def fib(n):", max_tokens=32, retrier=retrier)

Share one :class:`Retrier` between calls: its budget and throttle count what *all* of them saw.

Retries are how an overload becomes an outage. A server past capacity refuses some requests; if every client
retries at once, the refused load comes back on top of the new load, and the server, which was merely
overloaded, now refuses almost everything (a *retry storm*). Three rules keep retries from doing that:

* **Backoff with full jitter** (:class:`RetryPolicy`): before retry ``n`` (0 first) wait a uniformly random
  time in ``[0, min(cap, base · 2ⁿ)]``. Exponential, so a persistent overload sees fewer and fewer retries;
  random, so clients refused together do not come back together. A server that says ``Retry-After: s``
  knows better than the client: the wait is then ``s`` plus the jitter, at least what it asked.
* **A retry budget** (:class:`RetryBudget`): retries may be at most ``ratio`` of the requests over a
  sliding window (plus a few, ``min_retries``, so a lone request may still retry). When the server fails
  everything, the load it sees grows by ``ratio`` at most, not by a factor of ``max_attempts``.
* **Adaptive throttling** (:class:`AdaptiveThrottle`, from Google's SRE book, "Handling Overload"): the
  client counts its ``requests`` and the server's ``accepts`` over a window and refuses a request *itself*,
  without sending it, with probability ``max(0, (requests − k · accepts) / (requests + 1))``. While the
  server accepts everything nothing is refused; once it accepts less than one in ``k``, the client sheds the
  excess locally, where it costs nothing.

The rules are plain objects with an injectable clock and random generator, so tests check them with no
sleeping. :meth:`Retrier.call` and :meth:`Retrier.acall` run them around any attempt (a sync or async
function); :func:`complete` and :func:`chat` are the OpenAI routes over ``httpx``. The load tester uses the
same objects (``minserve bench serve --retries N``). This module imports no other part of minserve.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

T = TypeVar("T")
Clock = Callable[[], float]  # seconds, monotonic
RETRYABLE_STATUSES = (429, 503)  # refused for load, or not serving for now: nothing was done, so retry


@dataclass
class RetryPolicy:
    """How many attempts, and how long to wait between them. ``max_attempts`` counts the first one; times
    in seconds. ``rng`` draws the jitter (seed it for a reproducible run)."""

    max_attempts: int = 3
    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be a whole number ≥ 1 (1: no retries), got {self.max_attempts!r}")
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"need 0 < base_s ≤ cap_s, got base_s={self.base_s!r}, cap_s={self.cap_s!r}")

    def backoff_s(self, retry: int) -> float:
        """Full jitter: uniform in ``[0, min(cap_s, base_s · 2^retry)]``; ``retry`` is 0 before the first."""
        return self.rng.uniform(0.0, min(self.cap_s, self.base_s * 2.0**retry))

    def delay_s(self, retry: int, retry_after_s: float | None = None) -> float:
        """The wait before retry ``retry``: the backoff, after the server's ``Retry-After`` if it sent one
        (jitter on top, so the clients it refused together do not return together)."""
        return (retry_after_s or 0.0) + self.backoff_s(retry)


class RetryBudget:
    """Retries at most ``ratio`` of the requests over the last ``window_s`` seconds, plus ``min_retries``."""

    def __init__(self, ratio: float = 0.1, window_s: float = 10.0, min_retries: int = 3, clock: Clock = time.monotonic):
        if not ratio >= 0 or not window_s > 0 or min_retries < 0:
            raise ValueError(
                f"need ratio ≥ 0, window_s > 0, min_retries ≥ 0; got {ratio!r}, {window_s!r}, {min_retries!r}"
            )
        self.ratio, self.window_s, self.min_retries, self.clock = ratio, window_s, min_retries, clock
        self._requests: deque[float] = deque()  # when each first attempt went out
        self._retries: deque[float] = deque()

    def record_request(self) -> None:
        """A new request (its first attempt)."""
        self._requests.append(self.clock())

    def try_retry(self) -> bool:
        """Spend one retry if the budget has one; ``False``: the budget is spent, do not retry."""
        now = self.clock()
        for times in (self._requests, self._retries):
            while times and times[0] <= now - self.window_s:
                times.popleft()
        if len(self._retries) >= self.min_retries + self.ratio * len(self._requests):
            return False
        self._retries.append(now)
        return True


class AdaptiveThrottle:
    """Client-side throttling: refuse locally with probability ``max(0, (requests − k·accepts) / (requests + 1))``,
    counted over the last ``window_s`` seconds (the SRE book's two minutes by default).

    ``k`` is how much more than the server accepts the client still sends: at 2, up to twice the accepted
    load reaches the server, so it sees the real demand and the client notices as soon as it recovers.
    """

    def __init__(
        self, k: float = 2.0, window_s: float = 120.0, clock: Clock = time.monotonic, rng: random.Random | None = None
    ):
        if not k >= 1 or not window_s > 0:
            raise ValueError(f"need k ≥ 1 and window_s > 0, got k={k!r}, window_s={window_s!r}")
        self.k, self.window_s, self.clock, self.rng = k, window_s, clock, rng or random.Random()
        self._requests: deque[float] = deque()
        self._accepts: deque[float] = deque()

    def counts(self) -> tuple[int, int]:
        """``(requests, accepts)`` in the window now."""
        now = self.clock()
        for times in (self._requests, self._accepts):
            while times and times[0] <= now - self.window_s:
                times.popleft()
        return len(self._requests), len(self._accepts)

    def rejection_probability(self) -> float:
        requests, accepts = self.counts()
        return max(0.0, (requests - self.k * accepts) / (requests + 1))

    def allow(self) -> bool:
        """Count one request; ``False``: refuse it here, without sending it."""
        refuse = self.rng.random() < self.rejection_probability()
        self._requests.append(self.clock())
        return not refuse

    def record_accept(self) -> None:
        """The server accepted a request (answered it, as opposed to refusing it for load)."""
        self._accepts.append(self.clock())


@dataclass(frozen=True)
class Outcome:
    """What one attempt says about retrying: did the server ``accept`` it (for the throttle: anything but a
    refusal for load or no answer), may it be ``retryable`` (nothing was done), and the server's
    ``retry_after_s``."""

    accepted: bool
    retryable: bool
    retry_after_s: float | None = None


def http_outcome(status: int | None, retry_after_s: float | None = None) -> Outcome:
    """An HTTP attempt's :class:`Outcome`: ``status`` ``None`` when no answer came (connection failed).
    429 and 503 are retried, honouring their ``Retry-After`` (:func:`parse_retry_after`); an unreachable
    server is retried; nothing else is (a 400 will fail again, and a 500 or a timeout may have done the
    work already)."""
    if status is None:
        return Outcome(accepted=False, retryable=True)
    if status in RETRYABLE_STATUSES:
        return Outcome(accepted=False, retryable=True, retry_after_s=retry_after_s)
    return Outcome(accepted=True, retryable=False)


def parse_retry_after(value: str | None, now_s: float | None = None) -> float | None:
    """``Retry-After`` in seconds: delta-seconds (``"3"``) or an HTTP date (seconds from ``now_s``, Unix
    time, default now); ``None`` when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now_s is None else now_s))


@dataclass
class Attempts(Generic[T]):
    """How a call went: the last attempt's ``result`` (``None`` if the throttle refused the first), how many
    attempts were sent, why retrying stopped early (``"max_attempts"``, ``"budget"``, ``"throttled"``;
    ``None``: it succeeded, or its failure was not one to retry), and the seconds spent waiting."""

    result: T | None = None
    num_attempts: int = 0
    stopped_by: str | None = None
    waited_s: float = 0.0


class Retrier:
    """A :class:`RetryPolicy`, and optionally a :class:`RetryBudget` and an :class:`AdaptiveThrottle`,
    around an attempt. ``classify`` turns an attempt's result into an :class:`Outcome`."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        throttle: AdaptiveThrottle | None = None,
    ) -> None:
        self.policy, self.budget, self.throttle = policy or RetryPolicy(), budget, throttle

    def call(
        self, attempt: Callable[[], T], classify: Callable[[T], Outcome], sleep: Callable[[float], Any] = time.sleep
    ) -> Attempts[T]:
        """Run ``attempt`` until it succeeds or the rules say stop, sleeping with ``sleep`` between tries."""
        tries: Attempts[T] = Attempts()
        while self._may_send(tries):
            tries.result = attempt()
            delay_s = self._wait_before_next(classify(tries.result), tries)
            if delay_s is None:
                break
            sleep(delay_s)
            tries.waited_s += delay_s
        return tries

    async def acall(
        self,
        attempt: Callable[[], Awaitable[T]],
        classify: Callable[[T], Outcome],
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> Attempts[T]:
        """:meth:`call` for a coroutine function, waiting with ``await sleep(seconds)``."""
        tries: Attempts[T] = Attempts()
        while self._may_send(tries):
            tries.result = await attempt()
            delay_s = self._wait_before_next(classify(tries.result), tries)
            if delay_s is None:
                break
            await sleep(delay_s)
            tries.waited_s += delay_s
        return tries

    def _may_send(self, tries: Attempts) -> bool:
        """Before each attempt: count a new request for the budget; ask the throttle."""
        if tries.num_attempts == 0 and self.budget is not None:
            self.budget.record_request()
        if self.throttle is not None and not self.throttle.allow():
            tries.stopped_by = "throttled"
            return False
        tries.num_attempts += 1
        return True

    def _wait_before_next(self, outcome: Outcome, tries: Attempts) -> float | None:
        """After an attempt: the seconds to wait before the next one, or ``None`` to stop (and why)."""
        if self.throttle is not None and outcome.accepted:
            self.throttle.record_accept()
        if not outcome.retryable:
            return None
        if tries.num_attempts >= self.policy.max_attempts:
            tries.stopped_by = "max_attempts"
            return None
        if self.budget is not None and not self.budget.try_retry():
            tries.stopped_by = "budget"
            return None
        return self.policy.delay_s(tries.num_attempts - 1, outcome.retry_after_s)


# --- the OpenAI routes ---------------------------------------------------------------------------------------


class RequestFailed(Exception):
    """The call failed for good: ``status`` (``None``: no answer, or refused by the throttle), the server's
    error body, and the :class:`Attempts` that led there."""

    def __init__(self, message: str, status: int | None, body: Any, attempts: Attempts) -> None:
        super().__init__(message)
        self.status, self.body, self.attempts = status, body, attempts


def complete(
    base_url: str, model: str, prompt: str | list[int], retrier: Retrier | None = None, **options: Any
) -> dict:
    """``POST /v1/completions`` with retries; the response body. ``options``: more body fields
    (``max_tokens``, ``temperature``, …) and the call's own settings (see :func:`post`)."""
    return post(base_url, "/v1/completions", {"model": model, "prompt": prompt}, retrier, **options)


def chat(base_url: str, model: str, messages: list[dict], retrier: Retrier | None = None, **options: Any) -> dict:
    """``POST /v1/chat/completions`` with retries; the response body."""
    return post(base_url, "/v1/chat/completions", {"model": model, "messages": messages}, retrier, **options)


def post(
    base_url: str,
    route: str,
    body: dict,
    retrier: Retrier | None = None,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    sleep: Callable[[float], Any] = time.sleep,
    http: httpx.Client | None = None,
    **fields: Any,
) -> dict:
    """POST ``body`` (with ``fields`` added) to ``route``; return the JSON answer, or raise
    :class:`RequestFailed` once the retrier stops. ``timeout_s`` bounds each attempt."""
    retrier = retrier or Retrier()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = http or httpx.Client(timeout=timeout_s)

    def attempt() -> httpx.Response | httpx.TransportError:
        try:
            return client.post(base_url.rstrip("/") + route, json=body | fields, headers=headers)
        except httpx.TransportError as error:  # no answer: the server is down, or unreachable
            return error

    try:
        tries = retrier.call(attempt, _outcome_of_response, sleep)
    finally:
        if http is None:
            client.close()
    response = tries.result
    if isinstance(response, httpx.Response) and response.status_code < 400:
        return response.json()
    raise _failure(response, tries)


def _outcome_of_response(response: httpx.Response | httpx.TransportError) -> Outcome:
    if isinstance(response, httpx.TransportError):
        return http_outcome(None)
    return http_outcome(response.status_code, parse_retry_after(response.headers.get("retry-after")))


def _failure(response: httpx.Response | httpx.TransportError | None, tries: Attempts) -> RequestFailed:
    why = f" ({tries.stopped_by})" if tries.stopped_by else ""
    if response is None:
        return RequestFailed(f"refused by the client's adaptive throttle{why}", None, None, tries)
    if isinstance(response, httpx.TransportError):
        return RequestFailed(f"no answer after {tries.num_attempts} attempts{why}: {response}", None, None, tries)
    try:
        detail: Any = response.json()
    except ValueError:
        detail = response.text
    message = f"HTTP {response.status_code} after {tries.num_attempts} attempts{why}"
    return RequestFailed(message, response.status_code, detail, tries)


__all__ = [
    "AdaptiveThrottle",
    "Attempts",
    "Outcome",
    "RequestFailed",
    "Retrier",
    "RetryBudget",
    "RetryPolicy",
    "chat",
    "complete",
    "http_outcome",
    "parse_retry_after",
    "post",
]
