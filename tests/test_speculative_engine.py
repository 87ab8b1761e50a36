"""Speculative decoding inside the engine (n-gram proposer): greedy output identical to plain decoding,
under chunked prefill and preemption too; sampled output distributed as plain sampling's; no block leaked;
drafts and acceptances counted; a mistaken config refused with what to change."""

from __future__ import annotations

import argparse
import collections

import httpx
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minserve import LLM, SamplingParams
from minserve.config import EngineConfig
from minserve.flags import add_config_flags, json_object
from minserve.quality import chi_square_test, chi_square_two_sample
from tests.servers import MODEL, RunningServer

# Code repeats itself, so prompt lookup finds drafts in it and in what the model writes after it.
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    "def fib(n):",
    "import os\nimport sys\nimport os\nimport",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n\n    def pop(self):",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
]
LINES = ["x = 1\n", "y = x\n", "print(x)\n", "def f():\n", "    return y\n"]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def ngram(k: int, max_n: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": max_n}


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(num_threads=1)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_is_plain_greedy_output(plain, k):
    llm = LLM(num_threads=1, speculative_config=ngram(k))
    expected = [out.token_ids for out in plain.generate(PROMPTS, GREEDY)]
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == expected
    stats = llm.engine.core.stats()
    # Not vacuous: drafts ran, some were kept (fewer steps than tokens), some were not.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.core.num_steps < GREEDY.max_tokens
    assert llm.stats()["kv_blocks_used"] == 0


def test_the_trace_shows_each_decode_steps_drafts_and_what_was_kept():
    llm = LLM(num_threads=1, speculative_config=ngram(3))
    [out] = llm.generate(PROMPTS[0], GREEDY)
    decodes = [e for e in llm.tracer.for_request(out.request_id) if e.name == "decode"]
    speculated = [e for e in decodes if "drafted" in e.args]
    assert speculated and all(0 <= e.args["accepted"] <= e.args["drafted"] <= 3 for e in speculated)
    stats = llm.engine.core.stats()
    assert sum(e.args["drafted"] for e in speculated) == stats.num_draft_tokens
    assert sum(e.args["accepted"] for e in speculated) == stats.num_accepted_tokens
    # Every output token after the first came from a decode step: one per step, plus the kept drafts.
    assert len(decodes) + stats.num_accepted_tokens == len(out.token_ids) - 1
    # The request's own counts are the trace's, and its mean accepted length is tokens per verifying step.
    m = out.metrics
    assert (m.num_verify_steps, m.num_draft_tokens, m.num_accepted_tokens) == (
        len(speculated), stats.num_draft_tokens, stats.num_accepted_tokens)  # fmt: skip
    assert m.mean_accepted_length == 1 + m.num_accepted_tokens / len(speculated) > 1
    assert m.acceptance_rate == stats.acceptance_rate == llm.stats()["acceptance_rate"]


def test_each_request_counts_its_own_drafts_and_they_sum_to_the_engines():
    llm = LLM(num_threads=1, speculative_config=ngram(3))
    outs = llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.core.stats()
    for name in ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens"):
        per_request = [getattr(out.metrics, name) for out in outs]
        assert sum(per_request) == getattr(stats, name) > 0
    assert len({out.metrics.num_accepted_tokens for out in outs}) > 1  # not one figure copied to each


def test_drafts_stay_within_the_step_budget(plain):
    """A 6-token budget and 4 sequences: a step cannot carry 4 × (1 + 5) tokens, so drafts are cut to fit,
    with chunked prefill off too; the output stays plain greedy's."""
    for chunked in (True, False):
        llm = LLM(num_threads=1, max_num_batched_tokens=6, enable_chunked_prefill=chunked, speculative_config=ngram(5))
        steps = []
        llm.engine.core.observers.append(steps.append)
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in outputs] == [out.token_ids for out in plain.generate(PROMPTS, GREEDY)]
        decoding = [r for r in steps if all(s.state in ("decode", "verify") for s in r.scheduled)]
        assert any(s.state == "verify" for r in decoding for s in r.scheduled)
        assert decoding and all(r.num_tokens <= 6 for r in decoding)
        assert llm.engine.core.stats().num_accepted_tokens > 0


