"""Prefill and decode measured on the real engine, each point beside the roofline's prediction.

* **Prefill by prompt length**: one request at a time, a fresh prompt each time (random token ids, so the
  prefix cache never hits), ``max_tokens=1``; the time is every ``engine.step()`` from the first to the one
  that samples the first token (one step, unless the prompt is longer than the step's token budget and is
  chunked).
* **Decode step by batch and context**: ``B`` fresh prompts of about ``S`` tokens are prefilled together;
  once every one of them is decoding, the next steps are *pure decode steps* (all ``B`` sequences, one token
  each, nothing else) and each ``engine.step()`` is timed. Each point also keeps the executor's time alone
  (the forward pass and sampling), so the Python around it (scheduling, detokenizing) shows.

The steps are run and timed by :mod:`minserve.measure.decode` (every time is a step report's, the engine
core's own); this module adds the roofline's prediction to each point. A warm-up runs first, each point takes
the median of its repeats, and garbage collection is paused while a step is timed. Nothing here asserts a
speed: the chapters lay the numbers beside :mod:`minserve.capacity.roofline`'s, which are lower bounds. On a
CPU with a tiny model the measurement sits far above the roofline (every step pays a fixed overhead the
roofline does not model); that gap is part of what chapter 03 shows.

Results are plain frozen dataclasses; :meth:`Profile.to_dataframe` imports pandas only when called.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minserve.capacity.kv import blocks_per_sequence
from minserve.capacity.roofline import Hardware, Prediction, measure_this_machine, predict_decode, predict_prefill
from minserve.engine.engine import LLMEngine
from minserve.measure.decode import prefill_reports, pure_decode_reports
from minserve.measure.prompts import SeededPrompts
from minserve.measure.steps import context_tokens, is_decode

if TYPE_CHECKING:
    import pandas as pd

    from minserve.engine.llm import LLM

DEFAULT_PROMPT_LENGTHS = (16, 64, 256, 1024)
DEFAULT_BATCH_SIZES = (1, 4, 16, 64)
DEFAULT_CONTEXT_LENGTHS = (64, 512)
WARM_UP_SEED = 1_000_000  # the warm-up's prompts: apart from every sweep's (seeds 0, 1, …)


@dataclass(frozen=True)
class PrefillPoint:
    """One prompt length: measured prefill time (median of the repeats) and the roofline's prediction."""

    prompt_tokens: int
    time_s: float
    times_s: tuple[float, ...]
    predicted: Prediction

    @property
    def predicted_s(self) -> float:
        return self.predicted.time_s

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.time_s


@dataclass(frozen=True)
class DecodePoint:
    """One batch size and context length: measured decode step time (median) and the prediction.

    ``context_tokens`` is the mean number of keys each new token attended to over the timed steps (the prompt,
    the tokens generated so far, and itself), which is what the prediction uses.
    """

    batch: int
    prompt_tokens: int
    context_tokens: int
    step_s: float  # whole engine.step(): schedule, forward, sample, detokenize
    steps_s: tuple[float, ...]
    forward_s: float | None  # the executor's share (forward and sampling), from the step reports
    predicted: Prediction

    @property
    def predicted_s(self) -> float:
        return self.predicted.time_s

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second across the batch: one per sequence per step."""
        return self.batch / self.step_s


@dataclass(frozen=True)
class Profile:
    """A prefill sweep and a decode sweep on one engine, with the hardware the predictions used."""

    model: str
    device: str
    dtype: str
    hardware: Hardware
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    wall_s: float

    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per point (phase, sizes, measured and predicted seconds, the binding roof)."""
        rows = []
        for p in self.prefill:
            rows.append(_row("prefill", p.prompt_tokens, 1, p.prompt_tokens, p.time_s, None, p.predicted))
        for d in self.decode:
            rows.append(_row("decode", 1, d.batch, d.context_tokens, d.step_s, d.forward_s, d.predicted))
        return rows

    def to_dataframe(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.rows())


