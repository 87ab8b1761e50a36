"""Chapter 05 exercise: batching arithmetic, then a scheduling policy for the real scheduler.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch05

Part 1 counts engine steps. Every request asks for ``n`` output tokens and produces one per step: the step
that prefills its (short) prompt gives its first token, so it holds a seat in the batch for exactly ``n``
steps. A batch has ``batch_size`` seats. The requests arrive all at once and are served in the order given.

Part 2 is a policy for minserve's scheduler (``minserve/engine/policies.py``). A policy is a *sort key*:
every step the scheduler serves running requests, and admits waiting ones, in increasing ``key(seq)``
order, and when memory runs out it preempts the running request with the largest key. The token budget,
the KV blocks, chunked prefill and preemption are the scheduler's business, the same for every policy. What
``key`` may read on a :class:`minserve.engine.sequence.Sequence`:

- ``seq.num_uncomputed_tokens``: tokens still to run through the model before its next token can be
  sampled: the whole prompt for a new request, what is left of it during a chunked prefill, 1 for a
  decode, prompt + output again for a request preempted by recompute;
- ``seq.steps_waited``: steps it has spent waiting so far (queued, or preempted), never reset;
- ``seq.arrival_index``: 0 for the first request the engine received, 1 for the next, …;
- ``seq.prompt_token_ids``, ``seq.output_token_ids``, ``seq.priority`` (not needed here).

Your policy is graded inside the real :class:`minserve.engine.scheduler.Scheduler`, in the discrete-event
simulator (:mod:`minserve.capacity.simulator`, the scheduler on a virtual clock with a fixed step-cost model,
so grading is deterministic) and once on the real engine:

- on **goodput**: on a workload where a fifth of the prompts are about 30 times longer than the rest, near
  the engine's capacity, it must serve at least 1.5 × as many requests per second within the SLO as FCFS;
- on **starvation**: under a steady stream of short requests, more than the engine can serve, a long
  prompt that arrives among them must still finish within a bounded number of steps.

Import only the standard library and the two interfaces imported below: the grader refuses a file that
imports anything else from minserve (its scheduler and simulator included).
"""

from __future__ import annotations

from collections.abc import Sequence

from minserve.engine.policies import Policy
from minserve.engine.sequence import Sequence as EngineSequence

# --- part 1: counting steps ---------------------------------------------------------------------------------


def static_batching_steps(output_lengths: Sequence[int], batch_size: int) -> int:
    """Steps to serve the requests by static batching.

    The first ``batch_size`` requests form a batch, which runs until its longest request is done; only then
    does the next ``batch_size`` form the next batch, and so on (the last batch may be smaller). A seat
    whose request has finished stays empty until the whole batch is done. ``[3, 1, 4, 1, 5]`` in batches of
    2 takes 3 + 4 + 5 = 12 steps. Raises ``ValueError`` when ``batch_size < 1`` or a length is below 1.
    """
    raise NotImplementedError


def continuous_batching_steps(output_lengths: Sequence[int], batch_size: int) -> int:
    """Steps to serve the requests by continuous (iteration-level) batching, first come first served.

    A request's seat is handed to the next request in line at the step right after it finishes, so no
    seat is ever empty while someone waits. ``[3, 1, 4, 1, 5]`` with 2 seats: 3 and 1 start at once; the
    1 is done after step 1, and 4 takes its seat (steps 2–5); 3 is done after step 3 and 1 takes its seat
    (step 4); then 5 (steps 5–9): 9 steps. Raises ``ValueError`` like :func:`static_batching_steps`.
    An empty list takes 0 steps in both.
    """
    raise NotImplementedError


def aging_bound_steps(long_prompt_tokens: int, short_prompt_tokens: int, aging_tokens_per_step: float) -> float:
    """After how many steps of waiting a long prompt ranks ahead of a short prompt that has just arrived.

    Under shortest-first with aging, a waiting request's key is ``tokens − aging_tokens_per_step × steps
    waited`` (ties go to the earlier arrival). Return the smallest number of steps ``w`` (a float) at which
    the long one's key is no larger than a newcomer's: ``(long − short) / aging``. 0.0 when the long prompt
    is not longer; ``math.inf`` when aging is 0 and it is (it would wait forever behind a stream of short
    ones: starvation). Raises ``ValueError`` for a negative aging or a prompt of fewer than 1 token.
    """
    raise NotImplementedError


# --- part 2: a policy -------------------------------------------------------------------------------------


class FairShortestFirst(Policy):
    """Shortest remaining work first, with aging so that nothing starves.

    ``key(seq)`` must order requests so that:

    - among requests that have not waited, the one with fewer tokens left to compute
      (``seq.num_uncomputed_tokens``) comes first: short prompts go before long ones, a decode (1 token)
      before any prompt, and a long prompt half prefilled counts only what is left of it;
    - every step a request has waited counts as ``aging_tokens_per_step`` fewer tokens;
    - equal keys go to the earlier arrival (``seq.arrival_index``), so the order is total and stable.

    Return a tuple (the scheduler sorts by it). With ``aging_tokens_per_step=0`` it is plain
    shortest-remaining-first. ``__init__`` raises ``ValueError`` for a negative (or NaN) aging.
    """

    name = "fair-shortest-first"

    def __init__(self, aging_tokens_per_step: float = 1.0) -> None:
        self.aging_tokens_per_step = aging_tokens_per_step

    def key(self, seq: EngineSequence) -> tuple[float, ...]:
        raise NotImplementedError
