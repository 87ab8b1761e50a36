"""Chapter 04's predictions and checks: what paging, prefix caching, eviction and admission control should
do, worked out from first principles, and functions that hold the engine's measurements to them.

Each ``predicted_*`` function is the arithmetic of the chapter's prose; each ``check_*`` function raises
``AssertionError`` (saying what differed) unless the measurement agrees, and returns the numbers it compared.
Every check fails on an engine without the property it is about (tests/test_ch04_checks.py shows it): an
engine that reserves ahead fails :func:`check_paging`, one without a prefix cache :func:`check_prefix_cache`,
one that reuses the most recently freed block first :func:`check_eviction`, one with a seat too few
:func:`check_admission`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from minserve.engine.outputs import RequestOutput
from minserve.lab.checks import require


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks a sequence of ``tokens`` tokens holds when blocks are handed out as tokens arrive: ⌈n / b⌉."""
    return -(-tokens // block_size)


# --- paging -----------------------------------------------------------------------------------------------------


def predicted_used_blocks(usage: pd.DataFrame, block_size: int) -> pd.Series:
    """Per step of :func:`~minserve.lab.kv_experiments.sample_kv_usage`: Σ⌈tokensᵢ / block_size⌉ over the
    running sequences (its ``seq_tokens``): the blocks a paged cache holds, no more, no fewer."""
    return usage["seq_tokens"].map(lambda tokens: sum(blocks_for(t, block_size) for t in tokens))


def check_paging(
    usage: pd.DataFrame, block_size: int, max_model_len: int, share_at_most: float | None = None
) -> dict[str, Any]:
    """At every step, the blocks in use equal Σ⌈tokensᵢ / block_size⌉ over the running sequences (so the only
    waste is each sequence's last, partly filled block: under ``block_size`` slots), and they are back to
    zero at the end. With ``share_at_most``, the busiest step also held at most that share of what a
    contiguous reservation (``max_model_len`` slots per running sequence) would. Returns the busiest step's
    numbers: tokens stored, blocks, and that share."""
    predicted = predicted_used_blocks(usage, block_size)
    wrong = usage[usage["used_blocks"] != predicted]
    require(
        wrong.empty,
        f"{len(wrong)} steps hold other than Σ⌈tokens / {block_size}⌉ blocks, first step "
        f"{wrong['step'].iloc[0] if len(wrong) else ''}: {wrong['used_blocks'].tolist()[:3]} measured, "
        f"{predicted[wrong.index].tolist()[:3]} predicted",
    )
    require(usage["used_blocks"].iloc[-1] == 0, f"{usage['used_blocks'].iloc[-1]} blocks still held at the end")
    busiest = usage.loc[usage["stored_tokens"].idxmax()]
    share = busiest["used_blocks"] * block_size / (busiest["running"] * max_model_len)
    if share_at_most is not None:
        require(
            share <= share_at_most,
            f"at the busiest step paging held {share:.0%} of a contiguous reservation, over {share_at_most:.0%}",
        )
    return {
        "busiest_step": int(busiest["step"]),
        "stored_tokens": int(busiest["stored_tokens"]),
        "used_blocks": int(busiest["used_blocks"]),
        "paged_share_of_contiguous": share,
        "max_waste_slots": int((usage["used_blocks"] * block_size - usage["stored_tokens"]).max()),
    }


# --- bytes per token ------------------------------------------------------------------------------------------


def check_bytes_per_token(computed: Mapping[str, int], published: Mapping[str, int]) -> dict[str, int]:
    """The formula 2 × L × H_kv × d_head × b, computed from each model's configuration (``computed``), gives the
    published 16-bit figure (``published``) for every model, byte for byte."""
    wrong = {
        name: (computed.get(name), expected) for name, expected in published.items() if computed.get(name) != expected
    }
    require(not wrong, f"bytes per token (computed, published) differ: {wrong}")
    return dict(computed)


def check_pool_bytes(kv_cache_bytes: int, num_blocks: int, block_size: int, bytes_per_token: int) -> int:
    """The KV tensors the engine allocated are exactly ``num_blocks × block_size`` tokens of the formula's size:
    nothing hidden beside them, nothing missing. Returns the bytes."""
    expected = num_blocks * block_size * bytes_per_token
    require(kv_cache_bytes == expected, f"the engine allocated {kv_cache_bytes:,} KV bytes, the formula {expected:,}")
    return kv_cache_bytes


# --- the prefix cache -------------------------------------------------------------------------------------------


def common_prefix_tokens(prompts_token_ids: Sequence[Sequence[int]]) -> int:
    """How many leading token ids every prompt shares."""
    first, n = prompts_token_ids[0], 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in prompts_token_ids):
        n += 1
    return n