def test_greedy_identity_holds_under_chunked_prefill_and_preemption(plain):
    # 10 blocks of 16 tokens for 4 prompts of 20-30 tokens growing by 48: they cannot all stay, so some are
    # preempted and recomputed; a 32-token step budget chunks every prompt.
    tight = {"num_kv_blocks": 10, "max_num_batched_tokens": 32, "num_threads": 1}
    reference = LLM(**tight).generate(PROMPTS, GREEDY)
    llm = LLM(**tight, speculative_config=ngram(3))
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outputs] == [out.token_ids for out in reference]
    assert [out.token_ids for out in reference] == [out.token_ids for out in plain.generate(PROMPTS, GREEDY)]
    assert llm.engine.core.stats().num_preemptions > 0 and llm.engine.core.stats().num_accepted_tokens > 0
    assert llm.stats()["kv_blocks_used"] == 0


def draft(k: int) -> dict:
    return {"method": "draft_model", "model": "minserve-tiny-draft", "num_speculative_tokens": k}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_model_with_its_own_kv_gives_plain_greedy_output(k):
    """Under chunked prefill and preemption too; the draft's blocks all come back, as the target's do."""
    tight = {"num_kv_blocks": 10, "max_num_batched_tokens": 32, "num_threads": 1}
    reference = LLM(**tight).generate(PROMPTS, GREEDY)
    llm = LLM(**tight, speculative_config=draft(k))
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == [out.token_ids for out in reference]
    stats, proposer = llm.engine.core.stats(), llm.engine.core.proposer
    assert stats.num_preemptions > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.kv_blocks_used == 0 and proposer.blocks.num_used_blocks == 0


def test_the_draft_models_drafts_are_its_greedy_continuation_after_a_rejection():
    """The draft's own KV rolls back: after two drafts kept and a token of the target's own, what it drafts
    is what the draft model, run plainly from the same tokens, would write next."""
    from minserve.engine.outputs import RequestMetrics
    from minserve.engine.sequence import Sequence, SequenceStatus
    from minserve.engine.speculative.draft_model import DraftModelProposer, load_draft

    draft_llm = LLM("minserve-tiny-draft", num_threads=1)
    greedy4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def continuation(tokens: list[int]) -> list[int]:
        return draft_llm.generate([tokens], greedy4)[0].token_ids

    engine = draft_llm.engine
    model = load_draft("minserve-tiny-draft", vocab_size=engine.model_config.vocab_size, dtype=engine.dtype,
                       device=engine.device)  # fmt: skip
    proposer = DraftModelProposer(model, 4, backend="torch", num_blocks=32, block_size=16)
    tokens = draft_llm.tokenizer.encode(PROMPTS[2])
    target = Sequence("t", None, tokens, greedy4, RequestMetrics(0.0), None, status=SequenceStatus.RUNNING)
    [first] = proposer.propose([target], [4])
    assert first == continuation(tokens)
    other = next(t for t in range(10, 500) if t != first[2])  # the target disagreed at the third draft
    target.prompt_token_ids = [*tokens, *first[:2], other]
    [second] = proposer.propose([target], [4])
    assert second == continuation(target.prompt_token_ids)
    proposer.release(target)
    assert proposer.blocks.num_used_blocks == 0


def test_a_draft_of_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens"):
        LLM(speculative_config={"method": "draft_model", "model": "smollm2-135m-instruct", "num_speculative_tokens": 2})


def early_exit(k: int, layers: int = 1) -> dict:
    return {"method": "early_exit", "num_draft_layers": layers, "num_speculative_tokens": k}


def test_an_early_exit_draft_shares_the_targets_weights_and_gives_plain_greedy_output(plain):
    """The target's first layer and its head draft; nothing is copied, the target's KV cache is its own."""
    llm = LLM(num_threads=1, num_kv_blocks=10, max_num_batched_tokens=32, speculative_config=early_exit(3))
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == [
        out.token_ids for out in plain.generate(PROMPTS, GREEDY)
    ]
    target, draft = llm.engine.model, llm.engine.core.proposer.runner.model
    assert len(draft.layers) == 1 < len(target.layers)
    assert draft.layers[0].mlp.down_proj.weight is target.layers[0].mlp.down_proj.weight
    assert draft.lm_head.weight is target.lm_head.weight
    assert draft.layers[0].self_attn.kv_cache is not target.layers[0].self_attn.kv_cache
    stats = llm.engine.core.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and stats.num_preemptions > 0


