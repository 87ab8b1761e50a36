"""What one step of the engine core did, as its observers read it, and the engine's running totals.

The core hands every observer a :class:`StepReport` after each step that ran something: calibration, the
profiler, the lab's tables and the simulator's step records all read steps this way rather than reaching
into the scheduler. Whether a sequence was prefilled or decoded in a step is decided here, once
(:func:`step_state`), for the reports and the trace alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minserve.engine.outputs import RequestOutput
from minserve.engine.sequence import Sequence


def step_state(seq: Sequence, num_new: int) -> str:
    """What a step that runs ``num_new`` tokens of ``seq`` does with it, read before the step advances it.

    ``decode``: its next token; ``verify``: its next token and its drafts (speculative decoding);
    ``recompute``: several tokens of a sequence that had already produced some (it was preempted and lost its
    KV); ``prefill``: its prompt, or a chunk of it.
    """
    if seq.output_token_ids and num_new == 1 and seq.num_uncomputed_tokens == 1:
        return "decode"
    if seq.draft_token_ids and num_new == 1 + len(seq.draft_token_ids):
        return "verify"
    return "recompute" if seq.output_token_ids else "prefill"


def trace_span_name(state: str) -> str:
    """The trace's name for a step state: ``decode`` for a sequence's next token (drafts or not), else
    ``prefill`` (a prompt, a chunk of one, or a recomputation)."""
    return "decode" if state in ("decode", "verify") else "prefill"


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step as it was scheduled, read before the step advanced it; ``state`` is its
    :func:`step_state` (``decode``, ``verify``, ``recompute`` or ``prefill``)."""

    request_id: str
    num_new_tokens: int
    num_computed_tokens: int
    state: str

    @classmethod
    def of(cls, seq: Sequence, num_new: int) -> ScheduledSeq:
        return cls(seq.request_id, num_new, seq.num_computed_tokens, step_state(seq, num_new))


@dataclass
class StepReport:
    """What one step did, for observers. Times in seconds on the core's clock.

    ``scheduled`` is the batch as scheduled (each sequence's computed tokens *before* the step); the waiting
    and swapped ids are the queues after scheduling; ``outputs`` what the step returned.
    """

    index: int  # steps run so far by this core, this one included
    began_s: float  # when step() was called
    start_s: float  # after the swaps, when the executor began
    end_s: float  # when the executor returned
    finished_s: float  # when the step's bookkeeping was done (its outputs built)
    scheduled: list[ScheduledSeq]
    preempted: list[str]
    admitted: list[str]
    num_swapped_blocks: int
    waiting: list[str]
    swapped: list[str]
    num_running: int
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """The executor's time: the forward pass and sampling, or a simulated step's cost."""
        return self.end_s - self.start_s

    @property
    def step_s(self) -> float:
        """The whole step's time, scheduling and bookkeeping included."""
        return self.finished_s - self.began_s

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


StepObserver = Callable[[StepReport], None]


@dataclass
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    kv_cache_bytes: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_running: int
    num_waiting: int
    num_verify_steps: int = 0  # speculative decoding: a sequence's steps that carried drafts (vLLM's num_drafts)
    num_draft_tokens: int = 0  # … the draft tokens run through the model in them
    num_accepted_tokens: int = 0  # … and the ones it kept

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the model kept (0 with none drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying step: the kept drafts plus the model's own token (0 with none verified)."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}  # fmt: skip
