"""Chapter 05's checks: the scheduler's claims held against runs of the engine, and the calibrated cost
model's prediction of a step held against the step measured.

Each ``check_*`` function raises ``AssertionError`` (saying what differed) unless the runs show the property,
and returns the numbers it compared. Each fails on an engine without the property (tests/test_ch05_checks.py
shows it): one sequence per step fails :func:`check_batching`, chunking off fails
:func:`check_chunked_prefill`, a cost model that leaves out prompt tokens fails
:func:`check_stall_prediction`, memory to spare fails :func:`check_preemption`, FCFS or no deadline fails
:func:`check_priorities`, an engine that runs a batch's sequences one after another fails
:func:`check_step_shared`, a simulator off the engine fails :func:`check_simulator_agrees`, shortest-first
that is FCFS under another name fails :func:`check_overload_order`, aging that does not age fails
:func:`check_aging`, a playground whose chunking switch does nothing fails :func:`check_playground_chunking`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from minserve.capacity.cost_model import StepCostModel, StepFeatures
from minserve.capacity.profiler import DecodePoint
from minserve.engine.step_report import ScheduledSeq
from minserve.lab.checks import require
from minserve.lab.engine_runs import RUNNING_STATES, EngineRun

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


# --- static against continuous batching ---------------------------------------------------------------------


def check_batching(
    static: EngineRun, continuous: EngineRun, predicted_static: int, continuous_bound: int, speedup: float = 1.5
) -> dict[str, Any]:
    """Static batching took exactly ``predicted_static`` steps (Σ over batches of the longest member);
    continuous batching took at least ``continuous_bound`` (⌈Σn / B⌉ or the longest request) and at most
    ``1 / speedup`` of static's, and so did its mean end-to-end latency in steps. Every request produced all
    the tokens it asked for, in both runs."""
    for label, run in (("static", static), ("continuous", continuous)):
        asked = {r.request_id: r.output_tokens for r in run.requests}
        produced = {o.request_id: len(o.token_ids) for o in run.outputs}
        require(produced == asked, f"{label}: not every request produced its tokens")
    steps_static, steps_continuous = len(static.steps), len(continuous.steps)
    require(steps_static == predicted_static, f"static batching took {steps_static} steps, not {predicted_static}")
    require(
        continuous_bound <= steps_continuous <= predicted_static / speedup,
        f"continuous batching took {steps_continuous} steps: not within [{continuous_bound}, "
        f"{predicted_static / speedup:.0f}] (the bound, static's / {speedup:g})",
    )
    e2e = {}
    for label, run in (("static", static), ("continuous", continuous)):
        table = run.table()
        e2e[label] = float((table["finish step"] - table["arrival step"]).mean())
    require(
        e2e["continuous"] < e2e["static"] / speedup,
        f"mean E2E: {e2e['continuous']:.1f} steps continuous, {e2e['static']:.1f} static",
    )
    return {"static_steps": steps_static, "continuous_steps": steps_continuous, "mean_e2e_steps": e2e}


# --- chunked prefill, and the stall predicted ------------------------------------------------------------------


def check_chunked_prefill(
    chunked: EngineRun,
    whole: EngineRun,
    decode_ids: Sequence[str],
    budget: int,
    long_prompt: int,
    itl_ratio: float = 3.0,
) -> dict[str, Any]:
    """With chunking, the largest step carries exactly the budget (chunks fill what the decodes leave); without,
    one step carries the whole prompt beside every running decode (``long_prompt + len(decode_ids)`` tokens).
    In both, each running decode got a token at every step; without chunks, one of those steps stalled them:
    the decodes' p99 inter-token latency is over ``itl_ratio`` × the chunked run's."""
    largest = {"chunked": int(chunked.steps["tokens"].max()), "whole": int(whole.steps["tokens"].max())}
    require(largest["chunked"] == budget, f"chunked: the largest step ran {largest['chunked']} tokens, not {budget}")
    expected_whole = long_prompt + len(decode_ids)
    require(largest["whole"] == expected_whole, f"unchunked: largest step {largest['whole']}, not {expected_whole}")
    for label, run in (("chunked", chunked), ("whole", whole)):
        for rid in decode_ids:
            require(bool(np.all(np.diff(run.token_steps[rid]) == 1)), f"{label}: request {rid} skipped a step")
    p99 = {label: float(np.percentile(run.itl_ms(decode_ids)["itl_ms"], 99))
           for label, run in (("chunked", chunked), ("whole", whole))}  # fmt: skip
    require(
        p99["whole"] > itl_ratio * p99["chunked"],
        f"p99 ITL: {p99['whole']:.1f} ms whole, {p99['chunked']:.1f} chunked: not over ×{itl_ratio:g}",
    )
    return {"largest_step_tokens": largest, "itl_p99_ms": p99}


def step_features(run: EngineRun) -> dict[int, StepFeatures]:
    """What each step of ``run`` ran, in the cost model's units, rebuilt from its occupancy: a request's
    computed tokens before a step are the tokens it ran in the steps before. That holds for a run without
    preemption (recompute starts again from zero) and without prefix-cache hits (random prompts); it raises
    ``ValueError`` on a run with preemptions."""
    if run.preemptions:
        raise ValueError("a run with preemptions: computed tokens cannot be rebuilt from the occupancy")
    running = run.occupancy[run.occupancy["state"].isin(RUNNING_STATES)].sort_values("step", kind="stable")
    computed: dict[str, int] = {}
    scheduled: dict[int, list[ScheduledSeq]] = {}
    for step, rid, state, tokens in running[["step", "request_id", "state", "tokens"]].itertuples(index=False):
        scheduled.setdefault(int(step), []).append(ScheduledSeq(rid, int(tokens), computed.get(rid, 0), state))
        computed[rid] = computed.get(rid, 0) + int(tokens)
    return {step: StepFeatures.of_scheduled(entries) for step, entries in scheduled.items()}


def predicted_step_ms(run: EngineRun, cost: StepCostModel) -> pd.Series:
    """The cost model's time for every step of ``run`` (ms), indexed by step."""
    return pd.Series({step: cost.step_time_s(f) * 1e3 for step, f in step_features(run).items()}, name="predicted ms")


