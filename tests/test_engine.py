"""The engine on the embedded model: batch invariance, preemption, prefix caching, streaming, cancellation."""

from __future__ import annotations

import random

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.reference_loop import generate_token_ids


def _workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2048) for _ in range(rng.randint(3, 70))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the foundation's reference loop, one request at a time."""
    llm = LLM(enable_tracing=False)
    prompts, params = _workload(16)
    expected = [[t for t, _ in generate_token_ids(llm.model, p, sp)] for p, sp in zip(prompts, params)]
    return prompts, params, expected


@pytest.mark.parametrize(
    "options",
    [
        {},  # defaults: prefix caching on, plenty of memory
        {"enable_prefix_caching": False},
        {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 48},  # forces preemption
        {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 48, "enable_prefix_caching": False},
        {"max_num_seqs": 3, "max_num_batched_tokens": 16},  # small steps: chunked prompts
    ],
    ids=["default", "no-prefix-cache", "preemption", "preemption-no-prefix-cache", "chunked"],
)
def test_batched_greedy_equals_one_at_a_time(reference, options):
    prompts, params, expected = reference
    llm = LLM(**options)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    if "num_kv_blocks" in options:
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_blocks_used"] == 0
    llm.engine.core.block_manager.check_invariants([])


def _shared_prefix_workload(n: int = 12, prefix_tokens: int = 48, seed: int = 1):
    """Prompts that all start with the same ``prefix_tokens`` tokens (six full blocks of 8), then differ."""
    rng = random.Random(seed)
    shared = [rng.randrange(2048) for _ in range(prefix_tokens)]
    prompts = [shared + [rng.randrange(2048) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 25), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def shared_prefix_reference():
    llm = LLM(enable_tracing=False)
    prompts, params = _shared_prefix_workload()
    expected = [[t for t, _ in generate_token_ids(llm.model, p, sp)] for p, sp in zip(prompts, params)]
    return prompts, params, expected


@pytest.mark.parametrize(
    ("options", "warm"),
    [
        # The first request prefills the shared prefix alone; the rest are admitted after and hit it.
        ({"block_size": 8, "max_num_batched_tokens": 64}, False),
        # Defaults: all are admitted in the first step, so the hits come from an earlier generate call.
        ({"block_size": 8}, True),
        ({"block_size": 8, "num_kv_blocks": 16, "max_num_batched_tokens": 48}, False),  # forces preemption
        ({"block_size": 8, "max_num_seqs": 3, "max_num_batched_tokens": 16}, False),  # chunked prompts
    ],
    ids=["prefix-hits", "warm-cache", "prefix-hits-preemption", "prefix-hits-chunked"],
)
def test_shared_prefix_hits_leave_outputs_unchanged(shared_prefix_reference, options, warm):
    prompts, params, expected = shared_prefix_reference
    llm = LLM(enable_prefix_caching=True, **options)
    if warm:
        llm.generate(prompts[:1], params[:1])
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["prefix_cache_hit_rate"] > 0
    assert sum(o.num_cached_tokens > 0 for o in outputs) >= len(prompts) - 1  # the prefix really was shared
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
    llm.engine.core.block_manager.check_invariants([])


def test_reference_loop_leaves_an_llm_working():
    """The yardstick borrows the engine's model; afterwards the engine must generate exactly as before."""
    llm = LLM(enable_tracing=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def add(a, b):", "import os\n"]
    before = [o.token_ids for o in llm.generate(prompts, params)]
    caches = [layer.self_attn.kv_cache for layer in llm.model.layers]
    reference = [t for t, _ in generate_token_ids(llm.model, llm.tokenizer.encode(prompts[0]), params)]
    assert reference == before[0]
    assert all(layer.self_attn.kv_cache is c for layer, c in zip(llm.model.layers, caches))
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
    # Even while the reference loop is paused between two tokens, the engine's caches are in place.
    paused = generate_token_ids(llm.model, llm.tokenizer.encode(prompts[1]), params)
    first = next(paused)[0]
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
    assert [first] + [t for t, _ in paused] == before[1]


def test_steps_respect_the_token_budget_and_sequence_cap_and_mix_prefill_with_decode():
    budget, max_seqs = 40, 3
    llm = LLM(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_tracing=False)
    engine = llm.engine
    schedule = engine.core.scheduler.schedule
    steps = []  # per step: [(request id, tokens, "prefill" | "decode")] and the number running

    def recording_schedule():
        batch = schedule()
        kinds = [
            "decode" if n == 1 and seq.output_token_ids and seq.num_uncomputed_tokens == 1 else "prefill"
            for seq, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        rows = [(seq.request_id, n, kind) for seq, n, kind in zip(batch.seqs, batch.num_new_tokens, kinds)]
        steps.append((rows, len(engine.core.scheduler.running)))
        return batch

    engine.core.scheduler.schedule = recording_schedule
    rng = random.Random(3)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = [engine.add_request([rng.randrange(2048) for _ in range(30)], params) for _ in range(5)]
    late, added_at, finished = None, 4, {}
    for step in range(1000):
        if step == added_at:
            late = engine.add_request([rng.randrange(2048) for _ in range(30)], params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == sorted([*first, late])
    assert all(len(o.token_ids) == 10 for o in finished.values())

    tokens_per_step = [sum(n for _, n, _ in rows) for rows, _ in steps]
    assert max(tokens_per_step) == budget  # the budget is reached, never exceeded
    assert max(len(rows) for rows, _ in steps) == max_seqs
    assert max(running for _, running in steps) == max_seqs
    assert all(len(rows) <= max_seqs for rows, _ in steps)
    assert any(kind == "prefill" and n < 30 for rows, _ in steps for _, n, kind in rows)  # a chunked prompt
    mixed = [i for i, (rows, _) in enumerate(steps) if {"prefill", "decode"} <= {kind for *_, kind in rows}]
    assert mixed, "no step ran a prefill chunk together with decodes"
    # The late request joins a running batch at a later step, next to requests that arrived before it.
    joined = min(i for i, (rows, _) in enumerate(steps) if any(rid == late for rid, *_ in rows))
    assert joined >= added_at
    assert any(rid in first for rid, *_ in steps[joined][0])


def test_seeded_sampling_is_the_same_in_any_batch():
    llm = LLM()
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    alone = llm.generate(["def handler(event):"], params)[0].token_ids
    others = [SamplingParams(max_tokens=25, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    together = llm.generate(["x = [", "def handler(event):", "import re"] + ["y"] * 3, [others[0], params, *others[1:]])
    assert together[1].token_ids == alone


def test_prefix_cache_reuses_a_shared_system_prompt():
    llm = LLM(block_size=16)
    system = "import os\nimport sys\n\n\ndef main(argv):\n    parser = make_parser()\n" * 4
    first = llm.generate([system + "x = 1"], SamplingParams(max_tokens=2))[0]
    second = llm.generate([system + "y = 2"], SamplingParams(max_tokens=2))[0]
    assert first.num_cached_tokens == 0
    shared_full_blocks = len(llm.tokenizer.encode(system)) // 16
    assert second.num_cached_tokens >= (shared_full_blocks - 1) * 16 > 0
    assert 0 < llm.stats()["prefix_cache_hit_rate"] < 1


def test_stream_deltas_add_up_and_stop_strings_never_leak():
    llm = LLM()
    full = llm.generate("def fib(n):", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].text
    stop = full[20:23]
    chunks = list(llm.stream("def fib(n):", SamplingParams(max_tokens=40, temperature=0, stop=[stop])))
    streamed = "".join(c.delta_text for c in chunks)
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
    assert streamed == chunks[-1].text == full[: full.index(stop)]
    assert stop not in streamed


def test_closing_a_stream_cancels_and_frees_blocks():
    llm = LLM()
    stream = llm.stream(["def a():", "def b():"], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    assert llm.stats()["kv_blocks_used"] > 0
    stream.close()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_cancel_mid_generation_reports_cancelled_and_others_go_on():
    llm = LLM()
    engine = llm.engine
    keep = engine.add_request("def keep():", SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))
    drop = engine.add_request("def drop():", SamplingParams(max_tokens=500, ignore_eos=True))
    finals = {}
    for step in range(100):
        if step == 3:
            llm.cancel(drop)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if len(finals) == 2:
            break
    assert finals[drop].finish_reason == "cancelled" and 0 < len(finals[drop].token_ids) < 500
    assert finals[keep].finish_reason == "length" and len(finals[keep].token_ids) == 12
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_requests_are_refused_while_others_run():
    llm = LLM(num_kv_blocks=16)  # 256 token slots: a request for 1,000 tokens can never fit
    engine = llm.engine
    good = engine.add_request("def ok():", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    engine.step()
    for prompt, params, field in [
        ("", SamplingParams(), "prompt"),
        ([1] * llm.max_model_len, SamplingParams(), "prompt"),
        ("x", SamplingParams(max_tokens=1000), "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == [good]
    assert len(outputs[-1].token_ids) == 8


def test_stats_report_the_required_fields():
    stats = LLM(num_kv_blocks=32).stats()
    for key in ("kv_blocks_total", "kv_blocks_used", "prefix_cache_hit_rate", "num_preemptions", "num_running"):
        assert key in stats
    assert stats["kv_blocks_total"] == 32 and stats["num_waiting"] == 0


def test_kv_memory_is_sized_from_a_byte_budget():
    llm = LLM(kv_cache_memory_bytes=2**20, block_size=16)
    per_block = llm.engine.kv_bytes_per_block()
    assert llm.stats()["kv_blocks_total"] == 2**20 // per_block
    assert llm.stats()["kv_cache_bytes"] == llm.stats()["kv_blocks_total"] * per_block
    with pytest.raises(ValueError, match="holds no block"):
        LLM(kv_cache_memory_bytes=10)


def test_queue_time_is_visible_in_metrics():
    llm = LLM(max_num_seqs=1)
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=5, ignore_eos=True))
    first, second = (o.metrics for o in outs)
    # One sequence at a time: the second is first scheduled only once the first has finished.
    assert second.first_scheduled_time_s >= first.finish_time_s
    assert second.queue_s == second.first_scheduled_time_s - second.arrival_time_s > 0
    assert first.arrival_time_s <= first.first_scheduled_time_s <= first.token_times_s[0]


def test_prefix_statistics_stay_about_the_prompt_under_preemption():
    """A preempted request re-finds its own output blocks; that must not count as prompt reuse."""
    llm = LLM(num_kv_blocks=16, block_size=4, max_num_batched_tokens=32)
    prompt = "def shared_prefix(a, b):\n    return a + b\n"
    outs = llm.generate([prompt] * 8, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert 0 < stats["prefix_cache_hit_rate"] <= 1
    assert all(0 <= o.num_cached_tokens < len(o.prompt_token_ids) for o in outs)


def test_logprobs_of_chosen_tokens_match_a_plain_forward():
    llm = LLM()
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True))[
        0
    ]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    import torch

    ids = torch.tensor(out.prompt_token_ids + out.token_ids)
    expected = torch.log_softmax(llm.model.logits_without_cache(ids), dim=-1)
    n = len(out.prompt_token_ids)
    for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
        assert logprob == pytest.approx(expected[n - 1 + i, token].item(), abs=1e-4)
        assert logprob <= 0
    plain = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=2))[0]
    assert plain.logprobs is None
