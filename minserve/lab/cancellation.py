"""Chapter 05's cancellation experiment: a request cancelled mid-decode, what it hands back, and who goes on.

:func:`run_with_cancel` is :func:`~minserve.lab.engine_runs.run_engine` with one request cancelled after a
given step (as a client that hangs up would: ``abort_request``, processed at the start of the next step),
recording after every step the KV blocks in use and the blocks each request in flight holds.
:func:`check_cancellation` holds it to the claim: the cancelled request's blocks come back to the pool at the
next step, its seat goes to the next in line, and every other request finishes exactly as without the cancel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from minserve.capacity.simulator import SimRequest
from minserve.engine.step_report import StepReport
from minserve.lab.checks import require
from minserve.lab.engine_runs import RUNNING_STATES, EngineRun, run_engine
from minserve.measure.steps import StepRecorder

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


@dataclass
class CancelledRun:
    """A run with one request cancelled: the :class:`EngineRun`, who was cancelled after which step, and per
    step (``step``, from 1 as in the run) the pool's ``used_blocks`` and each live request's blocks
    (``held``: request id → blocks in its table, after the step)."""

    run: EngineRun
    cancelled_id: str
    cancel_after_step: int
    blocks: pd.DataFrame

    def held(self, step: int) -> dict[str, int]:
        return self.blocks.set_index("step").loc[step, "held"]

    def used(self, step: int) -> int:
        return int(self.blocks.set_index("step").loc[step, "used_blocks"])

    def first_running_step(self, request_id: str) -> int:
        return first_running_step(self.run, request_id)


def first_running_step(run: EngineRun, request_id: str) -> int:
    """The first step in which the request ran (its prompt, or a chunk of it)."""
    occ = run.occupancy
    return int(occ[(occ["request_id"] == request_id) & occ["state"].isin(RUNNING_STATES)]["step"].min())


def run_with_cancel(
    llm: LLM,
    requests: Sequence[SimRequest],
    cancelled_id: str,
    cancel_after_step: int,
    at_steps: Sequence[int] | None = None,
) -> CancelledRun:
    """Serve ``requests`` as :func:`run_engine` does (``at_steps`` default: all at once), cancelling
    ``cancelled_id`` once ``cancel_after_step`` steps have run, and record every step's KV blocks."""
    core = llm.engine.core
    base_step = core.num_steps
    rows: list[dict[str, Any]] = []

    def observe(report: StepReport) -> None:
        step = report.index - base_step
        held = {rid: len(seq.block_table) for rid, seq in core.requests.items()}
        rows.append({"step": step, "used_blocks": core.block_manager.num_used_blocks, "held": held})
        if step == cancel_after_step:
            core.abort(cancelled_id)  # the client hangs up: the engine drops it at the start of the next step

    with StepRecorder(core, probe=observe):
        run = run_engine(llm, requests, at_steps=[0] * len(requests) if at_steps is None else at_steps)
    return CancelledRun(run, cancelled_id, cancel_after_step, pd.DataFrame(rows))


def check_cancellation(cancelled: CancelledRun, reference: EngineRun) -> dict[str, Any]:
    """The claim, on a run with a cancel and the same requests run without (``reference``):

    * the cancelled request ended ``"cancelled"`` with fewer tokens than it asked for, and held KV blocks
      when the cancel came;
    * one step later it holds none, and the pool's blocks in use are exactly those the requests still in
      flight hold: its blocks came back, none leaked;
    * a request waiting for a seat then ran at that very next step, sooner than in the reference run;
    * every other request finished with all its tokens, the very tokens of the reference run;
    * at the end the pool is empty.
    """
    victim, step = cancelled.cancelled_id, cancelled.cancel_after_step
    run = cancelled.run
    out = run.output(victim)
    asked = {r.request_id: r.output_tokens for r in run.requests}
    require(out.finish_reason == "cancelled", f"{victim} finished {out.finish_reason!r}, not 'cancelled'")
    require(len(out.token_ids) < asked[victim], f"{victim} produced all its tokens: cancelled too late")
    handed_back = cancelled.held(step).get(victim, 0)
    require(handed_back > 0, f"{victim} held no block when cancelled")
    after = cancelled.held(step + 1)
    require(victim not in after, f"{victim} is still in flight a step after its cancel")
    require(
        cancelled.used(step + 1) == sum(after.values()),
        f"a step after the cancel {cancelled.used(step + 1)} blocks are in use; the live requests hold "
        f"{sum(after.values())}",
    )
    waiting = [rid for rid in run.request_ids if rid != victim and first_running_step(run, rid) > step]
    require(bool(waiting), "no request was waiting for a seat when the cancel came")
    taker = waiting[0]
    took, without = first_running_step(run, taker), first_running_step(reference, taker)
    require(took == step + 1 and took < without, f"{taker} ran at step {took} (without the cancel, {without})")
    expected = {o.request_id: o.token_ids for o in reference.outputs}
    for o in run.outputs:
        if o.request_id != victim:
            require(o.finish_reason == "length" and len(o.token_ids) == asked[o.request_id], f"{o.request_id} cut")
            require(o.token_ids == expected[o.request_id], f"{o.request_id}: other tokens than without the cancel")
    require(int(cancelled.blocks["used_blocks"].iloc[-1]) == 0, "blocks still in use at the end")
    return {"blocks_handed_back": handed_back, "seat_taken_by": taker, "ran_at_step": took, "without_cancel": without}
