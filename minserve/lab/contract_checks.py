"""Chapter 01's checks: the chapter's claims about the engine, held against what was measured.

Each ``check_*`` function raises ``AssertionError`` (saying what differed) unless the measurement shows the
property, and returns a short sentence of what it found, for the notebook to print. Each one fails on an
engine without the property, or on numbers that do not add up (tests/test_ch01_checks.py shows it): an
engine with one seat (``max_num_seqs=1``) fails :func:`check_shared_first_step`, :func:`check_finish_order`
and :func:`check_batching_pays`; a prediction off by 2× fails :func:`check_e2e_prediction`; an engine that
ignores deadlines fails :func:`check_deadline_failures`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from minserve import slo
from minserve.engine.outputs import RequestOutput
from minserve.lab.checks import require
from minserve.lab.contract import records_with_status


def check_e2e_prediction(table: pd.DataFrame, margin: float = 0.3, share: float = 0.8) -> str:
    """The prediction from the step cost holds: at least ``share`` of the requests with two tokens or more
    have a measured E2E within ×/÷ (1 + ``margin``) of the predicted one, and so does the median request.

    ``table`` is :func:`minserve.lab.contract.prediction_table`'s. The share, not every request, because one
    step slowed by another process on a shared machine can move a short request out of the band.
    """
    ratios = table.loc[table["output tokens"] >= 2, "measured / predicted"]
    require(len(ratios) > 0, "no request with two tokens or more to compare")
    inside = ratios.between(1 / (1 + margin), 1 + margin)
    median = float(ratios.median())
    require(
        inside.mean() >= share and 1 / (1 + margin) <= median <= 1 + margin,
        f"only {inside.mean():.0%} of requests within ×/÷ {1 + margin:g} of the prediction (need {share:.0%}); "
        f"median measured / predicted {median:.2f}, range {ratios.min():.2f}–{ratios.max():.2f}",
    )
    return (
        f"E2E predicted from the step cost: {inside.mean():.0%} of {len(ratios)} requests within ×/÷ "
        f"{1 + margin:g}, median measured / predicted {median:.3f}"
    )


def ttft_spread_s(records: Sequence[slo.RequestRecord]) -> float:
    """The slowest first token minus the fastest, seconds, over the ok requests that produced one."""
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    require(len(ttfts) > 0, "no request produced a token")
    return max(ttfts) - min(ttfts)


def check_shared_first_step(records: Sequence[slo.RequestRecord], step_s: float, under_steps: float = 0.5) -> str:
    """Requests sent together got their first tokens from one shared step: the TTFT spread (slowest first
    token − fastest) is under ``under_steps`` decode steps of ``step_s``. One at a time, a request's TTFT
    would include everyone in front of it (a spread of many steps)."""
    spread, bound_s = ttft_spread_s(records), under_steps * step_s
    require(
        spread < bound_s,
        f"TTFT spread {spread * 1e3:.2f} ms ≥ {under_steps:g} decode step ({bound_s * 1e3:.2f} ms): the requests "
        "were not all prefilled in the first step",
    )
    return (
        f"{len(records)} requests, one first step: TTFT spread {spread * 1e3:.3f} ms "
        f"(bound: {under_steps:g} step = {bound_s * 1e3:.2f} ms)"
    )


def check_finish_order(records: Sequence[slo.RequestRecord]) -> str:
    """In one batch that decodes side by side, a longer answer finishes strictly later than a shorter one, so
    the tail of E2E belongs to the longest answers. Served one at a time, the order would be the queue's."""
    ok = [r for r in records if r.ok]
    out_of_order = [
        (short.request_id, long.request_id)
        for short in ok
        for long in ok
        if short.output_tokens < long.output_tokens and short.e2e_s >= long.e2e_s
    ]
    require(
        not out_of_order,
        f"{len(out_of_order)} pairs where the shorter answer did not finish first, e.g. {out_of_order[:3]}",
    )
    slowest = max(ok, key=lambda r: r.e2e_s)
    return f"finish order follows output length; the slowest request is a longest one ({slowest.output_tokens} tokens)"