def test_an_early_exit_draft_is_the_first_layers_run_alone():
    """Its logits are the target's with every layer past the first removed, and not the whole target's."""
    from torch import nn

    from minserve.engine.speculative.early_exit import early_exit_view

    model = LLM(num_threads=1).engine.model
    tokens = torch.tensor([5, 17, 42, 9])
    whole = model.logits_without_cache(tokens)
    view_logits = early_exit_view(model, 1).logits_without_cache(tokens)
    model.layers = nn.ModuleList(model.layers[:1])  # this engine's model only: it is not used again
    assert torch.equal(view_logits, model.logits_without_cache(tokens))
    assert not torch.allclose(view_logits, whole)
    with pytest.raises(ValueError, match="between 1 and 3"):
        early_exit_view(model, 4)


@pytest.fixture(scope="module")
def speculative() -> LLM:
    return LLM(num_threads=1, num_kv_blocks=40, max_num_batched_tokens=48, speculative_config=ngram(4, max_n=2))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(st.sampled_from(LINES), min_size=1, max_size=12),
    max_tokens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
)
def test_no_block_leaks_and_greedy_identity_on_random_workloads(plain, speculative, lines, max_tokens):
    prompts = ["".join(lines[i:] + lines[:i]) for i in range(len(max_tokens))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    got = speculative.generate(prompts, params)
    assert [out.token_ids for out in got] == [out.token_ids for out in plain.generate(prompts, params)]
    assert [len(out.token_ids) for out in got] == max_tokens  # a run of accepted drafts never overshoots
    manager = speculative.engine.core.block_manager
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == manager.num_blocks


@pytest.fixture(scope="module", params=["ngram", "draft model"])
def tight_speculative(request) -> LLM:
    """Too little KV for the workloads below: sequences are preempted (and their drafts' blocks with them)."""
    proposal = ngram(3, max_n=2) if request.param == "ngram" else draft(3)
    return LLM(num_threads=1, num_kv_blocks=8, max_num_batched_tokens=40, speculative_config=proposal)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(st.sampled_from(LINES), min_size=2, max_size=10),
    max_tokens=st.lists(st.integers(1, 32), min_size=2, max_size=5),
    cancels=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), max_size=3),
)
# Found by this test: a step that drops a sequence's drafts under memory pressure, and samples exactly its
# first draft, left the draft model's shadow with nothing to run.
@example(lines=["print(x)\n", "    return y\n", "x = 1\n", "    return y\n"] + ["def f():\n"] * 3,
         max_tokens=[12, 14, 25, 19], cancels=[])  # fmt: skip