def stall_table(
    runs: Mapping[str, EngineRun | Sequence[EngineRun]], cost: StepCostModel, decode_ids: Sequence[str]
) -> pd.DataFrame:
    """Per label, the largest step of its run (or runs: repeats of one experiment, summarized by their median,
    so that one step slowed by another process on a shared CPU does not decide): the tokens it ran, its
    measured time (the stall the running decodes felt: they wait for it), the longest gap they saw between two
    tokens (that step and whatever else held them up), and the cost model's prediction of the step, all in ms;
    ``predicted / measured`` compares the prediction with the step's measured time."""
    rows = []
    for label, entry in runs.items():
        repeats = [entry] if isinstance(entry, EngineRun) else list(entry)
        largest = [run.steps.loc[run.steps["tokens"].idxmax()] for run in repeats]
        predicted = predicted_step_ms(repeats[0], cost)[int(largest[0]["step"])]
        measured = float(np.median([step["duration_s"] for step in largest])) * 1e3
        gap = float(np.median([run.itl_ms(decode_ids)["itl_ms"].max() for run in repeats]))
        rows.append(
            {
                "run": label,
                "repeats": len(repeats),
                "largest step tokens": int(largest[0]["tokens"]),
                "measured step ms": measured,
                "decodes' longest gap ms": gap,
                "predicted ms": predicted,
                "predicted / measured": predicted / measured,
            }
        )
    return pd.DataFrame(rows).set_index("run")


def check_stall_prediction(table: pd.DataFrame, unchunked: str, chunked: str, within: float = 2.0) -> dict[str, Any]:
    """The cost model, fitted on other steps, predicts the unchunked stall (the measured time of the step that
    carried the whole prompt) within a factor ``within``, and the chunked run's largest step at under a third
    of it."""
    ratio = table.loc[unchunked, "predicted / measured"]
    require(1 / within <= ratio <= within, f"predicted stall / measured = {ratio:.2f}, not within ×{within:g}")
    predicted = table["predicted ms"]
    require(
        predicted[chunked] < predicted[unchunked] / 3,
        f"predicted largest step: {predicted[chunked]:.1f} ms chunked, {predicted[unchunked]:.1f} unchunked",
    )
    return {"predicted_over_measured": float(ratio), "predicted_ms": predicted.to_dict()}


# --- preemption --------------------------------------------------------------------------------------------------


def check_preemption(
    runs: Mapping[str, EngineRun], engines: Mapping[str, LLM], reference: str = "ample memory"
) -> dict[str, int]:
    """Under a tiny KV budget each mode (``"recompute"``, ``"swap"``, the runs' labels) preempted, the trace
    says how, every preempted request resumed, the outputs are the uninterrupted ``reference`` run's, and every
    device and host block came back; only swap copied blocks; the reference run was never preempted."""
    tokens = [o.token_ids for o in runs[reference].outputs]
    require(not runs[reference].preemptions, f"the {reference} run was preempted")
    for mode in ("recompute", "swap"):
        run, bm = runs[mode], engines[mode].engine.core.block_manager
        require(bool(run.preemptions), f"{mode}: no preemption: the KV budget is not tight")
        require([o.token_ids for o in run.outputs] == tokens, f"{mode}: outputs differ from the uninterrupted run")
        preempted = [e for e in run.events if e.name == "preempted"]
        require({e.args["mode"] for e in preempted} == {mode}, f"{mode}: the trace names another mode")
        resumed = {e.request_id for e in run.events if e.name == "resumed"}
        require({e.request_id for e in preempted} == resumed, f"{mode}: a preempted request never resumed")
        require(bm.num_used_blocks == 0 and len(bm.free_cpu_blocks) == bm.num_cpu_blocks, f"{mode}: blocks held")
        copied = int(run.steps["swapped_blocks"].sum())
        require((copied > 0) == (mode == "swap"), f"{mode}: {copied} blocks copied to or from host memory")
    return {mode: len(runs[mode].preemptions) for mode in ("recompute", "swap")}


