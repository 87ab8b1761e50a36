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
is ``retry_after_s`` rounded up to whole seconds. What you can read:

- ``request`` (:class:`RequestFacts`): ``prompt_tokens``, ``max_tokens``, and ``timeout_s``, the timeout
  the client sent itself (``None`` if it sent none);
- ``queue`` (:class:`QueueState`): ``num_waiting`` (requests not running yet), ``num_running`` (in the
  running batch), ``queued_prompt_tokens`` (prompt tokens of the requests with no first token yet),
  ``kv_usage`` (share of KV blocks in use, 0–1), ``max_num_seqs`` (the batch's slots; ``None`` if unknown)
  and ``rates``, measured from the engine's recent steps: ``rates.prefill_tokens_per_s`` (always > 0),
  ``rates.decode_step_s`` and ``rates.finished_per_s`` (requests finishing per second; ``None`` until one
  has finished).

The design is yours: how you predict a newcomer's time to first token from that snapshot (what it waits
for, and what it waits for at once rather than in turn), how much of the SLO you let the prediction use,
and what ``Retry-After`` you send. Chapter 09 works through the pieces (the prefill work ahead, a full batch,
a cache near full) and why a controller that aims at the SLO itself lets about half its admitted requests
miss it: under overload the queue settles where the prediction equals what you allow. Add whatever
methods and attributes you like; the grader calls only ``SLOAdmission(ttft_slo_s=…)`` and ``decide``.

You are graded on behaviour, in the discrete-event simulator (:mod:`minserve.capacity.simulator`: the
engine's own scheduler on a virtual clock, so grading is deterministic) at three times the engine's
capacity, against no admission at all, and once on the real server:

- on **goodput** (requests per second that met the SLO): at least 4 × what the server without admission
  achieves; a policy that admits everything or refuses everything gets nowhere near it;
- on **the SLO of the admitted requests**: their p99 TTFT within the SLO;
- on **refusing fast**: of the requests that miss the SLO, at least 80% must be refused at the door, at
  once, rather than admitted and served late;
- on **sense at the edges**: an idle server admits any request (refusing it cannot make it faster); a
  heavier queue (more prompt tokens or requests waiting ahead, slower prefill) never admits a request a
  lighter one refused; a client's own shorter ``timeout_s`` is honoured;
- on a **Retry-After** that is positive and finite, and long enough: once the work queued ahead has been
  prefilled for that long at the measured rate, the same request is admitted;
- on the **real server** under a burst: your policy's refusals come back as 429 with a ``Retry-After``.

Instructors keep a second set of tests: other SLOs, loads, seeds and client timeouts.

Import only the standard library and the four interface names imported below: the grader refuses a file
that imports anything else from minserve (the server's own ``DeadlineAware`` included), and your class must
be your own, not a subclass of one of minserve's policies.
"""

from __future__ import annotations

from minserve.admission import AdmissionPolicy, QueueState, Refusal, RequestFacts


class SLOAdmission(AdmissionPolicy):
    """Admit a request only if it can still get its first token within the SLO; refuse it at once otherwise.

    ``ttft_slo_s``: the server's TTFT target, seconds (a request whose client sent a shorter ``timeout_s`` is
    judged against that instead). ``__init__`` raises ``ValueError`` for a ``ttft_slo_s`` that is not a
    positive finite number. Any other parameter of your design needs a default.
    """

    name = "slo-admission"

    def __init__(self, ttft_slo_s: float) -> None:
        raise NotImplementedError

    def decide(self, request: RequestFacts, queue: QueueState) -> Refusal | None:
        """``None`` to admit ``request`` now; else ``Refusal("ttft_slo", retry_after_s, message)``: seconds
        until the same request would be admitted, and a message that tells the client why."""
        raise NotImplementedError
