"""A changed model against its reference: KL, top-1 agreement, perplexity, greedy divergence, and the
format comparison chapter 07 and the quantization benchmark share."""

import math

import pytest
import torch
import torch.nn.functional as F

from minserve.quality.agreement import first_difference, greedy_divergence, next_token_agreement
from minserve.quality.quantized import compare_formats, format_table

VOCAB = 11


def table_model(seed: int, noise: float = 0.0, base_seed: int = 0):
    """A 'model' whose logits at each position depend on the previous token through a fixed table."""
    base = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(base_seed)) * 2
    table = base + noise * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    return lambda window: table[window]


def test_a_model_agrees_with_itself_exactly():
    tokens = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(1))
    same = next_token_agreement(table_model(0), table_model(0), tokens, window_tokens=50)
    assert same.kl_per_token == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    assert same.perplexity == pytest.approx(same.reference_perplexity)
    assert same.scored_tokens == 200 - 4  # four windows, each's first token unscored


def test_kl_is_the_mean_over_positions_of_the_reference_weighted_log_ratio():
    tokens = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    reference, candidate = table_model(0), table_model(5, noise=1.0)
    got = next_token_agreement(reference, candidate, tokens, window_tokens=30)
    log_p = F.log_softmax(reference(tokens)[:-1], -1)
    log_q = F.log_softmax(candidate(tokens)[:-1], -1)
    by_hand = float((log_p.exp() * (log_p - log_q)).sum(-1).mean())
    assert got.kl_per_token == pytest.approx(by_hand, rel=1e-5)
    nll = float(F.nll_loss(log_q, tokens[1:]))
    assert got.perplexity == pytest.approx(math.exp(nll), rel=1e-5)


def test_more_noise_is_further_away():
    tokens = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(3))
    near, far = (next_token_agreement(table_model(0), table_model(7, noise=n), tokens, 100) for n in (0.2, 2.0))
    assert 0 < near.kl_per_token < far.kl_per_token and near.top1_agreement > far.top1_agreement


def test_greedy_divergence_counts_the_shared_leading_tokens():
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([5], [6]) == 0
    assert greedy_divergence([[1, 2], [3]], [[1, 9], [3]]) == [1, 1]
    with pytest.raises(ValueError, match="2 reference outputs but 1"):
        greedy_divergence([[1], [2]], [[1]])


def test_the_formats_on_the_tiny_model_order_as_their_bits_say():
    """Measured, not assumed: int8 stays closer to float32 than int4 does, and every format costs something
    (float32 against itself costs nothing)."""
    reports = compare_formats("minserve-tiny", ("int8", "int4-g32"), max_tokens=512, window_tokens=256, new_tokens=16)
    full, int8, int4 = reports
    assert full.label == "float32" and full.agreement.kl_per_token == pytest.approx(0, abs=1e-9)
    assert 0 < int8.agreement.kl_per_token < int4.agreement.kl_per_token
    assert int8.agreement.top1_agreement > int4.agreement.top1_agreement
    assert full.step_weight_bytes > int8.step_weight_bytes > int4.step_weight_bytes
    assert int8.bits_per_weight == pytest.approx(8, abs=0.2)
    assert list(format_table(reports).index) == ["float32", "int8", "int4-g32"]
