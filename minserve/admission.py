"""Admission control: which requests the server takes, and which it refuses at once with 429 and Retry-After.

A server past its capacity has two choices: queue everything, and let every request miss its SLO as the
queue grows without end, or refuse some requests *now*, cheaply, so the ones it takes still meet it. A
refusal costs a few milliseconds; a request admitted into a queue it cannot leave in time costs its whole
wait and then fails anyway.

A policy is one small idea, as a scheduling policy is (:mod:`minserve.engine.policies`):
``decide(request, queue) → None`` (admit) or a :class:`Refusal` saying why and when to come back. It reads
only the two facts objects below, so it is tested on synthetic queues without a server, the simulator
(:mod:`minserve.capacity.simulator`) runs the same policies the server does, and chapter 09's exercise
plugs its own in (``ServerConfig(admission=MyPolicy())``). It is a layer of its own, under the server and
the simulator alike, for that reason: both import it, and neither imports the other.

* :class:`QueueLength`: at most ``max_waiting_requests`` waiting. Simple, and blind to how long each one is.
* :class:`TokenBudget`: at most ``max_queued_prompt_tokens`` prompt tokens queued: the prefill work ahead.
* :class:`DeadlineAware`: refuse a request whose *predicted* time to first token already exceeds its
  budget: the server's TTFT SLO, or the request's own timeout where that is shorter. It waits for two
  things, whichever ends later: the prefill work ahead of it (at the engine's measured prefill rate),
  and, when the running batch is full, a free slot (the requests ahead of it, and one more, must finish
  first, at the measured finish rate); then its own prefill.

Every refusal carries ``retry_after_s``, computed from the queue: how long until the work in excess of the
limit has drained, at the measured rates. The server rounds it up to whole seconds for the
``Retry-After`` header (:func:`retry_after_header`).

The decision is exact under any burst because it is one synchronous call: the server reads the
:class:`QueueState`, decides, and joins the queue (``AsyncLLMEngine.add_request``) with no ``await`` between,
so no other request can slip in between the count and the join.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minserve.engine.service_rates import ServiceRates

if TYPE_CHECKING:
    from minserve.config import ServerConfig
    from minserve.engine.async_engine import AsyncLLMEngine
    from minserve.engine.step_report import EngineStats


@dataclass(frozen=True)
class RequestFacts:
    """What admission knows of one request: its prompt and ``max_tokens`` (tokens), and the timeout it
    sent itself, in seconds (``None``: it sent none)."""

    prompt_tokens: int
    max_tokens: int
    timeout_s: float | None = None


@dataclass(frozen=True)
class QueueState:
    """The server's load as its front end sees it at this instant.

    ``num_waiting``: requests not yet running (queued in the core, or on their way to it); ``num_running``:
    requests in the running batch; ``queued_prompt_tokens``: prompt tokens of the requests that have no
    first token yet (the prefill work ahead of a newcomer); ``kv_usage``: fraction of KV blocks in use
    (0–1); ``rates``: the engine's measured prefill rate, decode step time and finish rate;
    ``max_num_seqs``: the running batch's slots (None: unknown).
    """

    num_waiting: int
    num_running: int
    queued_prompt_tokens: int
    rates: ServiceRates
    kv_usage: float = 0.0
    max_num_seqs: int | None = None

    FULL_KV_USAGE = 0.95  # past this share of blocks in use, a newcomer waits for memory as for a slot

    @property
    def num_requests(self) -> int:
        """Requests in the server: running and waiting."""
        return self.num_waiting + self.num_running

    @property
    def free_slots(self) -> int | None:
        """Requests the running batch can still take now (None: its size is unknown). A cache nearly full of
        blocks takes none, whatever the batch size says."""
        if self.max_num_seqs is None:
            return None
        return 0 if self.kv_usage >= self.FULL_KV_USAGE else max(0, self.max_num_seqs - self.num_running)

    def slot_wait_s(self) -> float:
        """Seconds until a newcomer has a slot in the running batch: the requests waiting ahead of it and one
        more must finish first, past the free slots, at the measured finish rate (0 while slots are free, or
        when the batch size or the finish rate is not known yet)."""
        free = self.free_slots
        if free is None:
            return 0.0
        return self.rates.finishing_s(self.num_waiting + 1 - free) or 0.0

    @classmethod
    def of_counts(
        cls, stats: EngineStats, queued_prompt_tokens: int, rates: ServiceRates, max_num_seqs: int | None
    ) -> QueueState:
        """The state from an engine's counts: the one rule behind the server's view (:meth:`of`) and the
        simulator's (:mod:`minserve.capacity.simulator`), so both policies see the same numbers."""
        kv_usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        return cls(stats.num_waiting, stats.num_running, queued_prompt_tokens, rates, kv_usage, max_num_seqs)

    @classmethod
    def of(cls, engine: AsyncLLMEngine) -> QueueState:
        """The state of ``engine`` now (synchronous: nothing it reads waits on the core)."""
        return cls.of_counts(
            engine.stats(), engine.num_queued_prompt_tokens, engine.rates, engine.config.scheduler.max_num_seqs
        )


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused (``reason``: the error's ``code`` and the ``requests_rejected`` label), when
    a retry could be admitted (``retry_after_s``, predicted from the queue), and a message for the client."""

    reason: str
    retry_after_s: float
    message: str


def budget_of(request: RequestFacts, ttft_slo_s: float) -> float:
    """The seconds a request's first token may take: the server's TTFT SLO, or the request's own timeout
    where that is shorter. A longer timeout does not loosen the SLO: the server keeps its queue short for
    every request, and a client that can wait a minute does not get to fill it with a minute of work."""
    return ttft_slo_s if request.timeout_s is None else min(ttft_slo_s, request.timeout_s)


def retry_after_header(retry_after_s: float, floor_s: int = 1) -> str:
    """The ``Retry-After`` value: whole seconds, rounded up, at least ``floor_s`` and at least 1."""
    return str(max(1, floor_s, math.ceil(retry_after_s)))


class AdmissionPolicy:
    """The interface: ``decide(request, queue)`` returns ``None`` to admit, or a :class:`Refusal`."""

    name = "admission"

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: ServerConfig) -> AdmissionPolicy:
        """The policy with its limits from the server's settings (``minserve serve --admission NAME``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class QueueLength(AdmissionPolicy):
    """At most ``max_waiting_requests`` waiting (0: none; every request finds the queue full)."""

    name = "queue-length"

    def __init__(self, max_waiting_requests: int) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be ≥ 0, got {max_waiting_requests!r}")
        self.max_waiting_requests = max_waiting_requests

    @classmethod
    def from_config(cls, config: ServerConfig) -> QueueLength:
        return cls(config.max_waiting_requests)

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        return self.refuse_full(queue)

    def refuse_full(self, queue: QueueState) -> Refusal | None:
        """The refusal of any request while the queue is full, whatever it asks for; ``None`` below the limit."""
        if queue.num_waiting < self.max_waiting_requests:
            return None
        # One more request than the excess must leave the queue; each brings, on average, the mean prompt.
        leaving = queue.num_waiting - self.max_waiting_requests + 1
        mean_prompt_tokens = queue.queued_prompt_tokens / queue.num_waiting if queue.num_waiting else 0
        message = f"{queue.num_waiting} requests are waiting, the limit is {self.max_waiting_requests}; retry later"
        return Refusal("queue_full", queue.rates.prefill_s(round(leaving * mean_prompt_tokens)), message)

    def __repr__(self) -> str:
        return f"QueueLength({self.max_waiting_requests})"


class TokenBudget(AdmissionPolicy):
    """At most ``max_queued_prompt_tokens`` prompt tokens queued, this request's included. A queue with
    nothing in it admits any prompt, so one longer than the budget is not refused forever."""

    name = "token-budget"

    def __init__(self, max_queued_prompt_tokens: int) -> None:
        if max_queued_prompt_tokens < 1:
            raise ValueError(f"max_queued_prompt_tokens must be ≥ 1, got {max_queued_prompt_tokens!r}")
        self.max_queued_prompt_tokens = max_queued_prompt_tokens

    @classmethod
    def from_config(cls, config: ServerConfig) -> TokenBudget:
        return cls(config.max_queued_prompt_tokens)

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        queued = queue.queued_prompt_tokens + request.prompt_tokens
        if queue.queued_prompt_tokens == 0 or queued <= self.max_queued_prompt_tokens:
            return None
        excess = queued - self.max_queued_prompt_tokens
        message = (f"{queue.queued_prompt_tokens} prompt tokens are queued; with this request's "
                   f"{request.prompt_tokens} that is over the budget of {self.max_queued_prompt_tokens}")  # fmt: skip
        return Refusal("token_budget", queue.rates.prefill_s(excess), message)

    def __repr__(self) -> str:
        return f"TokenBudget({self.max_queued_prompt_tokens})"


class DeadlineAware(AdmissionPolicy):
    """Refuse a request that would miss its time to first token before it even starts.

    Predicted TTFT = max(prompt tokens queued ahead / measured prefill rate, the wait for a slot in a full
    batch, :meth:`QueueState.slot_wait_s`) + its own prompt / prefill rate. The two waits overlap (requests
    ahead are prefilled as they get their slots), so the later one counts. The budget is ``ttft_slo_s``, or
    the request's own timeout where that is shorter, times ``headroom``. With nothing ahead of it, waiting
    cannot help, so the request is admitted whatever the prediction.

    Why a headroom: under overload the queue settles where the prediction meets the budget, and a prediction
    is a mean: the actual TTFTs scatter around it, so with the whole budget about half the admitted requests
    miss. The server aims at ``ServerConfig.admission_headroom`` (0.5) of it.
    """

    name = "deadline"

    def __init__(self, ttft_slo_s: float, headroom: float = 1.0) -> None:
        if not ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0 seconds, got {ttft_slo_s!r}")
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], the share of the budget to aim at, got {headroom!r}")
        self.ttft_slo_s, self.headroom = ttft_slo_s, headroom

    @classmethod
    def from_config(cls, config: ServerConfig) -> DeadlineAware:
        return cls(config.ttft_slo_ms / 1e3, config.admission_headroom)

    def predicted_ttft_s(self, request: RequestFacts, queue: QueueState) -> float:
        ahead_s = max(queue.rates.prefill_s(queue.queued_prompt_tokens), queue.slot_wait_s())
        return ahead_s + queue.rates.prefill_s(request.prompt_tokens)

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        budget_s = self.headroom * budget_of(request, self.ttft_slo_s)
        predicted_s = self.predicted_ttft_s(request, queue)
        if (queue.queued_prompt_tokens == 0 and queue.slot_wait_s() == 0) or predicted_s <= budget_s:
            return None
        message = (f"predicted time to first token {predicted_s:.2f} s ({queue.queued_prompt_tokens} prompt "
                   f"tokens queued ahead at {queue.rates.prefill_tokens_per_s:.0f} tokens/s, "
                   f"{queue.slot_wait_s():.2f} s until a slot frees) exceeds {budget_s:g} s")  # fmt: skip
        if self.headroom < 1:
            message += f" ({self.headroom:g} of the {budget_s / self.headroom:g} s budget: predictions scatter)"
        return Refusal("ttft_slo", predicted_s - budget_s, message)  # once that much work has drained

    def __repr__(self) -> str:
        return f"DeadlineAware(ttft_slo_s={self.ttft_slo_s}, headroom={self.headroom})"


