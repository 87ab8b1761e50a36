"""Chapter 01's measurements and predictions: what a decode step costs, and each request's latency worked
out from it before it is compared with the measurement.

The prediction is the chapter's formula, E2E = TTFT + (n − 1) × step, made exact for a batch that shrinks:
all requests sent at once are prefilled in one shared first step, then each running request gets one token
per step, and a step costs what a step of that many sequences costs. That cost is measured on the engine by
:mod:`minserve.measure.decode` (:func:`measure_decode_steps`, and :func:`repeat_beside_step_costs` beside each
run it is compared with; both are importable from here), and :func:`prediction_table` adds the n − 1 step
costs each request waited through. Nothing of the run being predicted goes into the prediction except its
TTFT and its output lengths.

Also here: the targets a reading speed implies (:func:`reading_speed_table`), how much of a workload's
prompts a shared prefix repeats (:func:`shared_prefix_summary`), :mod:`minserve.slo` records that count a
request stopped at its deadline as failed (:func:`records_with_status`), and one table comparing runs
(:func:`serving_table`). Times are seconds unless a name says ``_ms``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from minserve import slo
from minserve.bench.workload import BenchRequest, count_corpus_tokens
from minserve.engine.outputs import RequestOutput

# Chapter 01 calls these as contract.measure_decode_steps and contract.repeat_beside_step_costs.
from minserve.measure.decode import StepCosts, measure_decode_steps, repeat_beside_step_costs  # noqa: F401

TOKENS_PER_ENGLISH_WORD = 1.3  # a common rule of thumb for English BPE tokenizers (≈ 0.75 words per token)
FAILED_REASONS = ("deadline", "error")  # the server gave up on the request
CANCELLED_REASONS = ("cancelled",)  # the client left


# --- each request's latency, predicted -----------------------------------------------------------------------


def decode_occupancy(output_lengths: Sequence[int]) -> list[int]:
    """Sequences in each decode step when all requests start together: step k (k = 1, 2, …) gives token
    k + 1 to every request that asked for more than k tokens. ``[1, 3, 2]`` → ``[2, 1]``."""
    longest = max(output_lengths, default=0)
    return [sum(n > k for n in output_lengths) for k in range(1, longest)]


def predicted_e2e_s(ttft_s: float, output_tokens: int, occupancy: Sequence[int], costs: StepCosts) -> float:
    """TTFT + the cost of the n − 1 decode steps the request is in: Σₖ step(sequences in step k), k < n."""
    return ttft_s + sum(costs.at(b) for b in occupancy[: output_tokens - 1])


def prediction_table(records: Sequence[slo.RequestRecord], costs: StepCosts) -> pd.DataFrame:
    """One row per request (sorted by output length): its TTFT, measured and predicted E2E in ms, their
    ratio, and the naive prediction TTFT + (n − 1) × one sequence's step, as if a step's cost did not
    depend on how many sequences share it."""
    occupancy = decode_occupancy([r.output_tokens for r in records])
    single = costs.at(1)
    rows = [
        {
            "request": r.request_id,
            "output tokens": r.output_tokens,
            "TTFT ms": r.ttft_s * 1e3,
            "measured E2E ms": r.e2e_s * 1e3,
            "predicted E2E ms": predicted_e2e_s(r.ttft_s, r.output_tokens, occupancy, costs) * 1e3,
            "one-sequence steps ms": (r.ttft_s + (r.output_tokens - 1) * single) * 1e3,
        }
        for r in records
        if r.ok and r.ttft_s is not None
    ]
    table = pd.DataFrame(rows).sort_values(["output tokens", "request"], ignore_index=True)
    table["measured / predicted"] = table["measured E2E ms"] / table["predicted E2E ms"]
    return table


def median_prediction_table(runs: Sequence[Sequence[slo.RequestRecord]], costs: StepCosts) -> pd.DataFrame:
    """:func:`prediction_table` over several runs of the same requests, row by row the median of each
    column: one run slowed by another process on the machine moves the median little."""
    tables = [prediction_table(records, costs) for records in runs]
    numeric = [t.drop(columns="request") for t in tables]
    median = pd.concat(numeric).groupby(level=0).median()
    return median.assign(request=tables[0]["request"])[tables[0].columns]


# --- why the targets are what they are -----------------------------------------------------------------------


def reading_speed_table(
    words_per_s: Sequence[float] = (5.0, 10.0), tokens_per_word: float = TOKENS_PER_ENGLISH_WORD
) -> pd.DataFrame:
    """The stream a reader needs: at w words/s and t tokens/word, w·t tokens/s, so TPOT ≤ 1000 / (w·t) ms.

    A stream slower than that makes the reader wait for words; one much faster gains them nothing.
    """
    rows = {w: {"tokens/s": w * tokens_per_word, "TPOT bound ms": 1e3 / (w * tokens_per_word)} for w in words_per_s}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("reader's words/s")


def tokens_per_word(outputs: Sequence[RequestOutput]) -> float:
    """Output tokens per whitespace-separated word over ``outputs``: the tokenizer's own ratio on its replies."""
    words = sum(len(out.text.split()) for out in outputs)
    return sum(len(out.token_ids) for out in outputs) / words if words else float("nan")


