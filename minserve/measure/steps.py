"""Steps recorded from the engine core's own reports: the one way an experiment times a step.

The core hands every observer a :class:`~minserve.engine.step_report.StepReport` after each step: what it scheduled
(before it ran), the queues, and four times on the core's clock (``began_s`` ≤ ``start_s`` ≤ ``end_s`` ≤
``finished_s``). Every experiment reads its times from these reports, never from a stopwatch of its own, so
two chapters that say "a decode step" mean the same interval:

* :attr:`StepReport.step_s`: the whole step (scheduling, forward pass, sampling, bookkeeping), what the
  next step waits for;
* :attr:`StepReport.duration_s`: the executor alone (the forward pass and sampling);
* :func:`decode_periods`: step end to step end, what a streaming client sees between two tokens.

:class:`StepRecorder` subscribes for the length of a ``with`` block and always unsubscribes.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from minserve.engine.core import EngineCore
from minserve.engine.step_report import StepReport

T = TypeVar("T")


@dataclass
class StepRecorder(Generic[T]):
    """Every step ``core`` runs inside the ``with`` block, as reported: ``reports``, and, when ``probe`` is
    given, what it returned right after each step in ``probes`` (same length, same order).

    ``probe`` reads what the report does not carry (a communicator's byte counters, say) at the one moment
    they hold exactly that step's work.
    """

    core: EngineCore
    probe: Callable[[StepReport], T] | None = None
    reports: list[StepReport] = field(default_factory=list)
    probes: list[T] = field(default_factory=list)

    def __call__(self, report: StepReport) -> None:
        self.reports.append(report)
        if self.probe is not None:
            self.probes.append(self.probe(report))

    def __enter__(self) -> StepRecorder[T]:
        self.core.observers.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.core.observers.remove(self)


def is_decode(report: StepReport, batch: int | None = None) -> bool:
    """The step decoded one token for each of its sequences and nothing else (of exactly ``batch`` sequences,
    when given). A step that scheduled nothing is not a decode step."""
    sizes_match = batch is None or len(report.scheduled) == batch
    return bool(report.scheduled) and sizes_match and all(s.state == "decode" for s in report.scheduled)


def decode_periods(reports: Sequence[StepReport], batch: int) -> list[float]:
    """Seconds from one step's end to the next's, for each consecutive pair whose later step is a pure decode
    step of ``batch`` sequences: the gap between two tokens a streaming client sees."""
    return [later.end_s - earlier.end_s for earlier, later in itertools.pairwise(reports) if is_decode(later, batch)]


def context_tokens(report: StepReport) -> float:
    """Mean keys each scheduled sequence's last new token attends to in the step (its computed tokens plus
    the new ones): a decode step's context length."""
    return sum(s.num_computed_tokens + s.num_new_tokens for s in report.scheduled) / len(report.scheduled)


class gc_paused:
    """Garbage collection off inside the block: a collection in the middle of a timed step is noise, not the
    step's cost. Restores whatever state it found."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self.was_enabled:
            gc.enable()