def _row(
    phase: str, tokens: int, batch: int, context: int, measured_s: float, forward_s: float | None, pred: Prediction
) -> dict[str, Any]:
    return {
        "phase": phase,
        "tokens": tokens,  # new tokens per sequence
        "batch": batch,
        "context_tokens": context,
        "measured_s": measured_s,
        "forward_s": forward_s,
        "predicted_s": pred.time_s,
        "bound": pred.bound,
        "flops": pred.flops,
        "bytes": pred.bytes,
        "intensity_flops_per_byte": pred.intensity_flops_per_byte,
    }


# --- the sweeps ---------------------------------------------------------------------------------------------


def profile(
    llm: LLM | LLMEngine,
    hardware: Hardware | None = None,
    prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    repeats: int = 3,
    decode_steps: int = 8,
    seed: int = 0,
) -> Profile:
    """Warm up, then both sweeps. ``hardware`` defaults to this machine, measured (see
    :func:`~minserve.capacity.roofline.measure_this_machine`) on the engine's device in its dtype.

    The defaults take about 5 s on a 2-core CPU with the embedded model (plus loading it).
    """
    start_s = time.perf_counter()
    engine = _engine(llm)
    _check_prefill_sweep(engine, prompt_lengths, repeats)
    _check_decode_sweep(engine, batch_sizes, context_lengths, decode_steps)
    hw = hardware or _measure_for(engine)
    prompts = SeededPrompts(engine.model_config.vocab_size, seed)
    warm_up(engine, prompts)
    prefill = profile_prefill(engine, prompt_lengths, repeats, hw, _prompts=prompts)
    decode = profile_decode(engine, batch_sizes, context_lengths, decode_steps, hw, _prompts=prompts)
    return Profile(
        model=engine.config.checkpoint.model,
        device=str(engine.device),
        dtype=_dtype_name(engine),
        hardware=hw,
        prefill=tuple(prefill),
        decode=tuple(decode),
        wall_s=time.perf_counter() - start_s,
    )


def profile_prefill(
    llm: LLM | LLMEngine,
    prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
    repeats: int = 3,
    hardware: Hardware | None = None,
    seed: int = 0,
    *,
    _prompts: SeededPrompts | None = None,
) -> list[PrefillPoint]:
    """Prefill time of one request by prompt length, fresh prompts each time, median of ``repeats``."""
    engine = _engine(llm)
    _check_prefill_sweep(engine, prompt_lengths, repeats)
    hw = hardware or _measure_for(engine)
    prompts = _prompts or SeededPrompts(engine.model_config.vocab_size, seed)
    if _prompts is None:
        warm_up(engine, prompts)
    points = []
    for length in prompt_lengths:
        times = [_time_prefill(engine, prompts.fresh(length)) for _ in range(repeats)]
        predicted = predict_prefill(engine.model_config, length, hw, _dtype_name(engine))
        points.append(PrefillPoint(length, statistics.median(times), tuple(times), predicted))
    return points


def profile_decode(
    llm: LLM | LLMEngine,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    steps: int = 8,
    hardware: Hardware | None = None,
    seed: int = 0,
    *,
    _prompts: SeededPrompts | None = None,
) -> list[DecodePoint]:
    """Decode step time for every (batch, context) pair: ``steps`` pure decode steps timed, median kept.
    ``_prompts`` may be a :class:`~minserve.measure.prompts.RepeatedPrompts` (rewound by the caller) to reuse
    cached prompts."""
    engine = _engine(llm)
    _check_decode_sweep(engine, batch_sizes, context_lengths, steps)
    hw = hardware or _measure_for(engine)
    prompts = _prompts or SeededPrompts(engine.model_config.vocab_size, seed)
    if _prompts is None:
        warm_up(engine, prompts)
    points = []
    for context in context_lengths:
        for batch in batch_sizes:
            points.append(_time_decode(engine, prompts, batch, context, steps, hw))
    return points


def warm_up(llm: LLM | LLMEngine, prompts: SeededPrompts | None = None) -> None:
    """A few untimed steps, so the first measured point does not pay for first-call allocations."""
    engine = _engine(llm)
    prompts = prompts or SeededPrompts(engine.model_config.vocab_size, seed=WARM_UP_SEED)
    length = min(64, engine.max_model_len - 4)
    _time_prefill(engine, prompts.fresh(length))
    _time_decode(engine, prompts, min(4, engine.scheduler_config.max_num_seqs), length, 2, None)


