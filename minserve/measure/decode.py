"""What a prefill and a decode step cost on the engine, read from its step reports (:mod:`.steps`).

Two experiments, each a different question:

* **Step costs by batch size** (chapter 01's prediction): for each batch size b, b copies of one prompt are
  generated and the median time between consecutive pure decode steps of b sequences is kept
  (:func:`measure_decode_steps`); :func:`repeat_beside_step_costs` interleaves that measurement with the
  runs it predicts, so a shared machine's drift moves both alike.
* **Pure decode steps at a context** (the profiler's measuring half, chapter 03): ``B`` fresh prompts of
  ``S`` tokens prefilled together, untimed; then ``steps`` steps in which every sequence decodes one token
  and nothing else runs (:func:`pure_decode_reports`). :func:`prefill_reports` is one prompt's prefill.

Times are seconds on the engine core's clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from minserve.engine.sampling_params import SamplingParams
from minserve.engine.step_report import StepReport
from minserve.measure.steps import StepRecorder, decode_periods, gc_paused

if TYPE_CHECKING:
    import pandas as pd

    from minserve.engine.engine import LLMEngine
    from minserve.engine.llm import LLM

T = TypeVar("T")
GREEDY_TO_THE_END = dict(temperature=0.0, ignore_eos=True)


# --- step costs by batch size ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCosts:
    """The measured time of one decode step (seconds, step end to step end) at a few batch sizes.

    :meth:`at` interpolates linearly between measured sizes and holds the end values beyond them.
    """

    batch_sizes: tuple[int, ...]
    step_s: tuple[float, ...]

    def at(self, batch_size: int) -> float:
        """Seconds of one decode step of ``batch_size`` sequences."""
        return float(np.interp(batch_size, self.batch_sizes, self.step_s))

    def table(self) -> pd.DataFrame:
        """One row per measured batch size: the step in ms, and tokens/s (batch / step)."""
        import pandas as pd

        rows = {b: {"step ms": s * 1e3, "tokens/s": b / s} for b, s in zip(self.batch_sizes, self.step_s)}
        return pd.DataFrame.from_dict(rows, orient="index").rename_axis("sequences per step")


def measure_decode_steps(
    llm: LLM, prompt: str, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), tokens: int = 24, rounds: int = 3
) -> StepCosts:
    """For each batch size b, run b copies of ``prompt`` for ``tokens`` tokens and take the median time
    between consecutive decode steps of b sequences, from the engine's step reports.

    Step end to step end is what a streaming client sees between two tokens: the forward pass, sampling and
    the engine's bookkeeping. The median leaves out a step that another process on the machine slowed; the
    ``rounds`` go through every batch size in turn, so a slow stretch of seconds touches each size alike.
    """
    costs, _ = repeat_beside_step_costs(llm, prompt, lambda: None, batch_sizes, tokens, rounds)
    return costs


def repeat_beside_step_costs(
    llm: LLM,
    prompt: str,
    run: Callable[[], T],
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    tokens: int = 24,
    rounds: int = 3,
) -> tuple[StepCosts, list[T]]:
    """``rounds`` times: measure one decode step at each batch size (as :func:`measure_decode_steps`), then
    call ``run``; return the step costs pooled over the rounds and what each ``run`` returned.

    A prediction compared with a measurement needs both taken on the same machine *state*: a shared CPU's
    speed drifts by tens of percent over a minute (another process, a changing clock), so step costs measured
    a minute before the run can be off by more than the margin a check allows. Interleaved, a drift moves
    the costs and the runs alike.
    """
    periods: dict[int, list[float]] = {b: [] for b in batch_sizes}
    results: list[T] = []
    for _ in range(rounds):
        for b in batch_sizes:
            periods[b] += _copies_decode_periods(llm, prompt, b, tokens)
        results.append(run())
    return StepCosts(tuple(batch_sizes), tuple(statistics.median(periods[b]) for b in batch_sizes)), results


def _copies_decode_periods(llm: LLM, prompt: str, batch: int, tokens: int) -> list[float]:
    """The decode periods of ``batch`` copies of ``prompt`` generated together for ``tokens`` tokens."""
    with StepRecorder(llm.engine.core) as recorder:
        llm.generate([prompt] * batch, SamplingParams(max_tokens=tokens, **GREEDY_TO_THE_END))
    periods = decode_periods(recorder.reports, batch)
    if not periods:
        raise ValueError(f"no decode step of {batch} sequences was measured: is max_num_seqs below {batch}?")
    return periods


# --- one prefill, and pure decode steps at a context -----------------------------------------------------


def prefill_reports(engine: LLMEngine, prompt: list[int]) -> list[StepReport]:
    """The steps from adding ``prompt`` alone (``max_tokens=1``) to the one that samples its first token (one
    step, unless the prompt is longer than the step's token budget and is chunked). The engine must be idle."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY_TO_THE_END))
    done = False
    with StepRecorder(engine.core) as recorder, gc_paused():
        while not done:
            done = any(o.request_id == request_id and o.finished for o in engine.step())
    return recorder.reports


def pure_decode_reports(engine: LLMEngine, prompts: Sequence[list[int]], steps: int) -> list[StepReport]:
    """Prefill ``prompts`` together (untimed, chunked and staggered as the scheduler likes), run one untimed
    decode step for the new batch shape, then ``steps`` pure decode steps of all of them; their reports.

    Each request asks for the rest of the context window, so none finishes early; all are aborted afterwards
    and the engine is left idle. Raises ``RuntimeError`` if a step would not be a pure decode step of the
    batch (preempted, or other requests in flight). The caller checks the point fits (blocks, context).
    """
    longest = max(len(p) for p in prompts)
    params = SamplingParams(max_tokens=engine.max_model_len - longest, **GREEDY_TO_THE_END)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    seqs = [engine.core.requests[i] for i in ids]
    recorder = StepRecorder(engine.core)
    try:
        while any(not seq.output_token_ids for seq in seqs):  # prefill: untimed
            engine.step()
        engine.step()  # one untimed decode step for the new batch shape
        with recorder:
            for _ in range(steps):
                _require_pure_decode(engine, len(seqs))
                with gc_paused():
                    engine.step()
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
        engine.process_aborts()
    return recorder.reports


def _require_pure_decode(engine: LLMEngine, batch: int) -> None:
    running = engine.core.scheduler.running
    pure = not engine.core.scheduler.waiting and len(running) == batch
    pure = pure and all(seq.num_uncomputed_tokens == 1 and seq.output_token_ids for seq in running)
    if not pure:
        raise RuntimeError("the next step is not a pure decode step of the batch (preempted, or other requests)")