def predicted_cached_tokens(prompts_token_ids: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """Prompt tokens each request finds in the prefix cache, sent one after another into an empty cache.

    The first finds nothing; every later one finds the shared prefix's *full* blocks (a partly filled block is
    never named), and never its own last token (its logits are needed):
    ``min(⌊shared / b⌋, ⌊(nᵢ − 1) / b⌋) × b``.
    """
    shared_blocks = common_prefix_tokens(prompts_token_ids) // block_size
    return [0] + [min(shared_blocks, (len(p) - 1) // block_size) * block_size for p in prompts_token_ids[1:]]


def check_prefix_cache(
    outputs: Sequence[RequestOutput], measured_hit_rate: float, block_size: int, tolerance: float = 0.005
) -> dict[str, Any]:
    """Each request found exactly the predicted cached tokens (:func:`predicted_cached_tokens`), and the hit
    rate the engine measured over them (:func:`~minserve.lab.kv_experiments.serve_one_by_one`) is the
    predicted Σ cached / Σ prompt tokens, within ``tolerance``."""
    prompts = [o.prompt_token_ids for o in outputs]
    predicted = predicted_cached_tokens(prompts, block_size)
    measured = [o.num_cached_tokens for o in outputs]
    require(measured == predicted, f"cached tokens per request: measured {measured}, predicted {predicted}")
    predicted_rate = sum(predicted) / sum(len(p) for p in prompts)
    require(
        abs(measured_hit_rate - predicted_rate) <= tolerance,
        f"hit rate: measured {measured_hit_rate:.3f}, predicted {predicted_rate:.3f}",
    )
    return {"predicted_hit_rate": predicted_rate, "measured_hit_rate": measured_hit_rate, "cached_tokens": measured}


def check_cache_changes_only_work(
    with_cache: Sequence[RequestOutput], without_cache: Sequence[RequestOutput], hit_rate_off: float
) -> None:
    """Prefix caching off finds nothing (hit rate 0, no cached token in any request), and the cache changes
    no answer: the same prompts give the same tokens with it on and off (greedy decoding)."""
    cached_off = [o.num_cached_tokens for o in without_cache]
    require(hit_rate_off == 0 and not any(cached_off), f"cache off still hit: {hit_rate_off}, {cached_off}")
    differ = [i for i, (a, b) in enumerate(zip(with_cache, without_cache)) if a.token_ids != b.token_ids]
    require(not differ and len(with_cache) == len(without_cache), f"answers differ with the cache on: {differ}")


# --- eviction -----------------------------------------------------------------------------------------------


def predicted_eviction(
    filler_blocks: Sequence[int], pool_blocks: int, prompt_tokens: int, block_size: int
) -> list[int]:
    """Cached tokens a prompt of ``prompt_tokens`` finds after ``filler_blocks`` blocks of new traffic.

    LRU: an idle engine's free queue is every block, least recently freed first, and the prompt's own blocks
    were freed last, its first block last of all. New traffic takes blocks from the front, so the prompt's
    block ``j`` (counted from the start) is evicted once ``pool_blocks − j`` blocks have been handed out: it
    finds ``min(s, max(0, pool_blocks − f))`` blocks, ``s = ⌊(n − 1) / b⌋`` being all it ever finds.
    """
    shareable = (prompt_tokens - 1) // block_size
    return [min(shareable, max(0, pool_blocks - f)) * block_size for f in filler_blocks]


def check_eviction(sweep: pd.DataFrame, pool_blocks: int, prompt_tokens: int, block_size: int) -> dict[str, Any]:
    """The asks of :func:`~minserve.lab.kv_experiments.eviction_sweep` found exactly the predicted cached tokens
    (:func:`predicted_eviction`): all shareable blocks while the pool has not cycled, none once new traffic has
    taken every block of the pool (the sweep must reach that far)."""
    predicted = predicted_eviction(sweep["filler_blocks"].tolist(), pool_blocks, prompt_tokens, block_size)
    measured = sweep["cached_tokens"].tolist()
    require(measured == predicted, f"cached tokens per ask: measured {measured}, predicted {predicted}")
    before = sweep[sweep["filler_blocks"] == 0]
    after = sweep[sweep["filler_blocks"] >= pool_blocks]
    require(not before.empty and not after.empty, "the sweep must ask with no fillers and after a whole pool of them")
    require((before["cached_tokens"] > 0).all(), "no hit even before any new traffic: is prefix caching on?")
    require((after["cached_tokens"] == 0).all(), "the prompt still hit after the whole pool was handed out")
    return {"hit_rate_fresh": before["hit_rate"].max(), "hit_rate_cycled": after["hit_rate"].max()}


# --- admission control ----------------------------------------------------------------------------------------


def predicted_admitted(prompt_lengths: Sequence[int], free_blocks: int, block_size: int, max_num_seqs: int) -> int:
    """How many of the requests, waiting in this order (FCFS, nobody overtakes), the first step admits: the
    longest run whose prompts' blocks Σ⌈pᵢ / b⌉ fit in ``free_blocks``, at most ``max_num_seqs``.
    (Every prompt fits in the step's token budget here; a longer one would be chunked, and hold fewer blocks.)"""
    admitted, blocks = 0, 0
    for length in prompt_lengths:
        blocks += blocks_for(length, block_size)
        if blocks > free_blocks or admitted == max_num_seqs:
            break
        admitted += 1
    return admitted


def predicted_full_length_concurrency(total_tokens: int, pool_blocks: int, block_size: int) -> int:
    """How many requests of ``total_tokens`` tokens each (prompt and output) the pool holds at once when all of
    them have reached their full length: ⌊pool / ⌈n / b⌉⌋."""
    return pool_blocks // blocks_for(total_tokens, block_size)


def check_admission(
    usage: pd.DataFrame,
    outputs: Sequence[RequestOutput],
    pool_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_tokens: int,
) -> dict[str, Any]:
    """Under memory pressure: the first step admitted exactly :func:`predicted_admitted` requests (the rest
    waited); the blocks in use never went over the pool; every request still finished with all its tokens,
    and at the end nothing is held or waiting. Returns the predicted and measured numbers."""
    prompt_lengths = [len(o.prompt_token_ids) for o in outputs]
    predicted = predicted_admitted(prompt_lengths, pool_blocks, block_size, max_num_seqs)
    first = usage.iloc[0]
    require(
        first["running"] == predicted and first["waiting"] == len(outputs) - predicted,
        f"first step: {first['running']} running, {first['waiting']} waiting; predicted {predicted} admitted",
    )
    require(usage["used_blocks"].max() <= pool_blocks, "more blocks in use than the pool has")
    require(all(len(o.token_ids) == max_tokens for o in outputs), "a request finished without all its tokens")
    last = usage.iloc[-1]
    require(last["used_blocks"] == 0 and last["waiting"] == 0, "blocks or requests left over at the end")
    full = predicted_full_length_concurrency(max(prompt_lengths) + max_tokens - 1, pool_blocks, block_size)
    return {"predicted_admitted": predicted, "measured_admitted": int(first["running"]), "full_length_fit": full}
