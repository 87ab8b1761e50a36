"""Chapter 02's checks: each states a claim about the engine and raises ``AssertionError`` when the measured
data (a trace, outputs, engine statistics) says otherwise.

Every check would fail on an engine that lost the property the chapter teaches: one that runs a single
sequence per step, queues nobody, admits what can never run, traces overlapping stages, keeps a cancelled
request's memory, or streams half a character. tests/test_ch02_checks.py feeds each one such data.
Each returns a short sentence of what it found, for the notebook to print.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

import pandas as pd

from minserve.engine.detokenizer import REPLACEMENT_CHARACTER
from minserve.lab.anatomy import events_by_request
from minserve.lab.anatomy_runs import Admission
from minserve.lab.anatomy_steps import DecodeModel
from minserve.lab.checks import require
from minserve.trace import TraceEvent, gaps_s

ROUNDING_S = 1e-9  # float seconds near perf_counter's magnitude round at ~1e-12 s; a real overlap is far larger


def check_stages_never_overlap(events: Iterable[TraceEvent], min_requests: int = 1) -> str:
    """Every request's spans are ordered and disjoint, between its arrival and its end: every gap ≥ 0."""
    groups = events_by_request(events)
    require(len(groups) >= min_requests, f"only {len(groups)} complete requests in the trace, expected {min_requests}")
    worst = {rid: min(gaps_s(evs)) for rid, evs in groups.items()}
    bad = {rid: gap for rid, gap in worst.items() if gap < -ROUNDING_S}
    require(not bad, f"stages overlap: the most negative gap per request, in seconds: {bad}")
    return f"{len(groups)} requests, {sum(len(gaps_s(e)) for e in groups.values())} gaps, none negative"


def check_stages_traced(events: Iterable[TraceEvent], outputs: Sequence) -> str:
    """Tokenizing, sampling and detokenizing are timed stages of their own: each request has one
    ``tokenize`` span and, per output token, one ``sample`` and one ``detokenize`` span."""
    groups = events_by_request(events)
    for out in outputs:
        names = [e.name for e in groups[out.request_id]]
        n = len(out.token_ids)
        counts = {name: names.count(name) for name in ("tokenize", "sample", "detokenize")}
        expected = {"tokenize": 1, "sample": n, "detokenize": n}
        require(counts == expected, f"request {out.request_id}: {counts} for {n} output tokens")
    return f"{len(outputs)} requests: each tokenized once, each of its tokens sampled and detokenized"


def check_model_dominates(events: Iterable[TraceEvent], factor: float = 2.0) -> str:
    """The forward pass is the step's main cost: the median decode span is more than ``factor`` × the median
    sampling span and the median detokenize span (medians: one step slowed by another process moves none)."""
    durations = {name: [e.duration_s for e in events if e.name == name] for name in ("decode", "sample", "detokenize")}
    require(all(durations.values()), f"missing spans: {[n for n, d in durations.items() if not d]}")
    med = {name: statistics.median(d) for name, d in durations.items()}
    for name in ("sample", "detokenize"):
        message = f"median decode {med['decode']:.2e} s ≤ {factor} × median {name} {med[name]:.2e} s"
        require(med["decode"] > factor * med[name], message)
    return (f"median decode {med['decode'] * 1e3:.2f} ms; sampling {med['sample'] * 1e3:.3f} ms; "
            f"detokenizing {med['detokenize'] * 1e3:.3f} ms")  # fmt: skip


def check_shared_decode_steps(events: Iterable[TraceEvent], output_lengths: Mapping[str, int]) -> str:
    """Continuous batching: the batch's requests share their steps. One step prefills every prompt, and
    every decode step serves every request still running, so the decode steps number ``max(n) − 1`` for
    ``Σ(n − 1)`` decode tokens. One sequence per step would need ``Σ(n − 1)`` steps."""
    events = [e for e in events if e.request_id in output_lengths]
    prefill_steps = {e.start_s for e in events if e.name == "prefill"}
    decode_spans = [e for e in events if e.name == "decode"]
    steps = {e.start_s for e in decode_spans}
    expected_spans = sum(n - 1 for n in output_lengths.values())
    require(len(decode_spans) == expected_spans, f"{len(decode_spans)} decode spans, expected {expected_spans}")
    require(len(prefill_steps) == 1, f"the prompts were prefilled in {len(prefill_steps)} steps, not one")
    longest = max(output_lengths.values()) - 1
    require(len(steps) == longest, f"{len(steps)} decode steps for {expected_spans} decode tokens; expected {longest}")
    return f"{expected_spans} decode tokens in {len(steps)} decode steps ({expected_spans / len(steps):.1f} per step)"


def check_step_prediction(table: pd.DataFrame, factor: float = 2.0, share: float = 0.75) -> str:
    """The traced decode steps agree with the prediction calibrated apart from them: for at least ``share``
    of the batch sizes the trace holds, its fastest step is within ``factor`` of the prediction, either way.

    ``table``: :func:`minserve.lab.anatomy_steps.step_prediction_table`. Not every batch size: a burst of
    load from another process can slow all three or four steps of one; it cannot make the others agree.
    """
    require(1 in table.index and table.index.max() > 1, f"need steps at batch 1 and above, got {list(table.index)}")
    ratio = table["measured / predicted"]
    within = ratio.between(1 / factor, factor)
    require(
        within.mean() >= share, f"only {within.mean():.0%} of batch sizes within ×{factor}: {ratio.round(2).to_dict()}"
    )
    agree = f"{int(within.sum())} of {len(ratio)} batch sizes within ×{factor} of the prediction"
    return f"{agree} (median measured / predicted: {ratio.median():.2f})"


