"""One step's work as the scheduler hands it on: which sequences, how many tokens of each, what to copy.

The scheduler builds it (:mod:`minserve.engine.scheduler`), preemption adds to it
(:mod:`minserve.engine.preemption`), and the executor and the engine core read it. It lives in its own module
so that all of them can name it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minserve.engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of its tokens to run through the model."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # went from waiting (or swapped) to running
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block) to copy
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block) to copy
    # Per sequence: whether this step computes all it has, so the step samples its next token. Decided
    # here, once, for the executor (which rows to sample) and the core (which sequences get a token).
    samples: list[bool] = field(default_factory=list)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new)
        self.samples.append(seq.completes_with(num_new))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)
