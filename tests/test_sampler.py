"""Sampling is numerically safe for every setting the API accepts, and one bad row fails only its request."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.engine.penalties import adjust_logits
from minserve.engine.sampler import Sample, SamplingError, filtered_probabilities, sample, sample_batch
from minserve.engine.sampling_params import SamplingParams

VOCAB = 12

# The extremes a JSON body can carry: the smallest subnormal, tiny normals, huge values, and ordinary ones.
extreme_positive = st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 1e300, 1.7976931348623157e308]) | st.floats(
    min_value=1e-320, max_value=1e6, allow_nan=False, allow_infinity=False, exclude_min=False
)
temperatures = extreme_positive
top_ps = st.sampled_from([5e-324, 1e-300, 1e-45, 0.3, 0.999999, 1.0]) | st.floats(
    min_value=5e-324, max_value=1.0, allow_nan=False
)
top_ks = st.integers(-1, VOCAB + 3)
logit_values = st.sampled_from([math.inf, -math.inf, 0.0, 3e38, -3e38]) | st.floats(-1e4, 1e4)
logit_rows = st.lists(logit_values, min_size=VOCAB, max_size=VOCAB).filter(lambda row: max(row) > -math.inf)


@settings(max_examples=400, deadline=None)
@given(row=logit_rows, temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=st.integers(0, 2**32))
def test_every_accepted_setting_gives_a_distribution_that_keeps_a_best_token(row, temperature, top_p, top_k, seed):
    logits = torch.tensor(row, dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    probs = filtered_probabilities(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
    unfiltered = filtered_probabilities(logits, SamplingParams(temperature=temperature))
    best = unfiltered == unfiltered.max()  # ties (exact, at a huge temperature): one of them is kept
    assert probs[best].sum() > 0, "a most likely token must survive every filter"
    assert (probs[unfiltered == 0] == 0).all()
    assert (probs[logits == -math.inf] == 0).all()
    if (logits == math.inf).any():  # tokens at +inf take all the mass
        assert float(probs[logits == math.inf].sum()) == pytest.approx(1.0)
    token = sample(logits, params, torch.Generator().manual_seed(seed))
    assert 0 <= token < VOCAB and probs[token] > 0


def test_a_tiny_temperature_or_top_p_is_greedy_not_nan():
    logits = torch.tensor([0.5, 2.0, 1.0, -3.0])
    for params in (SamplingParams(temperature=5e-324), SamplingParams(top_p=5e-324), SamplingParams(top_p=1e-300)):
        probs = filtered_probabilities(logits, params)
        assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [[math.nan, 0.0, 1.0], [-math.inf, -math.inf, -math.inf]])
def test_unusable_logits_are_a_sampling_error(bad):
    with pytest.raises(SamplingError):
        filtered_probabilities(torch.tensor(bad), SamplingParams(temperature=1.0))


def _seq(params: SamplingParams):
    return SimpleNamespace(
        params=params,
        generator=torch.Generator().manual_seed(0),
        prompt_token_ids=[],
        output_token_ids=[],
        grammar=None,
        held_back_token_ids=(),
    )


def test_one_row_that_cannot_be_sampled_fails_alone():
    logits = torch.tensor([[0.0, 5.0, 1.0], [math.nan, 0.0, 0.0], [2.0, 0.0, 1.0]])
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    seqs = [_seq(greedy), _seq(sampled), _seq(greedy)]
    first, second, third = sample_batch(logits, seqs)
    assert first == Sample(1) and third == Sample(0)
    assert isinstance(second, SamplingError) and "NaN" in str(second)


def test_top_logprobs_are_the_most_likely_tokens_in_order():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    (out,) = sample_batch(logits, [_seq(SamplingParams(temperature=0, logprobs=True, top_logprobs=3))])
    expected = torch.log_softmax(logits[0], -1)
    assert out.token == 1 and out.logprob == pytest.approx(float(expected[1]))
    assert list(out.top_logprobs) == [1, 3, 2]
    assert out.top_logprobs[3] == pytest.approx(float(expected[3]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", math.nan),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 2**70),
        ("top_logprobs", 21),
        ("max_tokens", True),
    ],
)
def test_values_outside_what_the_engine_can_honour_are_refused_by_name(field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}, **extra)


def test_the_whole_seed_range_seeds_a_generator():
    for seed in (0, 2**64 - 1, -(2**63)):
        params = SamplingParams(seed=seed)
        assert sample(torch.zeros(4), params, torch.Generator().manual_seed(params.seed)) in range(4)


# --- steering: logit bias, repetition / frequency / presence penalties, min-p (issue 38) -------------------

penalties = st.sampled_from([-2.0, -5e-324, 0.0, 1e-300, 2.0]) | st.floats(-2.0, 2.0)
repetition_penalties = st.sampled_from([1.0]) | extreme_positive
min_ps = st.sampled_from([0.0, 5e-324, 1e-300, 1.0]) | st.floats(0.0, 1.0)
token_lists = st.lists(st.integers(0, VOCAB - 1), max_size=20)
biases = st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 100.0, 5e-324]) | st.floats(-100, 100))


@settings(max_examples=200, deadline=None)
@given(
    row=logit_rows,
    temperature=st.just(0.0) | temperatures,
    min_p=min_ps,
    presence=penalties,
    frequency=penalties,
    repetition=repetition_penalties,
    bias=biases,
    prompt=token_lists,
    output=token_lists,
    seed=st.integers(0, 2**32),
)
def test_every_accepted_steering_keeps_sampling_safe(
    row, temperature, min_p, presence, frequency, repetition, bias, prompt, output, seed
):
    """Whatever penalties, bias and min-p a request may carry, and whatever came before, its row stays free of
    NaN, still gives a distribution that keeps a most likely token, and a token is always picked."""
    params = SamplingParams(
        temperature=temperature, min_p=min_p, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition, logit_bias=bias, seed=seed,
    )  # fmt: skip
    logits = torch.tensor([row, [0.0] * VOCAB], dtype=torch.float32)  # a plain row beside it, left as it was
    steered = adjust_logits(logits, [params, SamplingParams()], [prompt, prompt], [output, output])
    assert not torch.isnan(steered).any() and steered[0].max() > -math.inf
    assert torch.equal(steered[1], logits[1])
    if not params.greedy:
        probs = filtered_probabilities(steered[0], params)
        assert torch.isfinite(probs).all() and float(probs.sum()) == pytest.approx(1.0, abs=1e-6)
        unfiltered = filtered_probabilities(steered[0], SamplingParams(temperature=temperature))
        assert probs[unfiltered == unfiltered.max()].sum() > 0
    seq = SimpleNamespace(params=params, generator=torch.Generator().manual_seed(seed), prompt_token_ids=prompt,
                          output_token_ids=output, grammar=None, held_back_token_ids=())  # fmt: skip
    (result,) = sample_batch(logits[:1], [seq])
    assert isinstance(result, Sample) and 0 <= result.token < VOCAB
    if params.greedy:
        assert result.token == int(steered[0].argmax())
    assert sample(logits[0], params, torch.Generator().manual_seed(seed), (prompt, output)) in range(VOCAB)


def test_penalties_mean_what_openai_and_vllm_say():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt, output = [1], [0, 0, 2]  # token 0 twice, token 2 once in the output; token 1 in the prompt only

    def steer(**settings):
        return adjust_logits(logits, [SamplingParams(**settings)], [prompt], [output])[0].tolist()

    assert steer(frequency_penalty=0.5) == [1.0, -1.0, 0.0, 3.0]  # − f · count
    assert steer(presence_penalty=0.5) == [1.5, -1.0, 0.0, 3.0]  # − p once, if generated at all
    assert steer(repetition_penalty=2.0) == [1.0, -2.0, 0.25, 3.0]  # prompt and output; / if > 0, · if not
    assert steer(logit_bias={3: -100.0, 1: 1.5}) == [2.0, 0.5, 0.5, -97.0]
    assert steer() == logits[0].tolist()
    # Overflow saturates, so a row keeps a finite token: every token seen, each pushed down by 1e300.
    huge = adjust_logits(torch.full((1, 3), -3e38), [SamplingParams(repetition_penalty=1e300)], [[0, 1, 2]], [[]])
    assert huge.tolist() == [[-torch.finfo(torch.float32).max] * 3]


def test_min_p_keeps_tokens_at_least_that_share_of_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probabilities(logits, SamplingParams(min_p=0.5))  # keep p ≥ 0.25
    assert probs.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert filtered_probabilities(logits, SamplingParams(min_p=1.0)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_steered_rows_in_a_batch_are_steered_as_each_alone():
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=rng)
    settings = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=1.3),
                SamplingParams(), SamplingParams(presence_penalty=-0.5, logit_bias={4: 2.0})]  # fmt: skip
    prompts = [[1, 2], [3], [4, 4, 5], [], [6]]
    outputs = [[7], [3, 3, 8], [5], [1], [4, 9]]
    together = adjust_logits(logits, settings, prompts, outputs)
    for i in range(5):
        alone = adjust_logits(logits[i : i + 1], settings[i : i + 1], prompts[i : i + 1], outputs[i : i + 1])
        assert torch.equal(together[i], alone[0])
    assert adjust_logits(logits, [SamplingParams()] * 5, prompts, outputs) is logits  # nothing to do: no copy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"1": 1.0}),
        ("n", 2),
        ("best_of", 2),
    ],
)
def test_steering_outside_what_the_engine_can_honour_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must"):
        SamplingParams(**{field: value})


def test_n_and_best_of_above_one_say_they_are_not_supported():
    with pytest.raises(ValueError, match="one choice per request"):
        SamplingParams(n=3)