def test_cancels_and_preemption_under_speculation_leak_no_block(plain, tight_speculative, lines, max_tokens, cancels):
    """Requests cancelled at random steps, others preempted: every block of the target (and of a draft
    model) comes back, and the requests left alone still give plain greedy output."""
    engine = tight_speculative.engine
    prompts = [PROMPTS[i % len(PROMPTS)] + "".join(lines[i:]) for i in range(len(max_tokens))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    finished, step = {}, 0
    while engine.has_unfinished_requests():
        for index, at_step in cancels:
            if at_step == step and index < len(ids):
                engine.abort_request(ids[index])
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
    engine.core.block_manager.check_invariants(live=[])
    assert engine.core.block_manager.num_used_blocks == 0
    proposer_blocks = getattr(engine.core.proposer, "blocks", None)
    assert proposer_blocks is None or proposer_blocks.num_used_blocks == 0
    expected = plain.generate(prompts, params)
    for request_id, reference in zip(ids, expected):
        if finished[request_id].finish_reason != "cancelled":
            assert finished[request_id].token_ids == reference.token_ids


def test_a_stop_inside_an_accepted_run_ends_the_request_there(plain):
    llm = LLM(num_threads=1, speculative_config=ngram(5))
    [reference] = plain.generate(PROMPTS[0], GREEDY)
    middle = len(reference.text) // 2
    stop = reference.text[middle : middle + 3]  # text the greedy answer reaches: it must end just before
    params = SamplingParams(max_tokens=48, temperature=0.0, stop=stop)
    [plain_out], [spec_out] = plain.generate(PROMPTS[0], params), llm.generate(PROMPTS[0], params)
    assert spec_out.text == plain_out.text and len(spec_out.text) <= middle
    assert spec_out.finish_reason == plain_out.finish_reason == "stop"
    assert llm.engine.core.stats().num_accepted_tokens > 0


class GreedyDrafts:
    """A proposer that always drafts: the plain greedy answer's tokens at the positions to come. Every
    sampled position is then verified, and a draft is kept with the target's probability of it."""

    num_speculative_tokens = 3

    def __init__(self, greedy_tokens: list[int]) -> None:
        self.greedy_tokens = greedy_tokens

    def propose(self, seqs, num_tokens: list[int]) -> list[list[int]]:
        return [self.greedy_tokens[len(s.output_token_ids) :][:n] for s, n in zip(seqs, num_tokens)]

    def release(self, seq) -> None:
        pass


@pytest.mark.parametrize("proposer", ["always drafting", "draft model"])
def test_sampled_tokens_follow_the_plain_samplers_distribution(plain, proposer):
    """Temperature 1, top-k 3: tokens 2-4 of many seeded requests, drafted at every position, pass a
    two-sample chi-square test against plain sampling with other seeds, position by position; a verifier
    that kept every draft fails it (tests/test_speculative.py checks the verifier's own distribution)."""
    prompt = PROMPTS[1]
    [greedy] = plain.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    if proposer == "draft model":
        spec_llm = LLM(num_threads=1, speculative_config=draft(3))
    else:
        spec_llm = LLM(num_threads=1, speculative_config=ngram(3))
        spec_llm.engine.core.proposer = GreedyDrafts(greedy.token_ids)

    def sampled(llm: LLM, seeds: range) -> list[list[int]]:
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in seeds]
        return [out.token_ids for out in llm.generate([prompt] * len(params), params)]

    plain_tokens, spec_tokens = sampled(plain, range(300)), sampled(spec_llm, range(300, 600))
    for position in (1, 2, 3):
        a = collections.Counter(tokens[position] for tokens in plain_tokens)
        b = collections.Counter(tokens[position] for tokens in spec_tokens)
        keys = sorted(set(a) | set(b))
        result = chi_square_two_sample([a[k] for k in keys], [b[k] for k in keys])
        assert result.passed, (position, result)
    stats = spec_llm.engine.core.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both verification paths ran


def test_the_two_sample_test_rejects_different_samplers():
    assert chi_square_two_sample([100, 100, 100], [110, 95, 95]).passed
    assert not chi_square_two_sample([150, 100, 50], [50, 100, 150]).passed
    assert chi_square_test([100, 100], [0.5, 0.5]).passed


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"method": "ngram"}, "must be given"),
        ("ngram", "must be a dict"),
    ],
)
def test_a_mistaken_speculative_config_says_what_to_change(options, says):
    with pytest.raises(ValueError, match=says):
        LLM(speculative_config=options)


def test_serve_takes_vllms_speculative_config_flag():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig, ["speculative_config"])
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        json_object("{method: ngram}")
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        json_object("[3]")


def test_the_server_speculates_and_reports_it_in_its_metrics(plain):
    from openai import OpenAI

    server = RunningServer(speculative_config=ngram(3), num_threads=1)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0)
        [offline] = plain.generate(PROMPTS[0], SamplingParams(max_tokens=32, temperature=0.0))
        assert answer.choices[0].text == offline.text
        metrics = httpx.get(server.url + "/metrics").text
        drafted, accepted = (
            _gauge(metrics, f"minserve:spec_decode_num_{name}_tokens") for name in ("draft", "accepted")
        )
        assert 0 < accepted < drafted
        steps = _gauge(metrics, "minserve:spec_decode_num_drafts")
        assert _gauge(metrics, "minserve:spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
        assert _gauge(metrics, "minserve:spec_decode_mean_accepted_length") == pytest.approx(1 + accepted / steps)
    finally:
        server.stop()


def _gauge(exposition: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in exposition.splitlines() if line.startswith(name + " "))
