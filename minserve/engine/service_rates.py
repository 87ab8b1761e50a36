"""How fast the engine is serving now: its prefill rate and its decode step time, measured from its own steps.

Admission control needs a service rate to turn a queue into a wait: ``queued prompt tokens / prefill rate``
is the time until the last of them has its first token. The rate is not a constant of the hardware. It
falls when decodes share the steps, when prompts are chunked, when the machine is busy with something
else, so it is measured from the engine's recent steps:

* **prefill rate** (tokens/s): the prompt tokens of the steps that ran any, over those steps' whole time.
  A step that also carried decodes counts whole, so the rate is the one prefills get *while serving*, a
  little lower than an idle engine's: the wait it predicts is the one a queued request will see.
* **decode step time** (s): the whole time of a step that ran only decodes.
* **finish rate** (requests/s): requests that ended in a step, over the steps' time. When the batch is full,
  a waiting request gets a slot only as others finish, so this is the rate its queue moves at.

Each is an exponentially weighted moving average (EWMA) with weight ``weight`` on the newest step, so a
change of load shows within about ``1 / weight`` steps. That horizon must be longer than a request's life in
steps: requests admitted together finish together, so finishes come in bursts, and a short average swings
between "many per second" and "none". Admission acts on it at the worst moments: it admits most while the
estimate is high. With a 10-step horizon, 16 slots and 32-token answers at 3x load on a 2-core CPU, the
finish rate read at admission was 30–50% above the one the server delivered (median 19 against 13–15
requests/s), and the admitted requests' median TTFT came out 1.2–1.3 times the predicted one; at 50 steps,
12% above, and 1.16 times. The prefill rate is a ratio of two such averages (tokens and
seconds), so a long step weighs more than a short one, as it should. Before the first measurement the
meter answers with a prior (:data:`PRIOR`); the first measurement replaces it.

:class:`ServiceRateMeter` is a step observer (:class:`~minserve.engine.step_report.StepReport`): the engine core
process runs one and sends its :class:`ServiceRates` with every step's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minserve.engine.step_report import StepReport

PREFILL_STATES = ("prefill", "recompute")  # ScheduledSeq states whose tokens are prompt work


@dataclass(frozen=True)
class ServiceRates:
    """The engine's recent service rates. ``num_steps``: steps measured so far (0: these are the prior)."""

    prefill_tokens_per_s: float
    decode_step_s: float
    num_steps: int = 0
    finished_per_s: float | None = None  # None until a request has finished: no measurement, no guess

    def prefill_s(self, num_tokens: int) -> float:
        """Seconds to prefill ``num_tokens`` prompt tokens at the current rate."""
        return num_tokens / self.prefill_tokens_per_s

    def finishing_s(self, num_requests: int) -> float | None:
        """Seconds until ``num_requests`` more requests have finished at the current rate (None: not measured)."""
        if num_requests <= 0:
            return 0.0
        return None if not self.finished_per_s else num_requests / self.finished_per_s


# Before any step is measured: a modest CPU's rates for a small model. A guess on purpose: it admits the
# first requests, and the first steps replace it.
PRIOR = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.05)


class ServiceRateMeter:
    """A step observer keeping EWMAs of the prefill rate and the decode step time; ``rates`` reads them."""

    def __init__(self, weight: float = 0.02, prior: ServiceRates = PRIOR) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        self.weight, self.prior = weight, prior
        self._prefill_tokens: float | None = None  # EWMA of a prefill step's prompt tokens
        self._prefill_step_s: float | None = None  # … and of its time
        self._decode_step_s: float | None = None
        self._finished: float | None = None  # EWMA of the requests a step ended …
        self._step_s: float | None = None  # … and of any step's time
        self._num_steps = 0
        self._seen_finish = False  # no finish yet: no finish rate to report

    def __call__(self, report: StepReport) -> None:
        prompt_tokens = sum(s.num_new_tokens for s in report.scheduled if s.state in PREFILL_STATES)
        if report.step_s <= 0:
            return  # a clock too coarse to see the step says nothing about its rate
        self._num_steps += 1
        finished = sum(1 for output in report.outputs if output.finished)
        # Every step counts, those before the first finish too: begun at the first finish, the average
        # would start from a burst and promise a rate the engine never had until it decayed.
        self._finished = self._average(self._finished, finished)
        self._step_s = self._average(self._step_s, report.step_s)
        self._seen_finish = self._seen_finish or finished > 0
        if prompt_tokens:
            self._prefill_tokens = self._average(self._prefill_tokens, prompt_tokens)
            self._prefill_step_s = self._average(self._prefill_step_s, report.step_s)
        else:
            self._decode_step_s = self._average(self._decode_step_s, report.step_s)

    def _average(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.weight * (value - mean)

    @property
    def rates(self) -> ServiceRates:
        """The current estimates; either one not measured yet is the prior's."""
        prefill = self.prior.prefill_tokens_per_s
        if self._prefill_tokens is not None and self._prefill_step_s:
            prefill = self._prefill_tokens / self._prefill_step_s
        decode = self.prior.decode_step_s if self._decode_step_s is None else self._decode_step_s
        finished = self._finished / self._step_s if self._seen_finish and self._step_s else None
        return ServiceRates(prefill, decode, self._num_steps, finished)
