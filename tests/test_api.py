"""The public API on the embedded model: LLM, SamplingParams, RequestOutput."""

from __future__ import annotations

import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.engine.sampler import filtered_probabilities


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_default_model_generates_text(llm):
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.prompt == "def add(a, b):"
    assert out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    assert 1 <= len(out.token_ids) <= 12
    assert out.text == llm.tokenizer.decode(out.token_ids) or out.finish_reason == "stop"
    assert out.finish_reason in ("stop", "length")


def test_greedy_is_deterministic_and_matches_token_id_prompts(llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    text_out = llm.generate("import os\n", params)[0]
    ids_out = llm.generate([llm.tokenizer.encode("import os\n")], params)[0]
    assert ids_out.prompt is None
    assert text_out.token_ids == ids_out.token_ids
    assert len(text_out.token_ids) == 10 and text_out.finish_reason == "length"


def test_one_params_per_prompt(llm):
    outs = llm.generate(
        ["def f():", "class A:"],
        [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)],
    )
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert outs[0].request_id != outs[1].request_id


def test_same_seed_same_sample_different_seed_differs(llm):
    def run(seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate(["def "], params)[0].token_ids

    assert run(7) == run(7)
    assert any(run(7) != run(s) for s in (8, 9, 10))


def test_stop_string_ends_output_and_is_excluded(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = llm.generate(["def fib(n):"], greedy)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        stop = full[-2:]
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert full.startswith(out.text)


def test_metrics_are_monotonic_seconds(llm):
    out = llm.generate(["x = "], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))[0]
    m = out.metrics
    assert len(m.token_times_s) == 6
    assert m.arrival_time_s <= m.token_times_s[0] <= m.token_times_s[-1] <= m.finish_time_s
    assert m.ttft_s > 0 and m.e2e_s >= m.ttft_s
    assert len(m.itl_s) == 5 and all(gap >= 0 for gap in m.itl_s)
    assert m.tpot_s == pytest.approx((m.e2e_s - m.ttft_s) / 5)
    assert m.tpot_s >= sum(m.itl_s) / 5  # E2E also holds the time after the last token


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("stop", [""])],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_are_frozen_and_lowered_by_a_new_object():
    import dataclasses

    params = SamplingParams(max_tokens=50, min_tokens=40, stop="END")
    assert params.stop == ["END"] and dataclasses.replace(params, seed=1).stop == ["END"]  # normalised once
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 5
    lowered = params.with_max_tokens(30)
    assert (lowered.max_tokens, lowered.min_tokens, params.max_tokens) == (30, 30, 50)
    assert params.with_max_tokens(80) is params  # only ever lowered
    with pytest.raises(ValueError, match="SamplingParams.max_tokens"):
        params.with_max_tokens(0)


def test_bad_prompts_raise_before_anything_runs(llm):
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * llm.max_model_len], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([[1, 2, llm.model_config.vocab_size]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])


def test_generation_stops_at_the_context_limit(llm):
    small = LLM(max_model_len=12)
    with pytest.raises(ValueError, match="max_tokens can be at most 4"):  # the server's rule (issue 37)
        small.generate([[5] * 8], SamplingParams(max_tokens=50, ignore_eos=True))
    # The engine core itself still stops a request at the context's end rather than overrun it.
    request_id = small.engine.add_request([5] * 8, SamplingParams(max_tokens=50, ignore_eos=True))
    out = next(o for _ in range(20) for o in small.engine.step() if o.request_id == request_id and o.finished)
    assert len(out.prompt_token_ids) + len(out.token_ids) == 12
    assert out.finish_reason == "length"


def test_top_k_and_top_p_filter_the_distribution():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top2 = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and top2.sum().item() == pytest.approx(1.0)
    probs = torch.softmax(logits, -1)
    nucleus = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=float(probs[0]) + 1e-3))
    assert (nucleus[:2] > 0).all() and (nucleus[2:] == 0).all()
    only_first = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert only_first[0].item() == pytest.approx(1.0)
