"""Degraded modes: under heavy load, give every request a little less instead of refusing more of them.

When the server holds many requests, it can trade quality for capacity: shorter answers (``max_tokens``
capped), a shorter context (long prompts refused for now), no speculative decoding (drafts cost compute
that a full batch no longer has to spare: past a batch size, verifying drafts slows every sequence down).

What switches the modes is a load signal, the requests in the server (running and waiting), through a
switch with **hysteresis**: degraded from when the signal reaches ``enter``, normal again only once it has
fallen to ``exit``, below it. One threshold would flap: a load hovering at the threshold would switch the
modes on and off with every request, and the answers would change length at random. Between the two
thresholds the switch keeps whatever state it is in.

The server observes the load at every admission, every ``/metrics`` scrape, and every
:data:`WATCH_INTERVAL_S` seconds in between (a load that falls while no request arrives still turns the modes
off), applies the modes to each
request it admits while degraded (:meth:`Degrader.apply`), names them in an ``X-Minserve-Degraded`` response
header, and shows the state as the gauge ``minserve:degraded_mode``. Turning speculation off is a message to
the engine core (``AsyncLLMEngine.set_speculation``), sent when the switch changes state. Off unless
``ServerConfig.degrade_enter_requests`` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minserve.admission import QueueState, Refusal
from minserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.config import ServerConfig

HEADER = "X-Minserve-Degraded"
WATCH_INTERVAL_S = 0.25  # seconds between the server's own readings of the load


@dataclass(frozen=True)
class DegradedModes:
    """What changes while degraded: ``max_tokens`` capped (tokens), a shorter context ``max_model_len``
    (tokens: prompt and output), ``speculation`` off. ``None`` / ``True``: that mode is not used."""

    max_tokens: int | None = None
    max_model_len: int | None = None
    speculation: bool = True

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"degraded {name} must be a whole number ≥ 1, got {value!r}")
        if self.max_tokens is None and self.max_model_len is None and self.speculation:
            raise ValueError("degraded modes: name at least one (a max_tokens cap, a shorter context, no speculation)")

    def describe(self) -> str:
        """The header value: ``max_tokens=64, max_model_len=512, speculation=off`` (the modes in use)."""
        caps = {"max_tokens": self.max_tokens, "max_model_len": self.max_model_len}
        parts = [f"{name}={value}" for name, value in caps.items() if value is not None]
        return ", ".join(parts + ([] if self.speculation else ["speculation=off"]))


class Hysteresis:
    """A two-threshold switch on a signal: on when it reaches ``enter``, off when it falls to ``exit``."""

    def __init__(self, enter: float, exit: float) -> None:
        if not exit < enter:
            raise ValueError(f"hysteresis: exit ({exit}) must be below enter ({enter}), or the switch flaps")
        self.enter, self.exit = enter, exit
        self.active = False

    def update(self, signal: float) -> bool:
        """Take a reading; return whether the switch changed state."""
        if not self.active and signal >= self.enter:
            self.active = True
            return True
        if self.active and signal <= self.exit:
            self.active = False
            return True
        return False


class Degrader:
    """The switch on the requests in the server, and the modes it turns on; ``on_change(active)`` is called
    when it flips (the server turns speculation off and on there)."""

    def __init__(
        self, switch: Hysteresis, modes: DegradedModes, on_change: Callable[[bool], None] = lambda active: None
    ) -> None:
        self.switch, self.modes, self.on_change = switch, modes, on_change

    @property
    def active(self) -> bool:
        return self.switch.active

    def observe(self, queue: QueueState) -> bool:
        """Read the load in ``queue``; return whether the modes are on now."""
        if self.switch.update(queue.num_requests):
            self.on_change(self.switch.active)
        return self.switch.active

    def apply(
        self, prompt_tokens: int, params: SamplingParams, queue: QueueState
    ) -> tuple[SamplingParams, Refusal | None]:
        """While degraded: ``params`` with ``max_tokens`` capped to the cap and to what the shorter context
        leaves after the prompt, or a refusal of a prompt the shorter context cannot hold (429: come back
        when the load has fallen; ``retry_after_s`` is the time to prefill what is queued now). Normal:
        ``params`` as they came, and no refusal."""
        if not self.active:
            return params, None
        modes = self.modes
        if modes.max_tokens is not None:
            params = params.with_max_tokens(modes.max_tokens)
        if modes.max_model_len is not None:
            room = modes.max_model_len - prompt_tokens
            if room < 1:
                message = (f"the server is under heavy load and serves contexts of at most {modes.max_model_len} "
                           f"tokens for now; this prompt has {prompt_tokens}. Retry later, or shorten it")  # fmt: skip
                return params, Refusal("degraded_context", queue.rates.prefill_s(queue.queued_prompt_tokens), message)
            params = params.with_max_tokens(room)
        return params, None


def make_degrader(config: ServerConfig, set_speculation: Callable[[bool], None]) -> Degrader | None:
    """The degrader ``config`` describes (``None``: degraded modes off), its settings checked with their names.
    ``set_speculation(enabled)`` is called when the modes turn speculation off, and on again."""
    modes_named = [name for name in ("degraded_max_tokens", "degraded_max_model_len", "degraded_no_speculation")
                   if getattr(config, name) is not None and getattr(config, name) is not False]  # fmt: skip
    enter = config.degrade_enter_requests
    if enter is None:
        if modes_named:
            raise ValueError(f"{', '.join(modes_named)}: set degrade_enter_requests too, the load that turns them on")
        return None
    if not modes_named:
        raise ValueError("degrade_enter_requests: name a degraded mode too (degraded_max_tokens, "
                         "degraded_max_model_len or degraded_no_speculation)")  # fmt: skip
    leave = enter // 2 if config.degrade_exit_requests is None else config.degrade_exit_requests
    if not leave < enter:
        raise ValueError(f"degrade_exit_requests ({leave}) must be below degrade_enter_requests ({enter}): "
                         "between the two the modes stay as they are, so they do not flap")  # fmt: skip
    modes = DegradedModes(config.degraded_max_tokens, config.degraded_max_model_len, not config.degraded_no_speculation)

    def on_change(active: bool) -> None:
        if not modes.speculation:
            set_speculation(not active)

    return Degrader(Hysteresis(enter, leave), modes, on_change)


__all__ = ["HEADER", "DegradedModes", "Degrader", "Hysteresis", "make_degrader"]
