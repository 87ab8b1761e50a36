"""What a caller asks of one request: how long, how random, when to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# torch.Generator.manual_seed takes any integer in this range (a signed or an unsigned 64-bit value).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API: more alternatives than this are refused
# The shortest timeout a request may ask for, seconds: below a millisecond no request could even be queued,
# and 5e-324 is a typo or a probe, not a deadline. The server publishes it in its schema.
MIN_TIMEOUT_S = 0.001


@dataclass
class SamplingParams:
    """Per-request generation settings, checked on construction.

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 switch those filters off. A ``seed``
    makes a sampled request reproducible on its own, whatever else is in the batch. ``stop`` strings end the
    output (the matched string is not included); so does an end-of-sequence token unless ``ignore_eos``.
    ``logprobs`` asks for the log-probability of each chosen token (under the unscaled distribution), and
    ``top_logprobs`` (with it, 0–20) for that many of the most likely tokens at each step as well.
    Numbers must be finite: ``inf`` and ``nan`` are refused, like every other value out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)  # normalised to a list
    ignore_eos: bool = False
    logprobs: bool = False  # report the log-probability of each chosen token
    top_logprobs: int = 0  # and of this many most likely alternatives (needs logprobs)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer ≥ 1", self.max_tokens)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number ≥ 0", self.temperature)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "an integer ≥ 1, or 0/-1 for off", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(
            self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
            "seed",
            f"None or an integer in [{SEED_MIN}, {SEED_MAX}]",
            self.seed,
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)
        _check(isinstance(self.logprobs, bool), "logprobs", "True or False", self.logprobs)
        _check(
            _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            self.top_logprobs,
        )
        _check(self.logprobs or not self.top_logprobs, "top_logprobs", "0 unless logprobs is set", self.top_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_request_options(priority: object, deadline_s: object) -> None:
    """The rule for a request's ``priority`` (an integer, lower runs first) and ``deadline_s`` (``None``, or
    a finite number of seconds ≥ ``MIN_TIMEOUT_S``): the offline API and the engine core check by it, and the
    server's schema states the same bounds."""
    if not _is_int(priority):
        raise ValueError(f"priority must be an integer (lower runs first), got {priority!r}")
    if deadline_s is not None and not (_is_number(deadline_s) and deadline_s >= MIN_TIMEOUT_S):
        raise ValueError(f"deadline_s must be None or a number of seconds ≥ {MIN_TIMEOUT_S:g}, got {deadline_s!r}")


def _is_number(value: object) -> bool:
    """A finite int or float (bools are ints to Python, not numbers to a caller)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
