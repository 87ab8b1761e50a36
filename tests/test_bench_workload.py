"""The load tester's workload: seeded lengths, prompts of a target length, shared prefixes, cancellations."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.bench.workload import (
    _PIECE,
    CORPUS_LINES,
    LengthDist,
    WorkloadSpec,
    build_requests,
    corpus_text,
    count_corpus_tokens,
    parse_length,
)


@given(st.integers(1, 400), st.integers(0, 2**32 - 1))
@settings(max_examples=50, deadline=None)
def test_corpus_text_has_the_target_length(num_tokens, seed):
    assert count_corpus_tokens(corpus_text(random.Random(seed), num_tokens)) == num_tokens


@pytest.mark.parametrize("kind", ["fixed", "uniform", "lognormal"])
def test_lengths_are_clipped_to_one_and_max(kind):
    dist = LengthDist(kind, mean=50, spread=200, max_len=120)
    values = dist.sample(2000, seed=0)
    assert min(values) >= 1 and max(values) <= 120


def test_lognormal_has_the_stated_mean_and_spread():
    dist = LengthDist("lognormal", mean=200, spread=100, max_len=1 << 20)
    values = dist.sample(20000, seed=1)
    assert statistics.mean(values) == pytest.approx(200, rel=0.03)
    assert statistics.stdev(values) == pytest.approx(100, rel=0.08)


def test_uniform_stays_within_mean_plus_minus_spread():
    dist = LengthDist("uniform", mean=100, spread=20)
    assert set(dist.sample(2000, seed=2)) <= set(range(80, 121))


def test_parse_length():
    assert parse_length("64", 1000) == LengthDist("fixed", 64, 0, 1000)
    assert parse_length("lognormal:256:128", 2048) == LengthDist("lognormal", 256, 128, 2048)
    with pytest.raises(ValueError):
        parse_length("lognormal:256", 10)
    with pytest.raises(ValueError):
        parse_length("pareto:1:2", 10)


def test_requests_are_deterministic_in_the_seed():
    spec = WorkloadSpec(num_requests=30, prompt_len=LengthDist("lognormal", 64, 32, 256), seed=7)
    assert build_requests(spec) == build_requests(spec)
    assert build_requests(spec) != build_requests(WorkloadSpec(**{**spec.__dict__, "seed": 8}))


def test_prompts_hit_their_target_length():
    spec = WorkloadSpec(num_requests=40, prompt_len=LengthDist("uniform", 50, 30), seed=3)
    for request in build_requests(spec):
        assert count_corpus_tokens(request.prompt) == request.prompt_len_target


def test_shared_prefix_goes_to_about_the_stated_fraction():
    spec = WorkloadSpec(
        num_requests=400, prompt_len=LengthDist("fixed", 80), shared_prefix_fraction=0.5, shared_prefix_len=32
    )
    requests = build_requests(spec)
    sharing = [r for r in requests if r.shares_prefix]
    assert 150 < len(sharing) < 250
    prefix_pieces = {r.prompt.split("\n")[0] for r in sharing}
    assert len({r.prompt[:60] for r in sharing}) == 1, prefix_pieces
    for request in sharing:  # the shared part counts toward the target: total length unchanged
        assert count_corpus_tokens(request.prompt) == 80


def test_cancellation_does_not_change_the_prompts():
    base = WorkloadSpec(num_requests=200, seed=5)
    cancelling = WorkloadSpec(num_requests=200, seed=5, cancel_fraction=0.25, cancel_after_chunks=3)
    plain, cancelled = build_requests(base), build_requests(cancelling)
    assert [r.prompt for r in plain] == [r.prompt for r in cancelled]
    marked = [r for r in cancelled if r.cancel_after_chunks is not None]
    assert 25 < len(marked) < 80 and all(r.cancel_after_chunks == 3 for r in marked)
    assert all(r.cancel_after_chunks is None for r in plain)


def test_dataset_file_is_used_in_order_and_cycled(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}", "max_tokens": i + 1}) for i in range(3)) + "\n\n")
    requests = build_requests(WorkloadSpec(num_requests=5, dataset=path))
    assert [(r.prompt, r.max_tokens) for r in requests] == [("p0", 1), ("p1", 2), ("p2", 3), ("p0", 1), ("p1", 2)]
    path.write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        build_requests(WorkloadSpec(num_requests=1, dataset=path))


def test_with_the_servers_tokenizer_prompts_have_the_target_token_count():
    from minserve.model.loader import resolve_model_path
    from minserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_path("minserve-tiny"))
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    spec = WorkloadSpec(num_requests=30, prompt_len=LengthDist("uniform", 120, 80), seed=3)
    # The longest run of whole corpus pieces that fits: at most the target, short of it by less than the
    # longest piece (a line break and its indent ride along with a piece, hence the "\n" variants).
    pieces = [p for line in CORPUS_LINES for p in _PIECE.findall(line)]
    longest_piece = max(count(prefix + p) for p in pieces for prefix in ("", "\n"))
    for request in build_requests(spec, count):
        tokens = count(request.prompt)
        assert request.prompt_len_target - longest_piece < tokens <= request.prompt_len_target
    assert build_requests(spec, count) == build_requests(spec, count)