def check_batching_pays(
    batched: Sequence[slo.RequestRecord], serial: Sequence[slo.RequestRecord], contract: slo.SLO, gain: float = 2.0
) -> str:
    """The same requests served together rather than one at a time give at least ``gain`` × the output tokens
    per second, and at least ``gain`` × the goodput under ``contract``: batching is what makes a step's cost
    shared, and the queue of a one-seat engine is what its TTFT pays for."""
    tokens = slo.token_throughput_tps(batched), slo.token_throughput_tps(serial)
    goodput = slo.goodput_rps(batched, contract), slo.goodput_rps(serial, contract)
    require(tokens[0] >= gain * tokens[1], f"tokens/s together {tokens[0]:.0f}, one at a time {tokens[1]:.0f}")
    require(
        goodput[0] >= gain * goodput[1],
        f"{contract.name} goodput together {goodput[0]:.2f} req/s, one at a time {goodput[1]:.2f} req/s",
    )
    return (
        f"together vs one at a time: {tokens[0] / tokens[1]:.1f}× the tokens/s, "
        f"{goodput[0] / max(goodput[1], 1e-12):.1f}× the {contract.name} goodput"
    )


def check_deadline_failures(
    outputs: Sequence[RequestOutput], deadlines_s: Sequence[float | None], asked_tokens: Sequence[int]
) -> str:
    """The engine stopped every request given a deadline shorter than its predicted end, with fewer tokens than
    it asked for, and finished every other with all of them; the stopped ones count as failed, so availability
    is the share that finished. ``deadlines_s`` is what was passed to ``generate`` (``None``: no deadline)."""
    for out, deadline, asked in zip(outputs, deadlines_s, asked_tokens, strict=True):
        produced = len(out.token_ids)
        if deadline is None:
            require(
                out.finish_reason in ("length", "stop") and produced == asked,
                f"request {out.request_id} had no deadline but ended {out.finish_reason!r} after {produced}/{asked}",
            )
        else:
            require(
                out.finish_reason == "deadline" and produced < asked,
                f"request {out.request_id} had a deadline of {deadline * 1e3:.0f} ms but ended "
                f"{out.finish_reason!r} after {produced}/{asked} tokens",
            )
    measured = slo.availability(records_with_status(outputs))
    expected = sum(d is None for d in deadlines_s) / len(deadlines_s)
    require(abs(measured - expected) < 1e-9, f"availability {measured:.3f}, expected {expected:.3f}")
    stopped = sum(d is not None for d in deadlines_s)
    return f"{stopped} requests stopped at their deadline, counted as failed: availability {measured:.3f}"


def check_chat_reply(output: RequestOutput, expected_word: str) -> str:
    """A real chat model's reply ends on the chat template's end of turn (``stop``, not the length cap) and
    contains ``expected_word`` (case-insensitive)."""
    require(output.finish_reason == "stop", f"the reply ended {output.finish_reason!r}, not at the end of turn")
    require(expected_word.lower() in output.text.lower(), f"{expected_word!r} is not in the reply {output.text!r}")
    return f"the reply ends on its end of turn and says {expected_word!r}"


def check_batching_gain(
    alone: Sequence[slo.RequestRecord], together: Sequence[slo.RequestRecord], gain: float = 1.25
) -> str:
    """Requests sent together produce output tokens more than ``gain`` × faster than one request alone. An
    engine that ran one sequence per step would give about the same rate for both."""
    rates = slo.token_throughput_tps(alone), slo.token_throughput_tps(together)
    require(rates[1] > gain * rates[0], f"together {rates[1]:.1f} tokens/s, alone {rates[0]:.1f} tokens/s")
    return f"together {rates[1]:.1f} tokens/s, alone {rates[0]:.1f}: {rates[1] / rates[0]:.2f}× (need > {gain:g}×)"
