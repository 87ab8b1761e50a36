"""Chapter 10's checks on the load it measured: the closed-loop sweep and the knee of the rate sweep.

Each function states one claim about the *server*, reads it off measured summaries (and tables built from
them), and returns what does not hold: ``[]`` when the claim holds, else one sentence per broken part. A
notebook asserts ``== []``; tests feed them broken numbers (a server that never saturates, one with a
single slot, a load tester that loses requests) and see the sentences appear.

The bands are the claims: each is stated as a module constant, with why it is that wide. None depends on
how fast the machine is, only on ratios of measured numbers to each other or to the measured capacity.
Rates are requests per second, times in ms unless the name says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from minserve.capacity.queueing import predicted_ttft_ms
from minserve.lab.loadtest_tables import server_queue_ms
from minserve.slo import lookup

# Closed loop, at the S slots: S users finish at least this factor more than one user does. Not S×: a batch
# step of S sequences costs more than a step of one on a CPU, and other work on the machine adds noise (the
# gain measured here is 1.8–2.6×). A server with one slot gains only the moments its slot stood empty
# between one user's requests (1.0–1.3× measured).
GAIN_MIN = 1.5
# Closed loop, past the slots: doubling the users moves throughput by at most this factor either way (then
# W = C / λ doubles as well: Little's law). Wider above than below: at C = S each finished request leaves its
# slot empty while the client sends the next one and the server tokenizes it; at 2S the queue refills it at
# once, so the plateau may sit somewhat above λ(S).
PLATEAU_BAND = (0.7, 1.5)
# The client kept its C users busy: λ·W (the mean in flight, Little's law) is at least this fraction of C;
# the rest is the ragged end of a finite run.
IN_FLIGHT_MIN = 0.75
# The server's own queue: past the slots each request waits at least this fraction of a turn W_S; at or
# below them, at most this fraction (one step's wait for the next batch).
QUEUE_PAST_MIN, QUEUE_BELOW_MAX = 0.25, 0.15

# Open loop, the knee: at 2–4 × λ* the achieved throughput is within this band of λ*. Not (1, 1): a finite
# run has ragged ends, the waiting requests' parsing and streams cost the server CPU, and λ* itself is
# measured, at C = S, where each slot idles between one request and the next (see PLATEAU_BAND) …
KNEE_BAND = (0.6, 1.4)
# … below 0.5 λ* it follows the offered rate to within this fraction (the last requests' tail lengthens a
# finite run a little) …
FOLLOW_MIN = 0.8
# … past it the median TTFT is within this factor of the fluid queue's prediction, either way …
TTFT_PREDICTION_FACTOR = 2.5
# … and at the highest rate it is at least this many times the lowest rate's.
TTFT_GROWTH_MIN = 5.0
# A sweep whose TPOT p50 is this many times the closed loop's at the slots ran on a machine slowed by other
# work: past the knee the batches are as full as they were there (measured here: 1.0–1.3×).
SLOWDOWN_MAX = 2.0


def closed_loop_problems(littles_law: pd.DataFrame, summaries: Sequence[Mapping[str, Any]], slots: int) -> list[str]:
    """Does the closed-loop sweep show a server with ``slots`` batch slots? ``[]`` when every part holds.

    ``littles_law`` is :func:`~minserve.lab.loadtest_tables.littles_law_table` of the sweep, ``summaries`` its
    runs' summaries in the same order (for the server's queue time); the sweep must include concurrency 1,
    ``slots`` and ``2 * slots``. The claims: ``slots`` users buy more throughput than one; past them,
    throughput stays put (so W = C / λ doubles with the users) because the extra users wait in the server's
    queue, which the server's own metrics show; and the client really kept C in flight (λ·W near C). A
    server with one slot fails the first and queues below its slots; one with many slots never queues.
    """
    table = littles_law.set_index("concurrency C")
    queue_ms = dict(zip(littles_law["concurrency C"], (server_queue_ms(s) for s in summaries)))
    needed = {1, slots, 2 * slots}
    if not needed <= set(table.index):
        return [f"the sweep needs concurrency {sorted(needed)}, has {sorted(table.index)}"]
    rate, wait_s = table["λ req/s"], table["W mean E2E s"]
    problems = []
    if rate[slots] < GAIN_MIN * rate[1]:
        problems.append(f"{slots} users finish {rate[slots] / rate[1]:.2f}× one user's rate, below {GAIN_MIN}×")
    for c in table.index:
        if table.loc[c, "λ·W"] < IN_FLIGHT_MIN * c:
            problems.append(f"concurrency {c}: λ·W = {table.loc[c, 'λ·W']:.2f} in flight, below {IN_FLIGHT_MIN}·C")
    plateau = rate[2 * slots] / rate[slots]
    if not PLATEAU_BAND[0] <= plateau <= PLATEAU_BAND[1]:
        problems.append(f"past {slots} slots throughput moved {plateau:.2f}×, outside {PLATEAU_BAND}")
    turn_ms = wait_s[slots] * 1e3
    if not queue_ms[2 * slots] >= QUEUE_PAST_MIN * turn_ms:  # nan (no server metrics) fails too
        problems.append(f"at {2 * slots} users the server queued {queue_ms[2 * slots]:.0f} ms, below "
                        f"{QUEUE_PAST_MIN} of a turn ({turn_ms:.0f} ms)")  # fmt: skip
    for c in (c for c in table.index if c <= slots):
        if not queue_ms[c] <= QUEUE_BELOW_MAX * turn_ms:
            problems.append(f"at {c} users the server queued {queue_ms[c]:.0f} ms, over {QUEUE_BELOW_MAX} of a turn")
    return problems


def knee_problems(
    summaries: Sequence[Mapping[str, Any]],
    offered_rps: Sequence[float],
    capacity_rps: float,
    num_requests: int,
    base_ttft_ms: float,
    capacity_tpot_ms: float | None = None,
) -> list[str]:
    """Does an open-loop rate sweep bend at the predicted capacity λ*? ``[]`` when every part holds.

    Below half of λ* the server keeps up (achieved ≈ offered); at two to four times λ* the achieved rate
    stays within :data:`KNEE_BAND` of λ* (a curve that keeps rising fails here); past λ* the median TTFT
    follows the fluid queue's prediction (:func:`~minserve.capacity.queueing.predicted_ttft_ms`) within a
    factor :data:`TTFT_PREDICTION_FACTOR`, and at the highest rate it is many times the lowest rate's.

    ``capacity_tpot_ms``, the TPOT p50 of the closed loop λ* was measured on, lets a failure say why: past the
    knee the engine runs full batches, as it did there, so a TPOT much longer than that means the machine
    was busy with other work during the sweep, and the sweep measured that rather than the server.
    """
    problems = []
    if capacity_tpot_ms:
        slowest = max((lookup(dict(s), "tpot_ms.p50") or 0.0 for s in summaries), default=0.0)
        if slowest > SLOWDOWN_MAX * capacity_tpot_ms:
            problems.append(f"the engine's decode steps ran {slowest / capacity_tpot_ms:.1f}× slower than when λ* "
                            "was measured (TPOT p50): something else took the CPU; rerun on a quiet "
                            "machine")  # fmt: skip
    for s, offered in zip(summaries, offered_rps):
        achieved, label = s["request_throughput_rps"], s["label"]
        load = offered / capacity_rps
        if load <= 0.5 and achieved < FOLLOW_MIN * offered:
            problems.append(f"{label}: achieved {achieved:.2f} of {offered:.2f} req/s offered, below the knee")
        if 2 <= load <= 4.5 and not KNEE_BAND[0] <= achieved / capacity_rps <= KNEE_BAND[1]:
            problems.append(f"{label}: at {load:.1f} λ* achieved {achieved / capacity_rps:.2f} λ*, outside {KNEE_BAND}")
        if load >= 2:
            predicted = predicted_ttft_ms(offered, capacity_rps, num_requests, base_ttft_ms)
            measured = lookup(dict(s), "ttft_ms.p50") or math.nan
            if not 1 / TTFT_PREDICTION_FACTOR <= measured / predicted <= TTFT_PREDICTION_FACTOR:
                problems.append(f"{label}: TTFT p50 {measured:.0f} ms against {predicted:.0f} ms predicted")
    if not any(offered / capacity_rps >= 2 for offered in offered_rps):
        problems.append("no run reached twice the capacity: the knee was never crossed")
    lowest, highest = (lookup(dict(s), "ttft_ms.p50") or math.nan for s in (summaries[0], summaries[-1]))
    if not highest >= TTFT_GROWTH_MIN * lowest:
        problems.append(f"TTFT p50 grew only {highest / lowest:.1f}× from the lowest rate to the highest")
    return problems
