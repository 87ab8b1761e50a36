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

Part 3 is the scheduler's step itself: :class:`StepScheduler` takes the place of the engine's scheduler in
the real engine core, and you write its ``schedule()``. Every step it decides which requests run and how
many of their tokens, under a budget of ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences;
it splits a prompt longer than what is left of the budget into chunks over several steps; it admits a
waiting request only when the block manager has the KV blocks for it; and when a running request needs a
block and none is free, it preempts one (by recompute: its blocks are freed, it waits again, and its
prompt and the tokens it produced are computed again once readmitted). It is graded in the simulator and in
the real engine:

- **same outputs**: on the real engine, chunking and preempting, greedy outputs equal the engine's own
  scheduler's;
- **memory**: after every step the block manager's invariants hold (no block leaked, freed twice or owned
  twice), and when everything has finished every block is free again;
- **latency**: when a 3000-token prompt arrives among running decodes, their p99 inter-token latency on the
  simulator's virtual clock stays within 1.25 × the engine's scheduler's;
- **goodput**: on a mixed workload near capacity, at least 0.95 × the engine's scheduler's.

Import only the standard library and the interfaces imported below (a policy's base class, the sequence,
the block manager, the batch type the engine core consumes): the grader refuses a file that imports
anything else from minserve (its scheduler and simulator included).
"""

from __future__ import annotations

from collections.abc import Sequence

from minserve.engine.batch import ScheduledBatch
from minserve.engine.block_manager import BlockManager
from minserve.engine.policies import Policy, make_policy
from minserve.engine.sequence import Sequence as EngineSequence
from minserve.engine.sequence import SequenceStatus

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


# --- part 3: the scheduler's step -------------------------------------------------------------------------


class StepScheduler:
    """A scheduler for the real engine core, preempting by recompute. You write :meth:`schedule`.

    The engine core builds it with the arguments below and then, every step, calls ``schedule()``, runs the
    batch it returns through the model, calls ``complete(seq, n)`` for every sequence of the batch and
    ``finish(seq)`` for every request that ended. Between steps it reads ``waiting``, ``running``,
    ``swapped`` (always empty here) and ``num_preemptions``. All but ``schedule`` is written for you.

    What a :class:`~minserve.engine.sequence.Sequence` tells you: ``num_tokens`` (prompt and output so far),
    ``num_computed_tokens`` (those whose KV is in its blocks), ``num_uncomputed_tokens`` (the rest: the
    whole prompt for a new request, what is left of it mid-prefill, 1 for a decode), ``token_ids``,
    ``block_table`` and ``status``. What the block manager (``self.block_manager``, chapter 04's idea) offers:
    ``blocks_needed(seq, n)`` (more blocks ``seq`` needs to hold ``n`` more tokens), ``can_allocate(k)``,
    ``allocate(seq, n)`` (grows its table; raises when blocks are short, so ask first), ``free(seq)`` (gives
    back its blocks and forgets its computed tokens), ``block_size``, and the prefix cache:
    ``find_cached_prefix(token_ids)`` (the cached blocks of a prompt's longest cached prefix) and
    ``share_cached_prefix(seq, blocks)`` (hands them to a new sequence, whose tokens there count as
    computed). A cached block nobody holds sits among the free blocks: sharing it takes it from there.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str | Policy = "fcfs",
        enable_chunked_prefill: bool = True,
        preemption_mode: object = "recompute",
    ) -> None:
        if getattr(preemption_mode, "name", preemption_mode) != "recompute":
            raise ValueError(f"this scheduler preempts by recompute only, not {preemption_mode!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = make_policy(policy)  # policy.key(seq): lower is served (and admitted) first
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[EngineSequence] = []  # new requests and preempted ones, holding no blocks
        self.running: list[EngineSequence] = []  # admitted: they hold blocks
        self.swapped: list[EngineSequence] = []  # always empty: nothing is swapped out
        self.num_preemptions = 0
        self.num_steps = 0

    def add(self, seq: EngineSequence) -> None:
        """A new request joins the waiting queue."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self.waiting or self.running)

    def complete(self, seq: EngineSequence, num_new_tokens: int, num_accepted: int = 0) -> bool:
        """After the step ran ``num_new_tokens`` of ``seq``: they are computed, and the blocks they filled are
        named for the prefix cache. True when the step sampled a token for it."""
        samples = seq.completes_with(num_new_tokens)
        seq.num_computed_tokens += num_new_tokens - (len(seq.draft_token_ids) - num_accepted)
        seq.draft_token_ids.clear()
        self.block_manager.name_full_blocks(seq)
        return samples

    def finish(self, seq: EngineSequence) -> None:
        """A request ended (finished, cancelled or failed): out of the queues, its blocks freed."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        """Decide this step's batch: which sequences run, and how many of their tokens each.

        Add each chosen sequence with ``batch.add(seq, num_tokens)`` after giving it the blocks those tokens
        need. The batch must keep to these rules:

        - at most ``max_num_batched_tokens`` tokens in all and ``max_num_seqs`` running sequences; a sequence
          runs at most its ``num_uncomputed_tokens``, and at least 1;
        - running sequences are served before waiting ones are admitted, in the policy's order; a decode
          needs one token, a prompt being prefilled gets what is left of the budget, so a prompt longer than
          the budget is prefilled in chunks over several steps (with ``enable_chunked_prefill`` off, whole);
        - a waiting request is admitted (status ``RUNNING``, moved to ``running``, listed in
          ``batch.admitted``) only when the blocks for its first chunk are free, counting the cached prefix
          blocks it can share; if the first in the policy's order does not fit, nobody overtakes it;
        - when a running sequence needs a block and none is free, preempt the running sequence the policy
          ranks last (perhaps itself): free its blocks, set its status to ``WAITING``, put it back in
          ``waiting``, list it in ``batch.preempted`` and count it in ``num_preemptions`` (and in its own
          ``num_preemptions``). A step that preempts admits nobody;
        - ``steps_waited`` of every waiting sequence goes up by one each step (aging policies read it).

        Never allocate without asking the block manager first; every block a sequence holds is freed
        exactly once (here on preemption, or by :meth:`finish`).
        """
        raise NotImplementedError