def check_batching_pays(model: DecodeModel, batch: int = 8, saving: float = 2.0) -> str:
    """Measured, not assumed: a step of ``batch`` sequences costs less than ``1 / saving`` of ``batch`` steps of
    one (the calibrated line at both ends). An engine running one sequence per step would pay all of it."""
    together, alone = model.predicted_s(batch), batch * model.predicted_s(1)
    require(
        together * saving < alone,
        f"a step of {batch}: {together * 1e3:.2f} ms, not < 1/{saving} of {alone * 1e3:.2f} ms",
    )
    return f"a step of {batch} takes {together * 1e3:.2f} ms: {alone / together:.1f}× less than {batch} steps of one"


def check_fixed_cost_dominates(model: DecodeModel, batch: int = 2) -> str:
    """Why a step grows so little with its batch, on this engine: its fixed cost (the calibrated line at
    zero) is more than what ``batch`` sequences add to it, so a step of ``2 × batch`` costs less than two
    steps of one; and more than twice one measured pass through all the weights, so most of what a step pays
    once is per-step overhead, not reading the weights. (The fixed cost is about seven sequences' worth
    here when the machine is quiet, 3.6 in a loaded CI run; an engine that paid per sequence has ~0.)"""
    fixed, per_seq, weights = model.fixed_s, model.per_sequence_s, model.weights_pass_s
    require(fixed > batch * per_seq, f"fixed {fixed * 1e3:.3f} ms ≤ {batch} × {per_seq * 1e3:.3f} ms per sequence")
    require(fixed > 2 * weights, f"fixed {fixed * 1e3:.3f} ms ≤ 2 × the weights pass {weights * 1e3:.3f} ms")
    return (
        f"fixed {fixed * 1e3:.2f} ms per step, {per_seq * 1e3:.3f} ms per sequence; one pass through the "
        f"weights {weights * 1e3:.2f} ms ({weights / fixed:.0%} of the fixed cost)"
    )


def check_refusal(admission: Admission, refused_id: str, reason: str, output_tokens: Mapping[str, int]) -> str:
    """Admission: the request that can never run is refused with a message naming ``reason``; every other
    one is admitted and runs to its full length."""
    require(set(admission.refused) == {refused_id}, f"refused: {sorted(admission.refused)}, expected {refused_id}")
    require(reason in admission.refused[refused_id], f"the message does not say {reason!r}")
    got = {rid: len(out.token_ids) for rid, out in admission.outputs.items()}
    require(got == dict(output_tokens), f"output tokens {got}, expected {dict(output_tokens)}")
    return f"{refused_id} refused ({reason}); the other {len(got)} ran to the end"


def check_queueing(seats: pd.DataFrame, max_num_seqs: int) -> str:
    """More requests than seats: exactly ``max_num_seqs`` run from the first step; every other one starts
    only after some request has ended, and waits longer than any of the first ones.

    ``seats``: :func:`minserve.lab.anatomy_runs.seat_table`.
    """
    first = seats[seats["first step"] == 1]
    later = seats[seats["first step"] > 1]
    require(len(first) == max_num_seqs, f"{len(first)} requests ran from the first step, expected {max_num_seqs}")
    require(not later.empty, "nobody waited for a seat")
    require((later["ended_before"] >= 1).all(), "a request got a seat before any request had ended")
    require(later["queue ms"].min() > first["queue ms"].max(), "a queued request waited less than a seated one")
    return (f"{len(first)} seated at once; {len(later)} waited {later['queue ms'].min():.1f}–"
            f"{later['queue ms'].max():.1f} ms for a seat")  # fmt: skip


def check_cancel_frees_blocks(during: Mapping[str, float], after: Mapping[str, float], last_event: str) -> str:
    """A cancelled request stops and hands back every KV block it held; nothing is left running or waiting."""
    require(during["kv_blocks_used"] > 0, "the stream held no KV blocks while running")
    require(after["kv_blocks_used"] == 0, f"{after['kv_blocks_used']} KV blocks still used after the cancel")
    require(after["num_running"] == after["num_waiting"] == 0, "requests left running or waiting")
    require(last_event == "cancelled", f"the request's last trace event is {last_event!r}, not 'cancelled'")
    return f"{during['kv_blocks_used']} KV blocks in use while streaming, 0 after the cancel"


def check_stream(streamed: Mapping[str, list[str]], final: Mapping[str, str]) -> str:
    """The deltas a stream sent add up to each request's final text, and none holds half a character."""
    require(set(streamed) == set(final), "a stream never finished")
    for rid, pieces in streamed.items():
        require("".join(pieces) == final[rid], f"request {rid}: the deltas do not add up to the text")
        require(not any(REPLACEMENT_CHARACTER in p for p in pieces), f"request {rid}: a delta holds U+FFFD")
    return f"{len(streamed)} streams, {sum(map(len, streamed.values()))} deltas, all whole characters"


def check_detokenizer_steps(steps: pd.DataFrame, text: str) -> str:
    """Text split mid-character across tokens comes out whole: bytes are held back, then all released."""
    require(steps["has_U+FFFD"].sum() == 0, "a delta holds U+FFFD")
    require("".join(steps["delta"]) == text, "the deltas do not add up to the text")
    require(bool((steps["held_bytes"] > 0).any()), "no byte was ever held back: no character was split")
    require(steps["held_bytes"].iloc[-1] == 0, "bytes are still held back at the end")
    return f"{int(steps['held_bytes'].max())} bytes held back at most, all released"
