"""Issue 38, item 2: logit bias, repetition / frequency / presence penalties and min-p in the engine (the same
tokens as the one-request reference loop, speculative decoding included) and over HTTP (the official openai
client too); n and best_of above 1 refused by name. The sampler's own properties: tests/test_sampler.py."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import httpx
import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.config import ServerConfig
from minserve.engine.penalties import adjust_logits
from minserve.engine.reference_loop import generate_token_ids
from minserve.engine.sampler import filtered_probabilities
from minserve.engine.speculative.verifier import verify_drafts
from minserve.quality import chi_square_test
from tests.servers import MODEL, RunningServer

PROMPTS = ["import os\nimport sys\nimport os\nimport", "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n\ndef fib("]
STEERED = [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=1.2, presence_penalty=0.4),
    dict(presence_penalty=-0.8, logit_bias={11: 2.5}, min_p=0.2),
]


def _greedy(**steering) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **steering)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_threads=1)


def test_steered_batch_is_each_request_alone_and_steering_changes_the_answer(llm):
    """Plain and steered requests in one batch give what the reference loop gives each alone."""
    params = [_greedy(), *(_greedy(**s) for s in STEERED)]
    prompts = [PROMPTS[i % 2] for i in range(len(params))]
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert out.token_ids == [t for t, _ in generate_token_ids(llm.model, ids, p)]
    plain = [o.token_ids for o in llm.generate(PROMPTS, _greedy())]
    assert all(out.token_ids != plain[i % 2] for i, out in enumerate(outputs) if i)  # not vacuous


def test_speculative_decoding_stays_exact_with_steering_on(llm):
    spec = LLM(num_threads=1, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = [_greedy(**s) for s in STEERED for _ in PROMPTS]
    prompts = PROMPTS * len(STEERED)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.core.stats().num_accepted_tokens > 0  # drafts were kept under the penalties


def test_sampled_tokens_under_speculation_follow_the_steered_distribution():
    """The verifier steers draft row i with the output plus drafts 0 … i−1: the first token kept follows row
    0's steered distribution, and the second, after the first draft was kept, row 1's, steered with it."""
    vocab, history, drafts = 6, [0, 0, 3], [1, 1]
    params = SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.4,
                            min_p=0.05, logit_bias={5: -1.0})  # fmt: skip
    logits = torch.randn(len(drafts) + 1, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, 1] += 1.5  # drafts the target likes: the first is kept often enough to test the second token
    seq = SimpleNamespace(params=params, prompt_token_ids=[4], output_token_ids=history, draft_token_ids=drafts,
                          generator=torch.Generator().manual_seed(2), grammar=None, held_back_token_ids=())  # fmt: skip
    firsts, seconds = collections.Counter(), collections.Counter()
    for _ in range(1500):
        tokens = [sample.token for sample in verify_drafts(logits, seq)]
        firsts[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            seconds[tokens[1]] += 1
    for row, counts in ((0, firsts), (1, seconds)):
        steered = adjust_logits(logits[row : row + 1], [params], [[4]], [history + drafts[:row]])[0]
        expected = filtered_probabilities(steered, params).tolist()
        result = chi_square_test([counts[t] for t in range(vocab)], expected)
        assert result.passed, (row, result)


def test_min_tokens_holds_back_the_end_token_and_the_stop_strings(llm):
    end = min(llm.engine.core.stop_token_ids)
    ends_at_once = SamplingParams(max_tokens=8, temperature=0, logit_bias={end: 100.0})
    assert llm.generate(["def add"], ends_at_once)[0].token_ids == [end]
    held = llm.generate(["def add"], SamplingParams(max_tokens=8, temperature=0, logit_bias={end: 100.0}, min_tokens=3))
    assert len(held[0].token_ids) == 4 and held[0].token_ids[-1] == end and held[0].finish_reason == "stop"
    stops_early = llm.generate(["def add"], SamplingParams(max_tokens=8, temperature=0, stop=[","]))[0]
    kept = llm.generate(["def add"], SamplingParams(max_tokens=8, temperature=0, stop=[","], min_tokens=8))[0]
    assert len(stops_early.token_ids) < 8 and len(kept.token_ids) == 8
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={llm.tokenizer.vocab_size: 1.0}))


# --- over HTTP -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    running = RunningServer(ServerConfig(), num_threads=1)
    yield running
    running.stop()


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": MODEL, **body}, timeout=60)


def test_every_sampling_field_is_honoured_over_http(server, llm):
    fields = dict(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3, min_p=0.1)
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logit_bias": {"11": 2.5}}
    reply = _post(server, "/v1/completions", {**body, **fields})
    assert reply.status_code == 200, reply.text
    expected = llm.generate(PROMPTS[0], _greedy(**fields, logit_bias={11: 2.5}))[0].text
    assert reply.json()["choices"][0]["text"] == expected
    banned = _post(server, "/v1/completions", {**body, "logit_bias": {"11": -100, "12": 100}, "max_tokens": 3})
    assert banned.json()["choices"][0]["text"] == llm.tokenizer.decode([12, 12, 12])  # +100: all but forced


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"n": 2}, "n", "one choice per request"),
        ({"best_of": 3}, "best_of", "one choice per request"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"logit_bias": {"11": 101}}, "logit_bias", "less than or equal to 100"),
        ({"logit_bias": {"eleven": 1}}, "logit_bias.eleven", "pattern"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "below the vocabulary size"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, extra, param, says):
    for route, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):  # fmt: skip
        reply = _post(server, route, {**body, "max_tokens": 2, **extra})
        assert reply.status_code == 400, (route, reply.text)
        error = reply.json()["error"]
        assert error["param"].startswith(param) and says in error["message"], error


def test_the_openai_client_sends_the_penalties_and_gets_them_applied(server, llm):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
        logit_bias={"11": 3}, extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "ignore_eos": True},
    )  # fmt: skip
    steering = dict(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={11: 3.0}, repetition_penalty=1.2)
    assert out.choices[0].message.content == llm.chat(messages, _greedy(**steering, min_p=0.05))[0].text
