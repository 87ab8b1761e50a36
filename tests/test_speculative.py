"""Speculative decoding's parts on their own: the config, the n-gram proposer, greedy and rejection
verification (checked by a chi-square test that a wrong sampler fails), and the speedup formula."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minserve.capacity.speculation import expected_tokens_per_step, predicted_speedup
from minserve.engine.speculative import NgramIndex, SpeculativeConfig, propose_ngram, rejection, verify, verify_greedy
from minserve.quality import chi_square_quantile, chi_square_test

# --- config ---------------------------------------------------------------------------------------------


def test_config_takes_vllms_dict_shapes():
    ngram = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (ngram.num_speculative_tokens, ngram.prompt_lookup_max, ngram.prompt_lookup_min) == (3, 5, 1)
    draft = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "minserve-tiny-draft", "num_speculative_tokens": 2}
    )
    assert draft.model == "minserve-tiny-draft"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "lower the"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "uses no model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_spec_tokens": 2}, "unknown key"),
        ({"method": "ngram"}, "must be given"),
        ({"method": "early_exit", "num_speculative_tokens": 2}, 'needs "num_draft_layers"'),
        ({"method": "early_exit", "num_speculative_tokens": 2, "num_draft_layers": 0}, 'needs "num_draft_layers"'),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_draft_layers": 2}, 'belongs to method "early_exit"'),
    ],
)
def test_config_mistakes_say_what_to_change(options, says):
    with pytest.raises(ValueError, match=says):
        SpeculativeConfig.from_dict(options)


# --- the n-gram proposer --------------------------------------------------------------------------------


def test_ngram_copies_what_followed_the_longest_most_recent_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 1, 2, 4, 1, 2]
    # "1 2" occurred at 1 and at 5; the most recent (5) was followed by 4, 1, 2.
    assert propose_ngram(tokens, 3, max_n=2) == [4, 1, 2]
    # With a 3-gram window, "4 1 2" never occurred before; "1 2" is the longest that did.
    assert propose_ngram(tokens, 2, max_n=3) == [4, 1]
    # The longest match wins over a more recent shorter one: "8 9" last occurred at 4 (followed by 7), but
    # "7 8 9" occurred at 0, followed by 0.
    assert propose_ngram([7, 8, 9, 0, 8, 9, 7, 8, 9], 1, max_n=3) == [0]
    assert propose_ngram([1, 2, 3, 4], 3, max_n=3) == []  # nothing repeats
    assert propose_ngram([1, 2, 3, 4], 3, max_n=3, min_n=1) == []


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_the_index_proposes_what_the_reference_scan_does_after_every_token(tokens, k, max_n, extra):
    min_n = min(1 + extra, max_n)
    index = NgramIndex(max_n, min_n)
    for i, token in enumerate(tokens):
        index.append(token)
        assert index.propose(k) == propose_ngram(tokens[: i + 1], k, max_n, min_n)
    assert len(index) == len(tokens)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 5), st.integers(1, 4))
def test_ngram_proposals_really_followed_an_earlier_copy_of_the_suffix(tokens, k, max_n):
    proposal = propose_ngram(tokens, k, max_n=max_n)
    assert len(proposal) <= k
    if not proposal:
        # No suffix of length 1 … max_n occurs earlier with something after it.
        last = tokens[-1]
        assert last not in tokens[:-1]
        return
    starts = [
        j
        for n in range(1, max_n + 1)
        for j in range(n, len(tokens))
        if len(tokens) > n and tokens[j - n : j] == tokens[-n:] and tokens[j : j + len(proposal)] == proposal
    ]
    assert starts, "the proposal must be what followed some earlier occurrence of a suffix"


def test_ngram_refuses_a_bad_window():
    with pytest.raises(ValueError):
        propose_ngram([1, 2], 2, max_n=1, min_n=2)


# --- greedy verification --------------------------------------------------------------------------------


def test_greedy_accepts_while_the_draft_matches_then_takes_the_targets_token():
    assert verify_greedy([4, 5, 6], [4, 5, 7, 8]) == rejection.Verdict([4, 5, 7], 2)
    assert verify_greedy([4, 5, 6], [4, 5, 6, 8]) == rejection.Verdict([4, 5, 6, 8], 3)  # all in, plus the bonus
    assert verify_greedy([4], [1, 2]) == rejection.Verdict([1], 0)
    with pytest.raises(ValueError, match="target positions"):
        verify_greedy([1, 2], [1, 2])


@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.lists(st.integers(0, 4), min_size=30, max_size=30))
def test_greedy_speculation_emits_exactly_what_plain_greedy_does(prompt, table):
    """A toy deterministic 'model' (next token = table[hash of the last two tokens]) decoded plainly and with
    any proposer (here: propose from a second, different table) gives the same tokens."""

    def argmax_after(seq: list[int]) -> int:
        return table[(seq[-1] * 5 + (seq[-2] if len(seq) > 1 else 0)) % len(table)]

    plain = list(prompt)
    while len(plain) < len(prompt) + 20:
        plain.append(argmax_after(plain))
    spec = list(prompt)
    while len(spec) < len(prompt) + 20:
        drafts = propose_ngram(spec, 3, max_n=2) or [spec[-1]]
        targets = [argmax_after(spec + drafts[:i]) for i in range(len(drafts) + 1)]
        spec += verify_greedy(drafts, targets).tokens
    assert spec[: len(plain)] == plain


# --- rejection sampling ---------------------------------------------------------------------------------

ALPHA = 1e-3  # each test's chance of failing a correct sampler by bad luck (the seeds are fixed besides)
TRIALS = 3000


def _emitted_counts(p: torch.Tensor, q: torch.Tensor | None, k: int, seed: int) -> tuple[list[int], list[int]]:
    """Run ``TRIALS`` verification steps with context-free p and q (the same at every position): counts of
    the first emitted token, and of every emitted token (each position is then a sample from p)."""
    generator = torch.Generator().manual_seed(seed)
    first, every = [0] * len(p), [0] * len(p)
    target = p.expand(k + 1, -1)
    for _ in range(TRIALS):
        if q is None:  # a deterministic proposer: drafts are fixed guesses, here token 0 then 1, 2, ...
            drafts, draft_probs = [i % len(p) for i in range(k)], None
        else:
            drafts = [int(t) for t in torch.multinomial(q, k, replacement=True, generator=generator)]
            draft_probs = q.expand(k, -1)
        tokens = verify(drafts, draft_probs, target, generator).tokens
        first[tokens[0]] += 1
        for token in tokens:
            every[token] += 1
    return first, every


def _dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


CASES = {
    "p equals q": (_dist(4, 3, 2, 1, 1, 1), _dist(4, 3, 2, 1, 1, 1)),
    "disjoint supports": (_dist(0, 0, 0, 5, 3, 2), _dist(6, 3, 1, 0, 0, 0)),
    "one-hot q (n-gram)": (_dist(1, 2, 3, 4, 2, 1), None),
    "random p and q": (
        torch.softmax(torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 0),
        torch.softmax(torch.randn(8, generator=torch.Generator().manual_seed(2), dtype=torch.float64), 0),
    ),
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_emits_the_targets_distribution(case, k):
    p, q = CASES[case]
    for seed in (0, 1):
        first, every = _emitted_counts(p, q, k, seed)
        assert chi_square_test(first, p.tolist(), ALPHA).passed, (case, seed, first)
        assert chi_square_test(every, p.tolist(), ALPHA).passed, (case, seed, every)


@pytest.mark.parametrize("case", ["one-hot q (n-gram)", "random p and q"])
def test_the_test_fails_a_sampler_that_resamples_from_p_instead_of_the_residual(case, monkeypatch):
    """The common mistake: on rejection, sample from p again. Accepted drafts already covered min(p, q), so
    that over-weights the tokens q likes; the chi-square test must see it. (With disjoint supports nothing
    is ever accepted and the residual is p itself, so there the mistake is harmless.)"""
    monkeypatch.setattr(rejection, "_residual", lambda p, q: p)
    p, q = CASES[case]
    first, _ = _emitted_counts(p, q, 1, seed=0)
    assert not chi_square_test(first, p.tolist(), ALPHA).passed


def test_the_test_fails_a_sampler_that_always_accepts(monkeypatch):
    monkeypatch.setattr(rejection, "_uniform", lambda generator: 0.0)
    p, q = CASES["random p and q"]
    first, _ = _emitted_counts(p, q, 1, seed=0)
    assert not chi_square_test(first, p.tolist(), ALPHA).passed


def test_a_seeded_verification_is_reproducible():
    p, q = CASES["random p and q"]
    runs = [_emitted_counts(p, q, 3, seed=7) for _ in range(2)]
    assert runs[0] == runs[1]


# --- the chi-square test itself and the speedup formula -------------------------------------------------


def test_chi_square_quantiles_match_the_tables():
    # Published upper points: df 10 at 0.999 is 29.59, df 5 at 0.95 is 11.07, df 30 at 0.999 is 59.70.
    for df, quantile, table in ((10, 0.999, 29.59), (5, 0.95, 11.07), (30, 0.999, 59.70)):
        assert chi_square_quantile(df, quantile) == pytest.approx(table, rel=0.01)


def test_chi_square_pools_rare_categories_and_fails_impossible_ones():
    assert chi_square_test([50, 50, 0, 0], [0.5, 0.49, 0.005, 0.005]).df == 2  # the two rare cells pooled
    assert chi_square_test([10, 0, 1], [0.5, 0.5, 0.0]).statistic == math.inf


def test_expected_tokens_per_step_is_the_geometric_sum():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    alpha, k = 0.6, 3
    assert expected_tokens_per_step(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))
    assert predicted_speedup(0.6, 3, 0.0) == pytest.approx(expected_tokens_per_step(0.6, 3))
    assert predicted_speedup(0.6, 3, 0.5) < 1 < predicted_speedup(0.9, 3, 0.05)  # a costly draft can lose
