"""Requests served on the engine as they arrive: the one arrivals-and-steps experiment.

:func:`serve_arrivals` turns a list of planned requests into :class:`~minserve.engine.driver.Arrival` s and
hands them to :func:`~minserve.engine.driver.drive`, the loop the simulator runs on. Each request asks for
exactly its ``output_tokens`` (``ignore_eos``), with its priority and deadline, and is added either when the
wall clock passes the run's start plus its ``arrival_s`` (stamped with that time, so one that arrives during
a step waits for it, as a client's would: an open-loop load test in one process), or, with ``at_steps``,
once that many steps have run (step-exact, the same on every machine).

A planned request is anything shaped like :class:`~minserve.capacity.simulator.SimRequest` (the
:class:`PlannedRequest` protocol), so one list feeds the engine here and the simulator there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from minserve.engine.driver import Arrival, drive
from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.engine.engine import LLMEngine

LEAD_S = 0.005  # default start of a timed run: 5 ms after the call, so the first arrival is not already late


class PlannedRequest(Protocol):
    """What a request to serve says: when it arrives (seconds after the run's start), its prompt's token ids,
    how many tokens it produces, and the engine's per-request options (``deadline_s``: seconds after arrival)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def deadline_s(self) -> float | None: ...


def serve_arrivals(
    engine: LLMEngine,
    requests: Sequence[PlannedRequest],
    request_ids: Sequence[str | None] | None = None,
    at_steps: Sequence[int] | None = None,
    start_s: float | None = None,
    temperature: float = 0.0,
    on_add: Callable[[int], None] | None = None,
    max_steps: int = 1_000_000,
) -> list[RequestOutput]:
    """Serve ``requests`` on the idle ``engine`` and return the finished ones' outputs in the order given.

    ``request_ids``: one per request (``None``: the engine numbers it); ``at_steps``: add request ``i`` once
    ``at_steps[i]`` steps have run (0: before the first) instead of at its ``arrival_s``; ``start_s``: the
    clock time arrival times count from (default: now, plus :data:`LEAD_S` on the clock); ``on_add(i)`` is
    called right after request ``i`` is added (to note the step it arrived at, say). Greedy unless
    ``temperature`` says otherwise. Raises ``ValueError`` on an engine with requests in flight.
    """
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; run on an idle engine")
    n = len(requests)
    ids: list[str | None] = list(request_ids) if request_ids is not None else [None] * n
    if len(ids) != n:
        raise ValueError(f"{len(ids)} request ids for {n} requests")
    if at_steps is not None and len(at_steps) != n:
        raise ValueError(f"{len(at_steps)} arrival steps for {n} requests")
    added: list[str] = [""] * n

    def adder(i: int) -> Callable[[float], None]:
        request = requests[i]
        params = SamplingParams(max_tokens=request.output_tokens, temperature=temperature, ignore_eos=True)

        def add(arrival_s: float) -> None:
            prompt = list(request.prompt_token_ids)
            added[i] = engine.add_request(prompt, params, ids[i], arrival_s, prompt, request.priority,
                                          request.deadline_s)  # fmt: skip
            if on_add is not None:
                on_add(i)

        return add

    by_step = at_steps is not None
    if start_s is None:
        start_s = engine.core.clock.now() + (0.0 if by_step else LEAD_S)
    due = list(at_steps) if by_step else [r.arrival_s for r in requests]
    finished = drive(engine.core, [Arrival(due[i], adder(i)) for i in range(n)], start_s, by_step, max_steps)
    return [finished[rid] for rid in added if rid in finished]
