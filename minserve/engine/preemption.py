"""Preemption strategies: what happens to a running sequence when the KV cache has no block left for it.

Chosen like a scheduling policy (``preemption_mode="recompute"`` or ``"swap"``, or a strategy object), and
asked by the scheduler for its victim's fate. Two strategies, two prices for the same memory:

* :class:`Recompute`: its blocks are released and it goes back to waiting, to be recomputed later from its
  prompt and the tokens it already produced (nothing it produced is lost). Prefix caching often makes that
  cheap. It costs compute.
* :class:`Swap`: its KV blocks are copied to host memory and released; it waits *swapped* until blocks are
  free, then is copied back and carries on where it stopped. It costs copies over the host link. When host
  memory is full too, it falls back to recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minserve.config.scheduler import PREEMPTION_MODES
from minserve.engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from minserve.engine.batch import ScheduledBatch
    from minserve.engine.block_manager import BlockManager
    from minserve.engine.sequence import Sequence


class Preemption:
    """The interface: ``preempt`` takes a sequence already removed from the running batch and puts it where it
    waits; ``uses_host_memory`` says whether the block manager needs host blocks for it."""

    name = "preemption"
    uses_host_memory = False

    def preempt(self, seq: Sequence, block_manager: BlockManager, batch: ScheduledBatch) -> SequenceStatus:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Recompute(Preemption):
    name = "recompute"

    def preempt(self, seq: Sequence, block_manager: BlockManager, batch: ScheduledBatch) -> SequenceStatus:
        block_manager.free(seq)  # its computed tokens are forgotten: it is prefilled again when readmitted
        return SequenceStatus.WAITING


class Swap(Recompute):
    name = "swap"
    uses_host_memory = True

    def preempt(self, seq: Sequence, block_manager: BlockManager, batch: ScheduledBatch) -> SequenceStatus:
        if not block_manager.can_swap_out(seq):
            return super().preempt(seq, block_manager, batch)  # host memory is full as well
        batch.swap_out += block_manager.swap_out(seq)
        return SequenceStatus.SWAPPED


# One class for each name the configuration declares (minserve.config.scheduler.PREEMPTION_MODES).
PREEMPTIONS: dict[str, type[Preemption]] = {p.name: p for p in (Recompute, Swap)}


def make_preemption(mode: str | Preemption) -> Preemption:
    """A strategy from its name (``recompute``, ``swap``), or the object itself."""
    if isinstance(mode, Preemption):
        return mode
    if mode not in PREEMPTIONS:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES} or a Preemption, got {mode!r}")
    return PREEMPTIONS[mode]()