class FirstRefusal(AdmissionPolicy):
    """Several policies in turn: the first that refuses decides."""

    name = "first-refusal"

    def __init__(self, *policies: AdmissionPolicy) -> None:
        self.policies = policies

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        for policy in self.policies:
            refusal = policy.decide(request, queue)
            if refusal is not None:
                return refusal
        return None

    def __repr__(self) -> str:
        return f"FirstRefusal{self.policies!r}"


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {p.name: p for p in (QueueLength, TokenBudget, DeadlineAware)}


def make_admission(config: ServerConfig) -> AdmissionPolicy:
    """The policy ``config.admission`` names (with its limits from ``config``), or the object it holds.

    A named policy other than ``queue-length`` runs behind the queue-length limit, which stays a hard bound
    on the queue under every policy. An object is used as it is: it is the whole policy.
    """
    chosen = config.admission
    if isinstance(chosen, AdmissionPolicy):
        return chosen
    if chosen not in ADMISSION_POLICIES:
        raise ValueError(f"admission must be one of {sorted(ADMISSION_POLICIES)} or an AdmissionPolicy, got {chosen!r}")
    policy = ADMISSION_POLICIES[chosen].from_config(config)
    return policy if isinstance(policy, QueueLength) else FirstRefusal(QueueLength.from_config(config), policy)


def queue_limit(config: ServerConfig) -> QueueLength | None:
    """The queue-length limit every named policy keeps, which the server applies once more before it tokenizes
    a request: a full queue then refuses at once, without the tokenizer's work in a worker thread (which waits
    for a core while the engine's step holds both). ``None`` for a policy object, which decides alone."""
    return None if isinstance(config.admission, AdmissionPolicy) else QueueLength.from_config(config)


__all__ = [
    "ADMISSION_POLICIES",
    "AdmissionPolicy",
    "DeadlineAware",
    "FirstRefusal",
    "QueueLength",
    "QueueState",
    "Refusal",
    "RequestFacts",
    "TokenBudget",
    "budget_of",
    "make_admission",
    "queue_limit",
    "retry_after_header",
]
