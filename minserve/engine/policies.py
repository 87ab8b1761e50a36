"""Scheduling policies: who is admitted first, who is served first, and who is preempted when memory runs out.

A policy is one small idea: a *sort key*. The scheduler admits waiting requests, and serves running ones, in
increasing key order; when it must preempt, it takes the running request with the largest key. Everything
else (the token budget, the block accounting, chunking, preemption) is the scheduler's and the same for
every policy.

* :class:`FCFS`: first come, first served, by arrival order. Nobody starves; a long prompt at the head of
  the queue makes everyone behind it wait (head-of-line blocking).
* :class:`PriorityFirst`: a request's ``priority`` (lower runs first, as in vLLM), then arrival. A steady
  stream of urgent requests can starve the rest: that is what priorities mean.
* :class:`ShortestPromptFirst`: the shortest prompt first, which minimizes the mean wait, with *aging*: every
  step a request waits lowers its key by ``aging_tokens_per_step``, so a long prompt that has waited
  ``(its length − a short one's) / aging`` steps outranks any newcomer. Its wait is bounded; without aging
  it would not be.
* :class:`StaticBatching`: the baseline continuous batching replaced. A batch is filled from the queue
  (FCFS) only when nothing runs, and runs until every request in it has finished; nobody joins midway.
"""

from __future__ import annotations

from minserve.engine.sequence import Sequence


class Policy:
    """The interface: ``key(seq)`` orders requests (lower first), ``admits_while_running`` says whether new
    requests may join a batch that is already running."""

    name = "policy"
    admits_while_running = True

    def key(self, seq: Sequence) -> tuple[float, ...]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFS(Policy):
    name = "fcfs"

    def key(self, seq: Sequence) -> tuple[float, ...]:
        return (seq.arrival_index,)


class PriorityFirst(Policy):
    name = "priority"

    def key(self, seq: Sequence) -> tuple[float, ...]:
        return (seq.priority, seq.arrival_index)


class ShortestPromptFirst(Policy):
    """Shortest prompt first, aged: the key is ``prompt tokens − aging_tokens_per_step × steps waited``."""

    name = "spf"

    def __init__(self, aging_tokens_per_step: float = 1.0) -> None:
        if not aging_tokens_per_step >= 0:
            raise ValueError(f"aging_tokens_per_step must be ≥ 0, got {aging_tokens_per_step!r}")
        self.aging_tokens_per_step = aging_tokens_per_step

    def key(self, seq: Sequence) -> tuple[float, ...]:
        return (len(seq.prompt_token_ids) - self.aging_tokens_per_step * seq.steps_waited, seq.arrival_index)

    def __repr__(self) -> str:
        return f"ShortestPromptFirst(aging_tokens_per_step={self.aging_tokens_per_step})"


class StaticBatching(FCFS):
    name = "static"
    admits_while_running = False


# One class for each name the configuration declares (minserve.config.scheduler.SCHEDULING_POLICIES).
POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FCFS, PriorityFirst, ShortestPromptFirst, StaticBatching)}


def make_policy(policy: str | Policy) -> Policy:
    """A policy object from its name (``fcfs``, ``priority``, ``spf``, ``static``), or the object itself."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)} or a Policy, got {policy!r}")
    return POLICIES[policy]()
