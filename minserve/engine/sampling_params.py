"""What a caller asks of one request: how long, how random, which tokens to favour or avoid, when to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from minserve.engine.structured import StructuredOutputs

# torch.Generator.manual_seed takes any integer in this range (a signed or an unsigned 64-bit value).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API: more alternatives than this are refused
# The shortest timeout a request may ask for, seconds: below a millisecond no request could even be queued,
# and 5e-324 is a typo or a probe, not a deadline. The server publishes it in its schema.
MIN_TIMEOUT_S = 0.001
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2], as in OpenAI's API and vLLM's
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100], as in OpenAI's API (-100 bans a token in effect)
ONE_CHOICE = "minserve returns one choice per request; send the request that many times (with different seeds)"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, checked on construction, and frozen: a change is a new object
    (:meth:`with_max_tokens`, or :func:`dataclasses.replace`), checked again, so no one who holds a
    request's params sees them change under it.

    ``temperature`` 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 switch those filters off. A ``seed``
    makes a sampled request reproducible on its own, whatever else is in the batch. ``stop`` strings end the
    output (the matched string is not included); so does an end-of-sequence token unless ``ignore_eos``.
    ``logprobs`` asks for the log-probability of each chosen token (under the unscaled distribution), and
    ``top_logprobs`` (with it, 0–20) for that many of the most likely tokens at each step as well.

    Steering, with OpenAI's and vLLM's meanings (applied by :mod:`minserve.engine.penalties`, greedy rows
    included): ``logit_bias`` adds its value (−100 … 100) to a token's logit; ``repetition_penalty`` (> 0,
    1 is off) divides a positive logit of a token already in the prompt or the output by it and multiplies a
    negative one; ``frequency_penalty`` (−2 … 2) subtracts itself once per time a token was generated,
    ``presence_penalty`` (−2 … 2) once if it was generated at all; ``min_p`` (0 … 1, 0 is off) drops tokens
    less likely than ``min_p`` times the most likely one. ``n`` and ``best_of`` are accepted at 1 only:
    one request gives one output. ``min_tokens`` (vLLM's) holds back every end token, and the stop strings,
    until the output has that many tokens. ``structured_outputs`` constrains every token to a format
    (:mod:`minserve.engine.structured`), after the steering.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id → added to its logit
    min_tokens: int = 0  # no end token or stop string ends the output before this many tokens (vLLM's)
    n: int = 1  # outputs per request: only 1
    best_of: int | None = None  # candidates to pick the best of: only 1 (or None)
    structured_outputs: StructuredOutputs | None = None  # a format the output must follow (JSON, regex, …)

    def __post_init__(self) -> None:
        if self.stop is None or isinstance(self.stop, str):  # one shape from here on: a list
            object.__setattr__(self, "stop", [] if self.stop is None else [self.stop])
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
        self._check_steering()
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an integer in [0, max_tokens = {self.max_tokens}]",
            self.min_tokens,
        )
        _check(
            not (self.min_tokens and self.structured_outputs),
            "min_tokens",
            "0 with structured_outputs (a complete format leaves only the end token)",
            self.min_tokens,
        )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "None or a StructuredOutputs",
            self.structured_outputs,
        )
        _check(
            not (self.structured_outputs and self.ignore_eos),
            "ignore_eos",
            "False with structured_outputs (a finished format ends with the end token)",
            self.ignore_eos,
        )

    def _check_steering(self) -> None:
        """The penalties, ``min_p``, ``logit_bias``, and ``n`` / ``best_of`` (one output per request)."""
        span = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off)"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and abs(value) <= MAX_PENALTY, name, span, value)
        rep = self.repetition_penalty
        _check(_is_number(rep) and rep > 0, "repetition_penalty", "a number > 0 (1 is off)", rep)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1] (0 is off)", self.min_p)
        bias = self.logit_bias
        _check(
            bias is None or (isinstance(bias, dict) and all(_is_bias(t, v) for t, v in bias.items())),
            "logit_bias",
            f"None or a dict of token ids (integers ≥ 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            bias,
        )
        _check(_is_int(self.n) and self.n == 1, "n", f"1: {ONE_CHOICE}", self.n)
        best_of = self.best_of
        _check(best_of is None or (_is_int(best_of) and best_of == 1), "best_of", f"None or 1: {ONE_CHOICE}", best_of)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """These params with ``max_tokens`` lowered to at most ``max_tokens`` (and ``min_tokens`` with it), as
        the server's context clamp and its degraded modes lower it; ``self`` when nothing changes."""
        if max_tokens >= self.max_tokens:
            return self
        return replace(self, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty or bias changes this request's logits before it picks a token."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse a ``logit_bias`` for a token the vocabulary (``vocab_size`` ids) does not have."""
        outside = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        _check(not outside, "logit_bias", f"keyed by token ids below the vocabulary size {vocab_size}", outside)


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


def _is_bias(token_id: object, value: object) -> bool:
    return _is_int(token_id) and token_id >= 0 and _is_number(value) and abs(value) <= MAX_LOGIT_BIAS


def _check(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
