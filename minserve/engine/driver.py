"""One loop that feeds an engine core requests as they arrive and steps it until all are done.

The simulator, calibration, the profiler, the chapters' experiments and the simulator's validation all need
the same thing: requests added at their arrival times (or after a given number of steps), the core stepped
in between, and idle time let pass until the next arrival. On the wall clock idle time is slept; on the
virtual clock it is jumped over. Either way it is this loop, so an experiment on the engine and the same
experiment in the simulator differ only in the core's executor and clock.

    finished = drive(core, [Arrival(0.0, add_first), Arrival(0.5, add_second)])

An arrival's ``add`` is called with the time to stamp the request with: its due time on a clock (a request
that comes during a step waits for that step, as a client's would), or now when arrivals count steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from minserve.engine.core import EngineCore
from minserve.engine.outputs import RequestOutput

MAX_STALLED_STEPS = 2  # steps in a row that schedule nothing before only an arrival can help


@dataclass(frozen=True)
class Arrival:
    """A request to add when it is due: ``due`` seconds after ``start_s`` (or, with ``by_step``, once that
    many steps have run). ``add(arrival_time_s)`` adds it to the core."""

    due: float
    add: Callable[[float], None]


def drive(
    core: EngineCore,
    arrivals: Sequence[Arrival],
    start_s: float | None = None,
    by_step: bool = False,
    max_steps: int = 1_000_000,
) -> dict[str, RequestOutput]:
    """Add each arrival when due and step ``core`` until every request has finished; return the final
    outputs by request id. ``start_s`` (default: the clock now) is the time the ``due`` times count from.

    A core that schedules nothing for a few steps in a row (a preemption left nothing runnable) waits for
    the next arrival; with none left to come that is a bug, and it raises ``RuntimeError``, as it does past
    ``max_steps`` steps.
    """
    clock = core.clock
    start_s = clock.now() if start_s is None else start_s
    pending = sorted(arrivals, key=lambda arrival: arrival.due)  # stable: ties keep their given order
    finished: dict[str, RequestOutput] = {}
    next_index, steps, stalled = 0, 0, 0

    def due_s(arrival: Arrival) -> float:
        return start_s + arrival.due

    while next_index < len(pending) or core.has_unfinished_requests():
        now = clock.now()
        while next_index < len(pending) and (
            pending[next_index].due <= steps if by_step else due_s(pending[next_index]) <= now
        ):
            arrival = pending[next_index]
            arrival.add(now if by_step else due_s(arrival))
            next_index += 1
        if not core.has_unfinished_requests():  # idle: let time pass until the next arrival
            if next_index == len(pending):
                break  # none is left: the last arrivals added nothing (a simulated admission refused them)
            if by_step:
                steps = max(steps, int(pending[next_index].due))
            else:
                clock.wait_until(due_s(pending[next_index]))
            continue
        if steps >= max_steps:
            raise RuntimeError(f"the requests did not finish within {max_steps} steps")
        ran_before = core.num_steps
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        if core.num_steps > ran_before:
            steps, stalled = steps + 1, 0
            continue
        stalled += 1
        if stalled > MAX_STALLED_STEPS:
            if next_index == len(pending):
                raise RuntimeError("the scheduler makes no progress and no request is left to arrive")
            if not by_step:
                clock.wait_until(due_s(pending[next_index]))
            steps = max(steps, int(pending[next_index].due)) if by_step else steps
    return finished
