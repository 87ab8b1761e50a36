"""Chapter 10 exercise: goodput and coordinated omission from a load test's raw records.

Fill in every function below (replace ``raise NotImplementedError``), then grade yourself:

    minserve grade ch10

``minserve bench`` writes ``records.jsonl``: one JSON line per request per run, the raw evidence that every
number in its summary is computed from. Read it with ``[json.loads(line) for line in open(path)]``; each
record is a plain dict:

    {"run": "rate=4", "index": 7, "intended_s": 1.75, "sent_s": 1.7504,
     "chunk_times_s": [1.98, 2.01, 2.05], "end_s": 2.06, "status": "ok", "error": None,
     "error_message": None, "output_tokens": 4, "prompt_tokens": 42, "output_tokens_source": "usage",
     "response_id": "cmpl-...", "text": "..."}

All times are seconds from the start of *that run* (each run's clock starts at 0), on one clock:

- ``intended_s``: when the timetable said to send the request; ``sent_s``: when the client actually did;
- ``chunk_times_s``: when each chunk that carried text arrived (empty when none did);
- ``end_s``: the last byte, the error or the hang-up;
- ``status``: ``"ok"``, ``"failed"`` (with an ``error`` kind such as ``"http_429"`` or ``"timeout"``) or
  ``"cancelled"`` (the client hung up on purpose);
- ``output_tokens``: the server's own count from its usage chunk when it sent one
  (``output_tokens_source`` says where the count came from). A chunk may carry several tokens, so this
  can exceed ``len(chunk_times_s)``; use it, not the number of chunks.

The file also carries the benchmark's own ``ttft_ms``, ``tpot_ms`` and ``e2e_ms``; compute yours from the
raw fields (the graded tests' records do not have the derived ones).

An SLO is a dict of targets in seconds, e.g. ``{"ttft": 0.5, "tpot": 0.05}``; the keys can be ``"ttft"``,
``"tpot"`` and ``"e2e"``, and a target that is not set is simply not in the dict.

Part 3 is about *coordinated omission*: a load tester that waits for answers before sending more sends
less load exactly when the server is slow, and its latencies, measured from when it finally sent, hide the
stall. Measuring from the intended send time puts the hidden waiting back.

Use only the standard library (``math``, ``heapq`` and ``collections`` are handy): the grader refuses a file
that imports anything else, ``minserve.bench`` and ``minserve.slo`` included.
"""

from __future__ import annotations

import math  # noqa: F401  (you will want math.nan and math.floor)
from collections.abc import Sequence

# --- part 1: one request -----------------------------------------------------------------------------------


def request_metrics(record: dict) -> dict[str, float | None]:
    """TTFT, TPOT and E2E of one record in seconds, all measured from the *actual* send time ``sent_s``.

    Returns ``{"ttft_s": ..., "tpot_s": ..., "e2e_s": ...}`` (vLLM's definitions, as in ``records.jsonl``):

    - ``ttft_s``: first chunk − ``sent_s``; ``None`` when no chunk came;
    - ``e2e_s``: ``end_s`` − ``sent_s`` (always defined: for a failed request it is the time to the error);
    - ``tpot_s``: (E2E − TTFT) / (n − 1) with n = ``output_tokens`` (the server's count, not the number of
      chunks); ``None`` when no chunk came or n < 2 (a one-token answer has no decode phase).

    The status does not matter here: these are what the client saw. Which requests count is decided by
    :func:`summarize` and :func:`meets_slo`.
    """
    raise NotImplementedError


# --- part 2: one run ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100) with linear interpolation between closest ranks.

    The same definition as chapter 01 and ``minserve.slo.percentile``: sort the values; the percentile sits
    at fractional position ``q / 100 × (n − 1)``; interpolate between the two values around it. Return
    ``math.nan`` for no values; raise ``ValueError`` when q is outside [0, 100]. Do not change the caller's
    list.
    """
    raise NotImplementedError


def summarize(records: Sequence[dict], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """Counts and latency percentiles (seconds) of one run's records.

    Returns::

        {"requests": 8, "ok": 6, "failed": 1, "cancelled": 1,
         "ttft_s": {"p50": ..., "p90": ..., "p99": ...},
         "tpot_s": {...}, "e2e_s": {...}}

    Percentile keys are ``f"p{q:g}"`` (``"p50"``, ``"p99.9"``). Only ``ok`` requests enter the latency
    distributions (a failed request's quick error would flatter them; failures count against goodput
    instead), and a request without a metric (a one-token answer has no TPOT) is left out of that one. A
    distribution with no values has ``math.nan`` percentiles. An empty run gives zero counts.
    """
    raise NotImplementedError


def meets_slo(record: dict, slo: dict[str, float]) -> bool:
    """Whether one request is *good*: status ``"ok"`` and within every target of ``slo`` (≤, in seconds).

    ``slo`` maps ``"ttft"``, ``"tpot"`` and/or ``"e2e"`` to a bound in seconds; an empty dict sets no
    targets, so every ok request is good. A failed or cancelled request is never good. A request without
    TPOT (fewer than two tokens) cannot miss a TPOT target; an ok request with no chunk at all misses a TTFT
    target. Raise ``ValueError`` for any other key (``"ttft_ms"`` must not quietly pass every request).
    """
    raise NotImplementedError


def goodput_rps(records: Sequence[dict], slo: dict[str, float], duration_s: float | None = None) -> float:
    """Good requests per second over the run's duration, in requests per second.

    ``duration_s`` defaults to the run's duration as the records tell it: the latest ``end_s`` (the run's
    clock starts at 0, and the run ends when its last request does); 0.0 for no records. Failed and
    cancelled requests take their share of the time and add nothing. Return 0.0 when the duration is 0;
    raise ``ValueError`` when it is negative.
    """
    raise NotImplementedError


def split_runs(records: Sequence[dict]) -> dict[str, list[dict]]:
    """The records grouped by their ``"run"`` label, runs in order of first appearance, records in file order.

    ``records.jsonl`` holds every run of a sweep one after the other, and each run has its own clock, its
    own duration and its own verdict: never pool them.
    """
    raise NotImplementedError


# --- part 3: coordinated omission --------------------------------------------------------------------------


def client_lag_s(record: dict) -> float:
    """How late the client sent the request: ``sent_s`` − ``intended_s``, in seconds (≥ 0 in practice)."""
    raise NotImplementedError


def e2e_from_intended_s(record: dict) -> float:
    """End-to-end latency measured from the *intended* send time: ``end_s`` − ``intended_s``, in seconds.

    This is what a user who arrived on schedule waited: the client's lag plus the E2E it measured.
    """
    raise NotImplementedError


def closed_loop_send_times(intended_s: Sequence[float], service_s: Sequence[float], concurrency: int) -> list[float]:
    """When a load tester with ``concurrency`` workers actually sends each request of an open-loop timetable.

    ``intended_s`` is the timetable (non-decreasing, seconds); ``service_s[i]`` is how long request i takes
    once sent. The client walks the timetable in order: request i goes to the worker that is free first, and
    leaves at the later of its intended time and that moment (never early). A worker is busy from a send
    until that send + its service time, and free again at exactly that instant. Returns the actual send
    times, one per request, in timetable order.

    Raise ``ValueError`` when ``concurrency`` < 1 or the two lists differ in length; ``[]`` for no requests.
    """
    raise NotImplementedError
