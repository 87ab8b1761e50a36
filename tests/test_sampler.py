"""Sampling is numerically safe for every setting the API accepts, and one bad row fails only its request."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    return SimpleNamespace(params=params, generator=torch.Generator().manual_seed(0))


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
