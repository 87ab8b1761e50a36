"""Chapter 06's checks: what each way of splitting a model claims, held against what the engine measured.

Each ``check_*`` raises ``AssertionError`` (saying what differed) unless the measurements show the property,
and returns the numbers it compared; tests/test_ch06_checks.py shows each failing on data or an engine
without it. Ranks that disagree on a token fail :func:`check_same_tokens`; a forward that skips the
embedding's all-reduce, or all-reduces once too often, fails :func:`check_tensor_parallel_traffic`; a shard
that keeps a whole matrix fails :func:`check_rank_memory`; stages that do not wait for each other, or never
work at once, fail :func:`check_pipeline_schedule`; replicas that share a cache, or a prefix-aware router
that spreads a prefix, fail :func:`check_routing`; an expert-parallel layer that drops a rank's pairs or
counts the rows it keeps as sent fails :func:`check_expert_parallel`; a planner that counts only a mixture's
active experts, or does not divide the weights among the ranks, fails :func:`check_memory_fit`; a link whose
cost is not latency plus bytes over bandwidth fails :func:`check_link_fit`; stages that never overlap fail
:func:`check_bubble_band`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pandas as pd

from minserve.capacity.kv import Dtype
from minserve.capacity.parallel import Stage, pipeline_stages, stage_params_per_gpu, tensor_parallel_traffic
from minserve.lab.checks import require
from minserve.lab.parallel_experts import ExpertParallelRun
from minserve.lab.parallel_runs import TrafficRun, concurrent_s
from minserve.model.config import ModelConfig
from minserve.parallel.pipeline import PipelineStats

# Published parameter counts (the models' cards): every expert of Mixtral's counted, as they all take memory.
PUBLISHED_PARAMS = {"Llama-3-8B": 8.03e9, "Llama-3-70B": 70.6e9, "Mixtral-8x7B": 46.7e9}


def check_same_tokens(expected: Sequence[Sequence[int]], measured: Sequence[Sequence[int]], what: str) -> int:
    """``measured`` (the split run's greedy tokens) are ``expected`` (one process's), request by request,
    token by token. Returns the number of tokens compared."""
    require(len(expected) == len(measured), f"{what}: {len(measured)} requests, one process had {len(expected)}")
    for i, (want, got) in enumerate(zip(expected, measured)):
        if list(want) != list(got):
            at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise AssertionError(f"{what}: request {i} differs from one process's at token {at}: "
                                 f"{list(got)[at:at + 4]} instead of {list(want)[at:at + 4]}")  # fmt: skip
    return sum(len(t) for t in expected)


def check_tensor_parallel_traffic(steps: pd.DataFrame, config: ModelConfig, size: int, dtype: Dtype) -> dict:
    """In every step, rank 0 all-reduced exactly ``(2 × layers + 1) × tokens × hidden × bytes`` in
    ``2 × layers + 1`` calls (two a layer, one after the embedding) and all-gathered its ``ceil(vocab / n)``
    logits of each sampled row: :func:`minserve.capacity.parallel.tensor_parallel_traffic` for the step's
    tokens and rows. Returns the totals compared and the bytes a token costs."""
    wrong = []
    total = expected_total = 0
    for step in steps.itertuples():
        want = tensor_parallel_traffic(config, step.tokens, size, dtype, logit_rows=step.rows)
        got = (step.all_reduce_bytes, step.all_reduce_calls, step.all_gather_bytes)
        if got != (want.all_reduce_bytes, want.all_reduce_calls, want.all_gather_bytes):
            wrong.append((step.step, got, (want.all_reduce_bytes, want.all_reduce_calls, want.all_gather_bytes)))
        total += step.all_reduce_bytes
        expected_total += want.all_reduce_bytes
    require(not wrong, f"{len(wrong)} of {len(steps)} steps sent other than the formula, (all-reduce bytes, calls, "
                        f"all-gather bytes) measured vs formula: {wrong[:3]}")  # fmt: skip
    per_token = tensor_parallel_traffic(config, 1, size, dtype).all_reduce_bytes
    return {"steps": len(steps), "all-reduce bytes": int(total), "formula": int(expected_total),
            "all-reduce bytes per token": per_token}  # fmt: skip


def check_rank_memory(
    one: TrafficRun,
    rank0: TrafficRun,
    config: ModelConfig,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> dict:
    """The parameters rank 0 holds are the planner's share for one GPU of the first stage
    (:func:`minserve.capacity.parallel.stage_params_per_gpu`: ``1 / t`` of every matrix, its stage's layers),
    one process holds the whole model's, and rank 0's KV bytes a token are one process's times its share of
    the layers over ``t`` (its KV heads)."""
    stage = pipeline_stages(config, pipeline_parallel_size)[0]
    predicted = stage_params_per_gpu(config, stage, tensor_parallel_size)
    whole = stage_params_per_gpu(config, Stage(config.num_layers), 1)
    require(one.params_here == whole, f"one process holds {one.params_here:,} parameters, the planner {whole:,}")
    require(rank0.params_here == predicted,
             f"rank 0 holds {rank0.params_here:,} parameters; its share (TP={tensor_parallel_size}, "
             f"{stage.layers} of {config.num_layers} layers) is {predicted:,}")  # fmt: skip
    kv = one.kv_bytes_per_token * stage.layers // config.num_layers // tensor_parallel_size
    require(rank0.kv_bytes_per_token == kv, f"rank 0 keeps {rank0.kv_bytes_per_token} KV bytes a token, not {kv}")
    return {"one process params": one.params_here, "rank 0 params": rank0.params_here,
            "rank 0 share": rank0.params_here / one.params_here, "rank 0 KV bytes/token": kv}  # fmt: skip


def check_pipeline_schedule(stats: dict[int, PipelineStats]) -> dict[int, dict[str, float]]:
    """The pipeline kept GPipe's order and overlapped its stages.

    For every step of the sweep (``stats[m]``: steps of ``m`` sequences): it ran in ``m`` micro-batches; each
    stage worked on one at a time, in order; stage ``s`` started a micro-batch only after stage ``s − 1``
    had finished it. (With one micro-batch that order alone makes the bubble the formula's ``(p − 1) / p`` or
    more: each stage waits while the others work.) With two or more, the stages worked at the same time for
    part of the steps (stage 0 went on to the next micro-batch while the next stage took the last): the
    overlap that shrinks the bubble. Returns, per ``m``, the bubble measured and predicted and the overlap
    share.
    """
    result = {}
    for m, run in stats.items():
        require(bool(run.steps), f"m={m}: no steps recorded")
        for index, step in enumerate(run.steps):
            where = f"m={m}, step {index}"
            require(step.num_micro_batches == m and all(len(s) == m for s in step.spans),
                     f"{where}: {[len(s) for s in step.spans]} micro-batches per stage, not {m}")  # fmt: skip
            for s, spans in enumerate(step.spans):
                require(all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)),
                         f"{where}: stage {s} worked on two micro-batches at once")  # fmt: skip
            for s in range(1, step.num_stages):
                early = [i for i, ((_, done), (began, _)) in enumerate(zip(step.spans[s - 1], step.spans[s]))
                         if began < done]  # fmt: skip
                require(not early, f"{where}: stage {s} began micro-batch(es) {early} before stage {s - 1} ended them")
        span_s = sum(step.span_s for step in run.steps)
        overlap = sum(concurrent_s(step) for step in run.steps) / span_s
        if m > 1:
            require(overlap > 0, f"m={m}: the stages never worked at the same time")
        result[m] = {"bubble (measured)": run.bubble_fraction, "bubble (predicted)": run.predicted_bubble_fraction,
                     "overlap share": overlap}  # fmt: skip
    return result


def check_routing(rows: pd.DataFrame, aware: str = "prefix-aware", blind: str = "round-robin") -> dict:
    """Every request found exactly the cached tokens its placement predicts (each replica's cache its own:
    nothing found that only another replica computed, nothing missed that its own had); the prefix-aware
    policy sent each system prompt to one replica; and so it found more of the prompts cached than
    round-robin did. Returns each policy's hit rate."""
    off = rows[rows["cached (measured)"] != rows["cached (predicted)"]]
    shown = ["policy", "request", "replica", "cached (predicted)", "cached (measured)"]
    require(off.empty, f"{len(off)} requests found other than the predicted cached tokens, first: "
                        f"{off.head(3)[shown].to_dict('records')}")  # fmt: skip
    spread = rows[rows["policy"] == aware].groupby("prefix")["replica"].nunique()
    require((spread == 1).all(), f"{aware} sent prefixes {list(spread[spread > 1].index)} to several replicas")
    rates = {policy: float(run["cached (measured)"].sum() / run["prompt tokens"].sum())
             for policy, run in rows.groupby("policy", sort=False)}  # fmt: skip
    require(
        rates[aware] > rates[blind], f"{aware} hit rate {rates[aware]:.3f} is not above {blind}'s {rates[blind]:.3f}"
    )
    return rates


def check_expert_parallel(run: ExpertParallelRun) -> dict:
    """Expert parallelism changed nothing but where the experts ran: one process's greedy tokens; every expert
    of every sparse layer ran the same (token, expert) pairs as in one process; each layer's pairs add up to
    forwarded tokens × top-k, every rank running some; and rank 0's all-to-all bytes are the rows that left it
    (its tokens sent to other ranks' experts, and the outputs it sent back to them), ``hidden × bytes`` a row."""
    check_same_tokens(run.one_process_token_ids, run.token_ids, "expert parallelism")
    require(bool((run.load == run.one_process_load).all()),
             f"expert load differs from one process's:\n{run.load}\nvs\n{run.one_process_load}")  # fmt: skip
    expected = run.forwarded_tokens * run.config.num_experts_per_tok
    sums = run.load_per_rank.sum(dim=1).tolist()
    require(all(s == expected for s in sums), f"pairs per layer {sums}, not tokens × top-k = {expected}")
    idle = (run.load_per_rank == 0).nonzero().tolist()
    require(not idle, f"(layer, rank) pairs with no work: {idle}")
    pairs, row_bytes = run.pairs, run.config.hidden_size * run.element_bytes
    left = int(pairs[0].sum() - pairs[0, 0] + pairs[:, 0].sum() - pairs[0, 0])
    require(
        run.traffic.all_to_all_bytes == left * row_bytes,
        f"rank 0 counted {run.traffic.all_to_all_bytes} all-to-all bytes; {left} rows of {row_bytes} bytes left it",
    )
    return {"pairs per layer": expected, "load per rank": run.load_per_rank.sum(dim=0).tolist(),
            "rows that left rank 0": left, "all-to-all bytes": run.traffic.all_to_all_bytes}  # fmt: skip


def check_memory_fit(table: pd.DataFrame, tolerance: float = 0.01) -> dict:
    """The planner's memory arithmetic against published facts: its parameter counts within ``tolerance`` of
    the models' cards (a mixture's every expert counted); in bf16 on 80 GB GPUs (72 GB usable), Llama-3-8B
    fits one, Llama-3-70B (141 GB of weights) does not but fits two with room for only a few 4k-token
    sequences of KV, and Mixtral-8x7B (93 GB) does not fit one but fits two."""

    def row(model: str, tp: int) -> pd.Series:
        found = table[(table["model"] == model) & (table["TP"] == tp)]
        require(len(found) == 1, f"no row for {model} at TP={tp}")
        return found.iloc[0]

    for model, published in PUBLISHED_PARAMS.items():
        counted = row(model, 1)["params (B)"] * 1e9
        require(abs(counted / published - 1) <= tolerance,
                 f"{model}: {counted / 1e9:.2f}B parameters counted, {published / 1e9:.2f}B published")  # fmt: skip
    require(bool(row("Llama-3-8B", 1)["weights fit"]), "Llama-3-8B should fit one 80 GB GPU")
    require(not row("Llama-3-70B", 1)["weights fit"], "Llama-3-70B's 141 GB of bf16 weights fit one 80 GB GPU?")
    tp2 = row("Llama-3-70B", 2)
    require(bool(tp2["weights fit"]) and 1 <= tp2["sequences"] < 8,
             f"Llama-3-70B on two GPUs: weights fit {tp2['weights fit']}, {tp2['sequences']} sequences of KV room "
             "(the weights take 70.6 of 72 GB: room for one or a few)")  # fmt: skip
    require(not row("Mixtral-8x7B", 1)["weights fit"], "Mixtral-8x7B's 93 GB (every expert) fit one 80 GB GPU?")
    require(bool(row("Mixtral-8x7B", 2)["weights fit"]), "Mixtral-8x7B should fit two 80 GB GPUs")
    return {f"{m} TP{tp}": int(row(m, tp)["sequences"]) for m in PUBLISHED_PARAMS for tp in (1, 2)}


def check_link_fit(table: pd.DataFrame, within: float = 2.0) -> dict:
    """The α–β model, fitted on two sizes, predicts the all-reduces it was not fitted on (``role`` "held
    out" in :func:`minserve.lab.parallel_link.link_table`) within a factor ``within`` of their measured
    time. A link whose cost is not a fixed latency plus bytes over a bandwidth (a protocol that switches at
    some size, a queue that builds with the message) fails. Returns predicted / measured per held-out size."""
    held = table[table["role"] == "held out"]
    require(not held.empty, "no held-out size: a fit through every point cannot be wrong")
    ratios = held["predicted / measured"]
    off = ratios[(ratios > within) | (ratios < 1 / within)]
    require(off.empty, f"the α–β fit predicts held-out all-reduces of {list(off.index)} bytes at "
                        f"{[round(r, 2) for r in off]} × their measured time, not within ×{within:g}")  # fmt: skip
    return {f"{size:,} B": round(float(r), 2) for size, r in ratios.items()}


def check_bubble_band(table: pd.DataFrame, within: float = 0.2, below: float = 0.1) -> dict:
    """Each measured bubble (:func:`minserve.lab.parallel_runs.bubble_table`) sits in a band around GPipe's
    ``(p − 1) / (m + p − 1)``: at most ``within`` above it (unequal stages, hand-offs and a shared CPU add
    idle time) and at most ``below`` under it (micro-batches that took unequal time, as on a busy CPU, can
    overlap better than the formula's equal ones). And more micro-batches left a smaller bubble than one
    did. Stages that never overlap keep the one-micro-batch bubble at every ``m`` and fail. Returns
    (predicted, measured) per micro-batch count."""
    predicted, measured = table["bubble (predicted)"], table["bubble (measured)"]
    off = [m for m in table.index if not predicted[m] - below <= measured[m] <= predicted[m] + within]
    pairs = {m: (round(float(predicted[m]), 3), round(float(measured[m]), 3)) for m in off}
    require(not off, f"bubble (predicted, measured) outside [predicted − {below:g}, predicted + {within:g}]: {pairs}")
    fewest, most = min(table.index), max(table.index)
    require(most == fewest or measured[most] < measured[fewest],
             f"the bubble did not shrink with micro-batches: {measured[fewest]:.3f} at m = {fewest}, "
             f"{measured[most]:.3f} at m = {most}")  # fmt: skip
    return {int(m): (round(float(predicted[m]), 3), round(float(measured[m]), 3)) for m in table.index}
