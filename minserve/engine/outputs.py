"""What a request gives back: its text, its tokens, why it stopped, and when each token came."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds on the monotonic clock (``time.perf_counter``).

    ``token_times_s[i]`` is when output token i was produced; the first one is the first token.
    """

    arrival_time_s: float
    token_times_s: list[float] = field(default_factory=list)
    finish_time_s: float | None = None
    first_scheduled_time_s: float | None = None  # when its first step began: the end of its queueing
    waiting_s: float = 0.0  # all the time it spent waiting: queued at first, and again after each preemption
    # Speculative decoding (all zero without it): the steps that verified drafts for this request, the draft
    # tokens they carried, and the ones the model kept.
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Fraction of this request's draft tokens the model kept (None if none were drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying step gave this request, on average: the drafts it kept plus the one the model
        sampled after them (vLLM's "mean acceptance length"; 1 means speculation gained nothing)."""
        steps = self.num_verify_steps
        return 1 + self.num_accepted_tokens / steps if steps else None

    @property
    def queue_s(self) -> float | None:
        """Time spent waiting before the first step that ran it."""
        first = self.first_scheduled_time_s
        return None if first is None else first - self.arrival_time_s

    @property
    def running_s(self) -> float | None:
        """Time between arrival and finish not spent waiting: in the running batch (``None`` until done)."""
        return None if self.finish_time_s is None else self.finish_time_s - self.arrival_time_s - self.waiting_s

    @property
    def first_token_time_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival → first output token."""
        first = self.first_token_time_s
        return None if first is None else first - self.arrival_time_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: arrival → finish."""
        return None if self.finish_time_s is None else self.finish_time_s - self.arrival_time_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        times = self.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM's benchmark defines it: (E2E − TTFT) / (n − 1).

        None for fewer than two tokens, or before the request finished.
        """
        n, e2e, ttft = len(self.token_times_s), self.e2e_s, self.ttft_s
        return None if n < 2 or e2e is None else (e2e - ttft) / (n - 1)


@dataclass
class RequestOutput:
    """One request's output so far, or final once ``finish_reason`` is set.

    ``finish_reason`` is ``"stop"`` (EOS or a stop string), ``"length"`` (max_tokens or the context),
    ``"cancelled"``, ``"deadline"``, or ``"error"`` when something failed inside this request alone (then
    ``error`` says what, and the engine and the other requests go on). ``text`` and ``token_ids`` are
    cumulative; ``delta_text`` is what became visible since the previous output of the same request (what a
    stream sends).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    delta_text: str = ""
    logprobs: list[float] | None = None  # of each chosen token, when SamplingParams.logprobs is set
    top_logprobs: list[dict[int, float]] | None = None  # per token, when SamplingParams.top_logprobs > 0
    error: str | None = None  # with finish_reason "error": a short description, for the caller
    num_preemptions: int = 0  # times the scheduler preempted it so far

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