# --- priorities, deadlines, queueing ------------------------------------------------------------------------


def check_priorities(
    fcfs: EngineRun,
    priority: EngineRun,
    urgent_ids: Sequence[str],
    deadline_id: str,
    deadline_s: float,
    first_round: Sequence[str],
    last_round: Sequence[str],
    margin_s: float = 0.05,
) -> dict[str, Any]:
    """Under the priority policy the urgent requests' first tokens come in under half FCFS's steps, and sooner
    in time. Under FCFS the request with a deadline was stopped (``"deadline"``) before it finished, having
    waited at least ``deadline_s`` and no longer than one step past it (plus ``margin_s`` for a busy CPU), and
    the last round of background requests waited longer than the first: queueing, not the model."""
    ttft = {label: run.table().loc[list(urgent_ids), ["TTFT steps", "TTFT ms"]].mean()
            for label, run in (("fcfs", fcfs), ("priority", priority))}  # fmt: skip
    require(
        ttft["priority"]["TTFT steps"] < ttft["fcfs"]["TTFT steps"] / 2,
        f"urgent TTFT: {ttft['priority']['TTFT steps']:.1f} steps by priority, {ttft['fcfs']['TTFT steps']:.1f} FCFS",
    )
    require(ttft["priority"]["TTFT ms"] < ttft["fcfs"]["TTFT ms"], "urgent requests were not served sooner in time")
    table = fcfs.table()
    late = table.loc[deadline_id]
    asked = {r.request_id: r.output_tokens for r in fcfs.requests}[deadline_id]
    require(late["finish"] == "deadline" and late["output tokens"] < asked, f"{deadline_id} was not stopped")
    waited_s, longest_step_s = late["waiting ms"] / 1e3, float(fcfs.steps["duration_s"].max())
    require(
        deadline_s <= waited_s <= deadline_s + longest_step_s + margin_s,
        f"{deadline_id} waited {waited_s * 1e3:.0f} ms for a {deadline_s * 1e3:.0f} ms deadline",
    )
    waited = table["waiting ms"]
    require(waited[list(last_round)].min() > waited[list(first_round)].max(), "the last round did not wait longest")
    return {"urgent_ttft_steps": {k: float(v["TTFT steps"]) for k, v in ttft.items()}, "deadline_waited_s": waited_s}


# --- the step is shared -------------------------------------------------------------------------------------


def check_step_shared(points: Sequence[DecodePoint], at_most: float = 2.0) -> dict[str, float]:
    """A decode step of the largest batch measured (``points``: :func:`minserve.capacity.profiler.profile_decode`
    at batch 1 and at ``B``) took at most ``at_most`` × the step of batch 1: whatever a step costs (here a
    fixed per-step overhead; on a large model, reading the weights), the batch shares it, so a token costs
    about ``1 / B`` of a lone one. An engine that ran the sequences one after another would take ``B`` ×.
    Returns each batch's step and per-token ms."""
    by_batch = {p.batch: p.step_s for p in points}
    require(1 in by_batch and len(by_batch) >= 2, f"need batch 1 and a larger batch, got {sorted(by_batch)}")
    largest = max(by_batch)
    ratio = by_batch[largest] / by_batch[1]
    require(
        ratio <= at_most,
        f"a step of {largest} sequences took {ratio:.2f} × a step of one ({by_batch[largest] * 1e3:.1f} ms vs "
        f"{by_batch[1] * 1e3:.1f} ms): over ×{at_most:g}, the batch did not share the step",
    )
    return {f"batch {b}: step ms": round(t * 1e3, 2) for b, t in sorted(by_batch.items())} | {
        f"batch {b}: ms per token": round(t * 1e3 / b, 2) for b, t in sorted(by_batch.items())
    }


# --- the simulator, the sweep, starvation, the playground ---------------------------------------------------