# --- measuring: the steps come from minserve.measure.decode, the predictions from the roofline ----------------


def _time_prefill(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds of the steps that prefill ``prompt`` alone, whole steps from the engine's reports."""
    return sum(report.step_s for report in prefill_reports(engine, prompt))


def _time_decode(
    engine: LLMEngine, prompts: SeededPrompts, batch: int, context: int, steps: int, hw: Hardware | None
) -> DecodePoint | None:
    """Prefill ``batch`` fresh prompts of ``context`` tokens, then time ``steps`` pure decode steps."""
    reports = pure_decode_reports(engine, [prompts.fresh(context) for _ in range(batch)], steps)
    if hw is None:
        return None
    times = [report.step_s for report in reports]
    forwards = [report.duration_s for report in reports if is_decode(report)]  # the forward pass and sampling
    mean_context = round(statistics.fmean(context_tokens(report) for report in reports))
    return DecodePoint(
        batch=batch,
        prompt_tokens=context,
        context_tokens=mean_context,
        step_s=statistics.median(times),
        steps_s=tuple(times),
        forward_s=statistics.median(forwards) if len(forwards) == steps else None,
        predicted=predict_decode(engine.model_config, batch, mean_context, hw, _dtype_name(engine)),
    )


def _check_prefill_sweep(engine: LLMEngine, prompt_lengths: Sequence[int], repeats: int) -> None:
    """Refuse, before anything runs, a sweep the engine cannot run as asked."""
    _require_idle(engine)
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    for length in prompt_lengths:
        if not 1 <= length < engine.max_model_len:
            limit = engine.max_model_len - 1
            raise ValueError(f"prompt length {length} must be between 1 and max_model_len − 1 = {limit}")


def _check_decode_sweep(
    engine: LLMEngine, batch_sizes: Sequence[int], context_lengths: Sequence[int], steps: int
) -> None:
    _require_idle(engine)
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    for context in context_lengths:
        for batch in batch_sizes:
            _check_decode_fits(engine, batch, context, steps)


def _check_decode_fits(engine: LLMEngine, batch: int, context: int, steps: int) -> None:
    """Refuse a point the engine would have to preempt or cut short."""
    max_seqs, num_blocks = engine.scheduler_config.max_num_seqs, engine.scheduler_config.num_kv_blocks
    if not 1 <= batch <= max_seqs:
        raise ValueError(f"batch {batch} must be between 1 and the engine's max_num_seqs ({max_seqs})")
    if context < 1:
        raise ValueError(f"context length must be positive, got {context}")
    # While the batch's prompts are prefilled in chunks, the sequences done first already decode.
    stagger = -(-batch * context // engine.scheduler_config.max_num_batched_tokens) + 1
    longest = context + stagger + steps + 2
    if longest >= engine.max_model_len:
        raise ValueError(
            f"context {context} + {stagger + steps + 2} decoded tokens reaches max_model_len {engine.max_model_len}"
        )
    needed = batch * blocks_per_sequence(longest, engine.config.scheduler.block_size)
    if needed > num_blocks:
        raise ValueError(f"batch {batch} × context {context} needs {needed} KV blocks; the engine has {num_blocks}")


def _engine(llm: LLM | LLMEngine) -> LLMEngine:
    engine = getattr(llm, "engine", llm)
    if not isinstance(engine, LLMEngine):
        raise TypeError(f"expected an LLM or an LLMEngine, got {type(llm).__name__}")
    return engine


def _require_idle(engine: LLMEngine) -> None:
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; profile an idle engine, or the batches mix")


def _dtype_name(engine: LLMEngine) -> str:
    return str(engine.dtype).removeprefix("torch.")


def _measure_for(engine: LLMEngine) -> Hardware:
    return measure_this_machine(device=engine.device.type, dtype=_dtype_name(engine))
