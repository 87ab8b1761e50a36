"""Chapter 09 exercise: an admission controller that keeps the SLO when the server is overloaded.

Fill in every method below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch09

A server sent more than it can serve has two choices. It can queue everything: the queue then grows
without end, and every request behind it misses its time-to-first-token (TTFT) target, the ones it serves
included. Or it can refuse some requests *now*, in a few milliseconds, with ``429 Too Many Requests`` and a
``Retry-After`` header, so that the requests it does take still meet their target. Your controller decides,
for each request as it arrives, from a snapshot of the queue, whether it can still be served in time.

It plugs into the real server: ``ServerConfig(admission=SLOAdmission(ttft_slo_s=1.0))``. The server calls
``decide(request, queue)`` once per request and turns a :class:`Refusal` into a 429 whose ``Retry-After``
is ``retry_after_s`` rounded up to whole seconds. What you read:

- ``request`` (:class:`RequestFacts`): ``prompt_tokens``, ``max_tokens``, and ``timeout_s``, the timeout
  the client sent itself (``None`` if it sent none);
- ``queue`` (:class:`QueueState`): ``num_waiting`` (requests not running yet), ``num_running`` (in the
  running batch), ``queued_prompt_tokens`` (prompt tokens of the requests with no first token yet: the
  prefill work ahead of a newcomer), ``kv_usage`` (share of KV blocks in use, 0–1), ``max_num_seqs`` (the
  batch's slots; ``None`` if unknown) and ``rates``, measured from the engine's recent steps:
  ``rates.prefill_tokens_per_s`` (always > 0) and ``rates.finished_per_s`` (requests finishing per second;
  ``None`` until one has finished).

A newcomer waits for two things, and they overlap (a request ahead is prefilled as soon as it gets a slot),
so the later one counts: the prefill work queued ahead of it, and, when the batch is full, a free slot.
Then its own prompt is prefilled. Your prediction is only an estimate. Under overload the queue settles
where the prediction equals the budget, so the admitted requests' TTFTs scatter *around* the budget: aim
at the SLO itself and about half of them miss it. So aim at a share of it, ``headroom`` (0.5: half).

You are graded in the discrete-event simulator (:mod:`minserve.capacity.simulator`: the engine's own
scheduler on a virtual clock, so grading is deterministic) at three times the engine's capacity, against no
admission at all, and once on the real server:

- on **goodput** (requests per second that met the SLO): at least 4 × what the server without admission
  achieves; a policy that admits everything or refuses everything gets nowhere near it;
- on **the SLO of the admitted requests**: their p99 TTFT within the SLO;
- on **refusing fast**: of the requests that miss the SLO, at least 80% must be refused at the door, at
  once, rather than admitted and served late;
- on a **Retry-After** that is positive and finite, computed from the queue;
- on the **real server** under a burst: your policy's refusals come back as 429 with a ``Retry-After``.

Import only the standard library and the four interface names imported below: the grader refuses a file
that imports anything else from minserve (the server's own ``DeadlineAware`` included), and your class must
be your own, not a subclass of one of minserve's policies.
"""

from __future__ import annotations

from minserve.admission import AdmissionPolicy, QueueState, Refusal, RequestFacts


class SLOAdmission(AdmissionPolicy):
    """Admit a request only if its predicted time to first token fits ``headroom`` × its budget.

    ``ttft_slo_s``: the server's TTFT target, seconds; a request that sent a shorter ``timeout_s`` of its own
    is judged against that instead. ``headroom``: the share of the budget to aim at, in (0, 1]. ``__init__`` raises
    ``ValueError`` for a ``ttft_slo_s`` that is not a positive finite number, or a ``headroom`` outside
    (0, 1].
    """

    name = "slo-admission"

    def __init__(self, ttft_slo_s: float, headroom: float = 0.5) -> None:
        self.ttft_slo_s, self.headroom = ttft_slo_s, headroom

    def prefill_wait_s(self, queue: QueueState) -> float:
        """Seconds to prefill the prompt tokens queued ahead: ``queued_prompt_tokens / prefill_tokens_per_s``."""
        raise NotImplementedError

    def slot_wait_s(self, queue: QueueState) -> float:
        """Seconds until a newcomer has a slot in the running batch.

        Free slots: ``max_num_seqs − num_running`` (never below 0), and none at all when the KV cache is
        nearly full (``kv_usage ≥ 0.95``: a newcomer then waits for memory as for a slot). The requests
        waiting ahead and the newcomer itself, ``num_waiting + 1``, need slots; those beyond the free ones
        must wait for running requests to finish, at ``rates.finished_per_s``. 0.0 when nothing needs to
        wait, and when ``max_num_seqs`` or the finish rate is not known (``None``, or 0).
        """
        raise NotImplementedError

    def predicted_ttft_s(self, request: RequestFacts, queue: QueueState) -> float:
        """The later of the two waits (:meth:`prefill_wait_s`, :meth:`slot_wait_s`), plus the request's own
        prompt's prefill (its ``prompt_tokens`` at the measured prefill rate), seconds."""
        raise NotImplementedError

    def budget_s(self, request: RequestFacts) -> float:
        """``headroom`` × ``ttft_slo_s``, or × the request's own ``timeout_s`` where the client sent a shorter
        one, seconds. A longer timeout does not loosen the SLO: the server keeps its queue short for everyone."""
        raise NotImplementedError

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        """``None`` to admit; else ``Refusal("ttft_slo", retry_after_s, message)``.

        Admit when nothing is ahead (no queued prompt tokens and no wait for a slot: waiting cannot make it
        faster, so refusing would only lose it) or when the prediction is within the budget. Otherwise
        refuse, with ``retry_after_s`` = prediction − budget: by then that much of the work ahead has been
        served, and the same request would be admitted. The message says why, for the client.
        """
        raise NotImplementedError
