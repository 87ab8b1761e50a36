"""Chapter 04's experiments on the engine: each drives an ``LLM`` and records what its KV cache did.

* :func:`sample_kv_usage`: requests served one ``step()`` at a time, the KV cache read after each step;
* :func:`serve_one_by_one`: requests sent one after another, with the prefix cache's hit rate over them alone;
* :func:`eviction_sweep`: a cached prompt asked again after more and more new traffic has gone through the
  pool, to watch LRU eviction take its blocks.

The predictions these are checked against are in :mod:`minserve.lab.kv_checks`; the figures in
:mod:`minserve.lab.kv_figures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from minserve.engine.outputs import RequestOutput
from minserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.engine.llm import LLM


def sample_kv_usage(
    llm: LLM, prompts: Sequence[str], params: SamplingParams | Sequence[SamplingParams], max_steps: int = 100_000
) -> tuple[pd.DataFrame, list[RequestOutput]]:
    """Queue ``prompts``, drive ``llm.engine.step()`` until all finish, and record the KV cache after each step.

    Returns one row per step (``step``, ``used_blocks``, ``stored_tokens``: tokens whose KV is in the cache,
    ``seq_tokens``: the same per running sequence, a tuple; ``running``, ``waiting``, ``preemptions``,
    ``finished``) and the final outputs in prompt order.
    """
    engine = llm.engine
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    finished: dict[str, RequestOutput] = {}
    rows = []
    for step in range(1, max_steps + 1):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        stats = engine.stats()
        seq_tokens = tuple(s.num_computed_tokens for s in engine.core.scheduler.running)
        rows.append(
            {
                "step": step,
                "used_blocks": stats.kv_blocks_used,
                "stored_tokens": sum(seq_tokens),
                "seq_tokens": seq_tokens,
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "preemptions": stats.num_preemptions,
                "finished": sum(rid in finished for rid in ids),
            }
        )
        if len(finished) == len(ids):
            break
    return pd.DataFrame(rows), [finished[rid] for rid in ids if rid in finished]


def serve_one_by_one(
    llm: LLM, prompts: Sequence[str | list[int]], params: SamplingParams, warm_up: str | None = "def warm_up():"
) -> tuple[list[RequestOutput], float]:
    """Send ``prompts`` one after another (each waits for the last to finish); return their outputs and the
    prefix cache's hit rate over these requests alone: prompt tokens found in the cache / prompt tokens looked
    up, read from the block manager's counters before and after (so ``warm_up``, a first request that pays the
    one-time costs, and anything the engine served earlier do not count)."""
    bm = llm.engine.core.block_manager
    if warm_up is not None:
        llm.generate(warm_up, params)
    hits, queries = bm.prefix_hits_tokens, bm.prefix_queries_tokens
    outputs = [llm.generate(prompt, params)[0] for prompt in prompts]
    looked_up = bm.prefix_queries_tokens - queries
    return outputs, (bm.prefix_hits_tokens - hits) / looked_up if looked_up else 0.0


def eviction_sweep(
    llm: LLM,
    prompt: str | list[int],
    filler_requests: Sequence[int],
    filler_prompt_tokens: int,
    seed: int = 0,
) -> pd.DataFrame:
    """Ask ``prompt`` again and again, with ``filler_requests[i]`` fresh requests of ``filler_prompt_tokens``
    random token ids (and one output token each) served between the previous ask and ask ``i``.

    The engine must be idle; every request runs alone or in one batch of fillers, so between two asks of
    ``prompt`` the fillers are the only traffic. A first ask fills the cache before the sweep. One row per
    ask: ``fillers``, ``filler_blocks`` (KV blocks the fillers were handed, ⌈tokens / block_size⌉ each),
    ``cached_tokens`` (the ask's prompt tokens found in the cache) and ``hit_rate`` (those / its prompt).
    """
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("the engine has requests in flight; run on an idle engine")
    block_size, vocab = engine.core.block_manager.block_size, engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, one_token)  # the first ask: what the sweep's asks look up
    rows = []
    for fillers in filler_requests:
        if fillers:
            # Random ids never repeat a block of the prompt's, nor of another filler's: each filler is new traffic.
            llm.generate([rng.integers(0, vocab, filler_prompt_tokens).tolist() for _ in range(fillers)], one_token)
        out = llm.generate(prompt, one_token)[0]
        rows.append(
            {
                "fillers": fillers,
                "filler_blocks": fillers * -(-filler_prompt_tokens // block_size),
                "cached_tokens": out.num_cached_tokens,
                "hit_rate": out.num_cached_tokens / len(out.prompt_token_ids),
            }
        )
    return pd.DataFrame(rows)