def check_simulator_agrees(
    measured: Mapping[str, Any],
    simulated: Mapping[str, Any],
    within: float = 2.5,
    keys: Sequence[str] = ("ttft_ms", "tpot_ms"),
) -> dict[str, float]:
    """The simulator's p50 of each of ``keys`` (summaries of :meth:`SimResult.summary` and
    :meth:`EngineRun.summary`, same requests) is within a factor ``within`` of the engine's. Returns the
    ratios simulated / measured."""
    ratios = {key: simulated[key]["p50"] / measured[key]["p50"] for key in keys}
    off = {k: round(r, 2) for k, r in ratios.items() if not 1 / within < r < within}
    require(not off, f"simulated / measured p50: {off}, not within ×{within:g}")
    return {k: round(r, 2) for k, r in ratios.items()}


def check_overload_order(sweep: pd.DataFrame, rate_rps: float, shortest_first: str, fcfs: str) -> dict[str, float]:
    """At ``rate_rps`` (past capacity), ``shortest_first`` (no aging) gave more goodput than ``fcfs``, and its
    long requests' longest TTFT is longer: the order buys goodput from the long prompts' tail. Returns both
    policies' goodput and longest long-request TTFT."""
    rows = sweep[sweep["rate_rps"] == rate_rps].set_index("policy")
    require({shortest_first, fcfs} <= set(rows.index), f"no rows for {shortest_first!r} and {fcfs!r} at {rate_rps}")
    spf, first = rows.loc[shortest_first], rows.loc[fcfs]
    require(
        spf["goodput_rps"] > first["goodput_rps"],
        f"at {rate_rps:g} req/s {shortest_first} gave {spf['goodput_rps']:.2f} req/s of goodput, "
        f"{fcfs} {first['goodput_rps']:.2f}",
    )
    require(
        spf["ttft_long_max_ms"] > first["ttft_long_max_ms"],
        f"{shortest_first}'s long requests waited no longer than under {fcfs}: no price was paid",
    )
    return {
        f"{shortest_first} goodput": round(float(spf["goodput_rps"]), 2),
        f"{fcfs} goodput": round(float(first["goodput_rps"]), 2),
        f"{shortest_first} long TTFT max ms": round(float(spf["ttft_long_max_ms"])),
        f"{fcfs} long TTFT max ms": round(float(first["ttft_long_max_ms"])),
    }


def check_aging(
    first_token_s: Mapping[str, float],
    waited_steps: Mapping[str, int],
    stream_ends_s: float,
    aged: str,
    unaged: str,
    bound_steps: float,
    within: float = 2.0,
) -> dict[str, int]:
    """Under a stream of short requests, the ``unaged`` policy gave the long prompt its first token only after
    the stream ended (starvation); the ``aged`` one made it wait fewer steps, and at most ``within`` × the
    aging bound ``bound_steps`` (the wait after which it outranks any newcomer). Returns the steps waited."""
    require(
        first_token_s[unaged] > stream_ends_s,
        f"{unaged}: the long prompt's first token at {first_token_s[unaged]:.2f} s, before the stream ended "
        f"({stream_ends_s:.2f} s): it did not starve",
    )
    require(
        waited_steps[aged] < waited_steps[unaged],
        f"{aged} made the long prompt wait {waited_steps[aged]} steps, {unaged} {waited_steps[unaged]}",
    )
    require(
        waited_steps[aged] <= within * bound_steps,
        f"{aged}: the long prompt waited {waited_steps[aged]} steps, over {within:g} × the aging bound "
        f"({bound_steps:.0f} steps)",
    )
    return {aged: int(waited_steps[aged]), unaged: int(waited_steps[unaged])}


def check_playground_chunking(
    chunked: Mapping[str, Any], unchunked: Mapping[str, Any], budget: int, long_prompt: int, itl_ratio: float = 2.0
) -> dict[str, float]:
    """In the playground (:func:`minserve.lab.playground.playground_result`), chunked prefill kept every step
    within the ``budget``; turned off, a step carried at least a whole ``long_prompt``, and the running
    decodes' p99 inter-token latency grew over ``itl_ratio`` ×. Returns the largest steps and p99 ITLs."""
    require(chunked["max_step_tokens"] <= budget, f"chunked: a step of {chunked['max_step_tokens']} > {budget} tokens")
    require(
        unchunked["max_step_tokens"] >= long_prompt,
        f"unchunked: the largest step ran {unchunked['max_step_tokens']} tokens, under a {long_prompt}-token prompt",
    )
    p99 = {"chunked": chunked["itl_ms"]["p99"], "unchunked": unchunked["itl_ms"]["p99"]}
    require(
        p99["unchunked"] > itl_ratio * p99["chunked"],
        f"p99 ITL {p99['unchunked']:.1f} ms unchunked, {p99['chunked']:.1f} chunked: not over ×{itl_ratio:g}",
    )
    return {
        "largest step, chunked": chunked["max_step_tokens"],
        "largest step, unchunked": unchunked["max_step_tokens"],
        "p99 ITL ms, chunked": round(p99["chunked"], 1),
        "p99 ITL ms, unchunked": round(p99["unchunked"], 1),
    }