# --- the workload's shape ---------------------------------------------------------------------------------------


def shared_prefix_summary(requests: Sequence[BenchRequest], prefix_tokens: int) -> dict[str, float]:
    """How many requests start with the shared prefix, and the share of all prompt tokens that repeat it
    (in the workload's corpus tokens, :func:`~minserve.bench.workload.count_corpus_tokens`): the prefill a
    prefix cache (chapter 04) computes once instead of once per request."""
    sharing = sum(r.shares_prefix for r in requests)
    total = sum(count_corpus_tokens(r.prompt) for r in requests if isinstance(r.prompt, str))
    repeated = max(sharing - 1, 0) * prefix_tokens  # the first request with the prefix has to compute it
    return {
        "requests": len(requests),
        "sharing the prefix": sharing,
        "prompt tokens": total,
        "repeated prefix tokens": repeated,
        "share repeated": repeated / total if total else 0.0,
    }


# --- records and tables ----------------------------------------------------------------------------------------


def records_with_status(outputs: Sequence[RequestOutput]) -> list[slo.RequestRecord]:
    """:mod:`minserve.slo` records whose status follows the finish reason: a request the engine stopped at
    its deadline (or that failed) is ``failed``, a cancelled one ``cancelled``, the rest ``ok``."""

    def status(out: RequestOutput) -> slo.Status:
        if out.finish_reason in FAILED_REASONS or not out.finished:
            return "failed"
        return "cancelled" if out.finish_reason in CANCELLED_REASONS else "ok"

    return [
        slo.record_from_metrics(out.metrics, status(out), len(out.prompt_token_ids), out.request_id) for out in outputs
    ]


def serving_table(
    runs: Mapping[str, Sequence[slo.RequestRecord]], contract: slo.SLO, usd_per_accelerator_hour: float
) -> pd.DataFrame:
    """One column per run: TTFT and TPOT p50 and the worst TTFT in ms, attainment and goodput under
    ``contract``, output tokens/s and US$ per million output tokens."""

    def column(records: Sequence[slo.RequestRecord]) -> dict[str, float]:
        table = slo.summary_table(records, percentiles=(50, 100))
        tokens_per_s = slo.token_throughput_tps(records)
        return {
            "TTFT p50 ms": table.loc["ttft_ms", "p50"],
            "TTFT max ms": table.loc["ttft_ms", "p100"],
            "TPOT p50 ms": table.loc["tpot_ms", "p50"],
            f"{contract.name} attainment": slo.attainment(records, contract)["all"],
            f"{contract.name} goodput req/s": slo.goodput_rps(records, contract),
            "output tokens/s": tokens_per_s,
            "$ per M tokens": slo.cost_per_million_tokens(usd_per_accelerator_hour, tokens_per_s),
        }

    return pd.DataFrame({name: column(records) for name, records in runs.items()})
