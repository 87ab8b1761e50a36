"""Chapter 10 exercise: the capacity of a server, read from a load test's raw records.

Fill in both functions below (replace ``raise NotImplementedError``), then grade yourself:

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
- ``status``: ``"ok"``, ``"failed"`` or ``"cancelled"``; ``output_tokens``: the server's own count.

Part 1 is *coordinated omission*: a load tester with a fixed pool of workers sends a request only when a
worker is free, so when the server is slow it falls behind its timetable, sends less load exactly when it
should not, and its latencies, measured from when it finally sent, hide the wait. Such a run's records keep
the timetable's ``intended_s`` beside the late ``sent_s``.

Part 2 is the design: from a rate sweep's records, estimate the server's capacity at an SLO, the knee λ*
of chapter 10: the highest arrival rate at which the server still serves its users within the SLO. How you
read each run's offered rate, judge its requests (from which instant? which requests count?) and place the
knee between the sweep's rates is yours. Some runs of a sweep may come from a pool of workers that fell
behind: read them as what their timetable intended, not as what the pool managed to send.

You are graded on sweeps of a simulated server (the engine's own scheduler on a virtual clock) whose
capacity is known exactly: your estimate must land within 20% of it, on open-loop sweeps and on sweeps
whose runs past the knee were sent by a pool of workers; instructors keep other workloads, SLOs and pools.

Use only the standard library: the grader refuses a file that imports anything else, ``minserve.bench``
and ``minserve.slo`` included.
"""

from __future__ import annotations

import math  # noqa: F401  (math.inf is handy)
from collections.abc import Sequence

# --- part 1: coordinated omission --------------------------------------------------------------------------


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


# --- part 2: the knee -------------------------------------------------------------------------------------


def capacity_rps(records: Sequence[dict], slo: dict[str, float], attainment: float = 0.9) -> float:
    """The server's capacity at ``slo``, in requests per second: the highest arrival rate at which at least
    ``attainment`` of a run's requests are good, estimated from a rate sweep's records (several runs, told
    apart by their ``"run"`` label, in any order).

    ``slo`` maps ``"ttft"`` and/or ``"e2e"`` to a bound in seconds, as a user waits for it: from the moment
    the user meant to send. A good request is ``"ok"`` and within every bound; a failed one is never good.
    When every run of the sweep was good enough, return at least the highest rate it tried (the capacity is
    no lower); when none was, at most the lowest (0.0 is fine). Raise ``ValueError`` for an ``slo`` key other
    than ``"ttft"`` and ``"e2e"``.
    """
    raise NotImplementedError
