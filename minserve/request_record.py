"""One request's latencies, from its token timestamps: TTFT, ITL, TPOT and end-to-end (chapter 01).

:class:`RequestRecord` is a request as the SLO arithmetic of :mod:`minserve.slo` sees it: when it arrived,
when each output token came, how it ended. The functions compute each latency from the raw timestamps, so
the load tester (which sees chunks arrive) and the engine (:func:`record_from_metrics`) agree on the
definitions. Times are seconds on one monotonic clock; only their differences mean anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Status = Literal["ok", "failed", "cancelled"]
STATUSES: tuple[str, ...] = ("ok", "failed", "cancelled")


class HasTimestamps(Protocol):
    """What :class:`minserve.RequestMetrics` provides; :func:`record_from_metrics` needs nothing more."""

    arrival_time_s: float
    token_times_s: list[float]
    finish_time_s: float | None


@dataclass(frozen=True)
class RequestRecord:
    """One request as the SLO arithmetic sees it: when it arrived, when each output token came, how it ended.

    Invariants (checked): ``arrival_s ≤ token_times_s[0] ≤ … ≤ token_times_s[-1] ≤ finish_s``. ``finish_s``
    defaults to the last token's time (or the arrival, with no tokens). ``status`` is ``"ok"``, ``"failed"``
    (the server gave up: an error, a timeout) or ``"cancelled"`` (the client left first); a failed or
    cancelled request may have produced some tokens, and it never counts as good.
    """

    arrival_s: float
    token_times_s: tuple[float, ...] = ()
    finish_s: float | None = None
    status: Status = "ok"
    prompt_tokens: int = 0
    request_id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_times_s", tuple(self.token_times_s))
        if self.finish_s is None:
            last = self.token_times_s[-1] if self.token_times_s else self.arrival_s
            object.__setattr__(self, "finish_s", last)
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        times = (self.arrival_s, *self.token_times_s, self.finish_s)
        if any(later < earlier for earlier, later in itertools.pairwise(times)):
            raise ValueError("timestamps must not go backwards: arrival ≤ each token ≤ finish")

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, arrival → first output token; ``None`` when no token came."""
        return ttft_s(self.arrival_s, self.token_times_s)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the n − 1 gaps between consecutive output tokens."""
        return itl_s(self.token_times_s)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, (E2E − TTFT) / (n − 1); ``None`` for fewer than 2 tokens."""
        return tpot_s(self.arrival_s, self.token_times_s, self.finish_s)

    @property
    def e2e_s(self) -> float:
        """End-to-end latency, arrival → finish (the last byte the client receives)."""
        return self.finish_s - self.arrival_s

    @property
    def max_itl_s(self) -> float | None:
        """The longest stall between two tokens; ``None`` for fewer than 2 tokens."""
        gaps = self.itl_s
        return max(gaps) if gaps else None


def ttft_s(arrival_s: float, token_times_s: Sequence[float]) -> float | None:
    """Time to first token in seconds: first token time − arrival. ``None`` when there is no token."""
    return token_times_s[0] - arrival_s if token_times_s else None


def itl_s(token_times_s: Sequence[float]) -> list[float]:
    """Inter-token latencies in seconds: ``[t1 − t0, t2 − t1, …]``, n − 1 of them for n tokens."""
    return [later - earlier for earlier, later in itertools.pairwise(token_times_s)]


def tpot_s(arrival_s: float, token_times_s: Sequence[float], finish_s: float | None = None) -> float | None:
    """Time per output token in seconds, *excluding the first*: (E2E − TTFT) / (n − 1).

    The first token is left out because it carries the prefill (TTFT has its own target); what is left is
    the decode rate the reader feels. ``finish_s`` defaults to the last token's time. ``None`` for n < 2:
    a one-token answer has no decode phase, so it has no TPOT (and it cannot miss a TPOT target).
    """
    n = len(token_times_s)
    if n < 2:
        return None
    end_s = token_times_s[-1] if finish_s is None else finish_s
    e2e, ttft = end_s - arrival_s, token_times_s[0] - arrival_s
    return (e2e - ttft) / (n - 1)


def tpot_from_totals_s(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """TPOT from the three numbers a dashboard shows: (E2E − TTFT) / (n − 1), seconds; ``None`` for n < 2.

    The curriculum's example: TTFT 80 ms, E2E 2200 ms, 220 tokens → (2.2 − 0.08) / 219 s = 9.68 ms.
    """
    return None if output_tokens < 2 else (e2e_s - ttft_s) / (output_tokens - 1)


def record_from_metrics(
    metrics: HasTimestamps, status: Status = "ok", prompt_tokens: int = 0, request_id: str = ""
) -> RequestRecord:
    """A :class:`RequestRecord` from the engine's :class:`minserve.RequestMetrics` (same clock, seconds)."""
    return RequestRecord(
        arrival_s=metrics.arrival_time_s,
        token_times_s=tuple(metrics.token_times_s),
        finish_s=metrics.finish_time_s,
        status=status,
        prompt_tokens=prompt_tokens,
        request_id=request_id,
    )


def records_from_outputs(outputs: Iterable) -> list[RequestRecord]:
    """Records from ``LLM.generate``'s :class:`minserve.RequestOutput` list.

    A request that ran to its end (``stop`` or ``length``) is ``ok``; one its user cancelled is
    ``cancelled``; one the engine stopped at its deadline, failed with an error, or never finished is
    ``failed``: the user did not get a whole answer.
    """
    return [
        record_from_metrics(out.metrics, _status(out), len(out.prompt_token_ids), str(out.request_id))
        for out in outputs
    ]


def _status(output: Any) -> Status:
    if not output.finished:
        return "failed"
    if output.finish_reason == "cancelled":
        return "cancelled"
    return "failed" if output.finish_reason in ("deadline", "error") else "ok"
