"""Chapter 08's checks (minserve.lab.speculation_checks) pass on the engine and fail where the property is
gone: a greedy verifier that keeps every draft, a verifier that accepts every draft or resamples from p, an
engine without speculation, a proposer that never matches, sampling that speculation shifted, a speculative
step that costs more than predicted, a batch where speculation still pays past the roofline's batch, a profile
whose phase split is wrong. Engine runs use minserve-tiny on a few short requests; the wall-clock claims (the
held-out prediction, the stop-paying batch) are tested on numbers made here."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.capacity import levers
from minserve.capacity.presets import MODEL_PRESETS
from minserve.capacity.roofline import critical_batch_size, hardware
from minserve.capacity.speculation import (
    break_even_acceptance,
    expected_tokens_per_step,
    roofline_stop_paying_batch,
    stop_paying_batch,
)
from minserve.capacity.speculation_runs import (
    SpeculationPoint,
    StepCurve,
    compare,
    greedy,
    held_out,
    measured_acceptance,
    spec_config,
    timed_run,
    workloads,
)
from minserve.engine.speculative import ngram, verifier
from minserve.engine.speculative.rejection import Verdict, verify
from minserve.lab import speculation, speculation_checks


def _engine(**options) -> LLM:
    return LLM(device="cpu", num_threads=1, **options)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _engine()


def _points(plain: LLM, llm: LLM | None = None) -> list[SpeculationPoint]:
    prompts = workloads(3)["grounded"]
    reference = timed_run(plain, prompts, greedy(24), batch=1)
    llm = llm or _engine(speculative_config=spec_config("ngram", 3))
    return [compare(reference, llm, prompts, greedy(24), 1, workload="grounded", proposer="ngram")]


def test_greedy_identity_holds_on_the_engine(plain):
    result = speculation_checks.check_greedy_identity(_points(plain))
    assert result["runs"] == 1


def test_greedy_identity_fails_a_verifier_that_keeps_every_draft(plain, monkeypatch):
    def keep_all(drafts, argmax):
        return Verdict([*drafts, int(argmax[len(drafts)])], len(drafts))

    monkeypatch.setattr(verifier, "verify_greedy", keep_all)
    with pytest.raises(AssertionError, match="greedy output changed|kept no draft or every draft"):
        speculation_checks.check_greedy_identity(_points(plain))


def test_an_engine_without_speculation_fails_the_identity_and_the_prediction(plain):
    [point] = _points(plain, llm=_engine())  # "speculative" engine with no proposer: nothing drafted
    assert point.acceptance == 0.0
    with pytest.raises(AssertionError, match="kept no draft"):
        speculation_checks.check_greedy_identity([point])
    with pytest.raises(AssertionError, match="did not pay|outside"):
        speculation_checks.check_held_out_prediction(0.0, 1.0, dataclasses.replace(point, measured_speedup=1.0))


def test_a_proposer_that_never_matches_fails_the_identity_and_the_prediction(plain, monkeypatch):
    real = ngram.NgramIndex.propose
    monkeypatch.setattr(ngram.NgramIndex, "propose", lambda self, n: [1 for _ in real(self, n)])  # always token 1
    llm = _engine(speculative_config=spec_config("ngram", 3))
    alpha = measured_acceptance(llm, held_out(2), greedy(24))
    [point] = _points(plain, llm=llm)
    assert alpha < 0.05 and point.acceptance < 0.05 and point.same_output
    with pytest.raises(AssertionError, match="kept no draft"):
        speculation_checks.check_greedy_identity([point])
    with pytest.raises(AssertionError, match="did not pay"):  # the drafts cost a longer step and bought nothing
        speculation_checks.check_held_out_prediction(alpha, 1.1, dataclasses.replace(point, measured_speedup=0.95))


def test_greedy_identity_refuses_vacuous_runs(plain):
    [point] = _points(plain)
    with pytest.raises(AssertionError, match="check nothing"):
        speculation_checks.check_greedy_identity([dataclasses.replace(point, acceptance=0.0)])


P = torch.tensor([1, 2, 3, 4, 2, 1], dtype=torch.float64) / 13
Q = torch.tensor([5, 1, 1, 1, 3, 1], dtype=torch.float64) / 12


def _accept_everything(drafts, draft_probs, target_probs, generator) -> Verdict:
    return Verdict([*drafts, int(torch.multinomial(target_probs[-1], 1, generator=generator))], len(drafts))


def test_a_verifier_that_accepts_every_draft_emits_q_and_fails():
    accepting = speculation.first_token_counts(_accept_everything, P, Q, k=1, trials=2000, seed=0)
    wrong = speculation.first_token_counts(speculation.verify_resampling_from_p, P, Q, k=1, trials=2000, seed=0)
    with pytest.raises(AssertionError, match="does not emit p"):
        speculation_checks.check_verifier_distribution(P.tolist(), accepting, wrong)


def test_the_verifier_check_tells_the_engines_verify_from_the_mistake():
    correct = speculation.first_token_counts(verify, P, Q, k=1, trials=2000, seed=0)
    wrong = speculation.first_token_counts(speculation.verify_resampling_from_p, P, Q, k=1, trials=2000, seed=0)
    result = speculation_checks.check_verifier_distribution(P.tolist(), correct, wrong)
    assert result["mistaken_chi2"] > result["critical"] >= result["correct_chi2"]
    with pytest.raises(AssertionError, match="does not emit p"):
        speculation_checks.check_verifier_distribution(P.tolist(), wrong, wrong)
    with pytest.raises(AssertionError, match="did not catch"):
        speculation_checks.check_verifier_distribution(P.tolist(), correct, correct)


def test_sampled_tokens_keep_their_distribution_under_speculation(plain):
    prompt = workloads(1)["open"][0]
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(200)]
    spec = _engine(speculative_config=spec_config("draft", 3, draft="minserve-tiny-draft"))
    outputs = {"plain": plain.generate([prompt] * 200, params), "spec": spec.generate([prompt] * 200, params)}
    common = speculation.most_common_tokens(outputs["plain"], slice(1, None), 8)
    counts = {label: speculation.token_counts(outs, slice(1, None), common) for label, outs in outputs.items()}
    assert sum(counts["plain"]) == sum(counts["spec"]) == 200 * 3
    accepted = spec.engine.core.stats().num_accepted_tokens
    speculation_checks.check_sampled_distribution(counts["plain"], counts["spec"], accepted)
    with pytest.raises(AssertionError, match="kept no draft"):
        speculation_checks.check_sampled_distribution(counts["plain"], counts["spec"], 0)
    shifted = [counts["spec"][-1], *counts["spec"][:-1]]  # the same counts, on other tokens
    with pytest.raises(AssertionError, match="changed the sampled distribution"):
        speculation_checks.check_sampled_distribution(counts["plain"], shifted, accepted)


def _point(batch: int, measured: float, predicted: float, verify_cost: float) -> SpeculationPoint:
    return SpeculationPoint(
        workload="grounded", batch=batch, proposer="ngram", k=3, acceptance=0.5, draft_cost=0.0,
        predicted_speedup=1.9, verify_cost=verify_cost, predicted_with_verify_cost=predicted,
        measured_speedup=measured, plain_tok_s=100.0, spec_tok_s=100.0 * measured, same_output=True,
    )  # fmt: skip


def test_the_held_out_prediction_holds_a_band_around_what_was_measured():
    point = _point(1, 1.5, 0.0, 1.0)  # k = 3, measured 1.5×
    expected = expected_tokens_per_step(0.5, 3) / 1.1
    result = speculation_checks.check_held_out_prediction(0.5, 1.1, point, low=0.6, high=1.5)
    assert result["predicted"] == pytest.approx(expected)
    with pytest.raises(AssertionError, match="did not pay"):
        speculation_checks.check_held_out_prediction(0.5, 1.1, dataclasses.replace(point, measured_speedup=0.9))
    with pytest.raises(AssertionError, match="outside"):  # a verification costing k + 1 plain steps, not 1.1
        speculation_checks.check_held_out_prediction(0.9, 1.0, dataclasses.replace(point, measured_speedup=1.05))


def test_stops_paying_fails_where_speculation_still_pays_past_the_predicted_batch():
    small, large = _point(1, 1.4, 1.6, 1.15), _point(16, 0.7, 1.4, 2.5)
    speculation_checks.check_stops_paying(small, large, predicted_batch=6.0, margin=1.5)
    with pytest.raises(AssertionError, match="batch 16"):
        speculation_checks.check_stops_paying(small, dataclasses.replace(large, measured_speedup=1.1), 6.0)
    with pytest.raises(AssertionError, match="batch 1:"):
        speculation_checks.check_stops_paying(dataclasses.replace(small, measured_speedup=0.9), large, 6.0)
    with pytest.raises(AssertionError, match="do not bracket"):  # a roofline that puts the batch past 16
        speculation_checks.check_stops_paying(small, large, predicted_batch=40.0)


def test_the_profile_predicts_the_prefix_levers_end_to_end_gain(plain):
    prompts = levers.shared_prefix_prompts(4, 512, 8, plain.model_config.vocab_size)
    uncached = _engine(enable_prefix_caching=False)
    levers.one_at_a_time(uncached, prompts[:1], greedy(8))
    share = speculation.phase_table({"system": levers.one_at_a_time(uncached, prompts[1:], greedy(8))})
    ttft, e2e = levers.prefix_reuse_levers(_engine(enable_prefix_caching=True), uncached, prompts, 8)
    share = float(share.loc["system", "prefill share"])
    speculation_checks.check_profile_predicts_lever(share, ttft, e2e, at_least=2.0, low=0.6, high=1.5)
    # A profile that stamps TTFT at the end (prefill = the whole request) predicts the TTFT gain end to end.
    with pytest.raises(AssertionError, match="outside"):
        speculation_checks.check_profile_predicts_lever(1.0, ttft, e2e, at_least=2.0, low=0.6, high=1.5)
    with pytest.raises(AssertionError, match="TTFT only"):  # a prefix cache that never hits
        speculation_checks.check_profile_predicts_lever(share, dataclasses.replace(ttft, with_lever=ttft.without), e2e)


def test_the_roofline_arithmetic_of_where_speculation_stops_paying():
    assert break_even_acceptance(1, 0.4, 1.0) == pytest.approx(0.4)  # α ≥ c + v − 1 at k = 1
    assert break_even_acceptance(1, 0.4, 1.4) == pytest.approx(0.8)
    assert break_even_acceptance(3, 1.5, 1.0) == 1.0  # never pays: 4 tokens cannot cover 5.5 steps
    h100 = hardware("H100")
    weights_only = stop_paying_batch(critical_batch_size(h100), 0.6, 3)
    assert weights_only == pytest.approx(295.2 * expected_tokens_per_step(0.6, 3) / 4, rel=1e-3)
    # The roofline with a one-token context is the weights-only formula, up to attention and rounding.
    llama = MODEL_PRESETS["Llama-3-8B"]
    assert roofline_stop_paying_batch(llama, h100, 0.6, 3, 1) == pytest.approx(weights_only, rel=0.02)
    # A long KV cache keeps the step memory-bound: speculation pays further out.
    assert roofline_stop_paying_batch(llama, h100, 0.6, 3, 1024) > 2 * weights_only


def test_the_step_curve_gives_v():
    curve = StepCurve((1, 4, 16, 64), (0.04, 0.045, 0.09, 0.3))
    assert curve.verify_cost(1, 3) == pytest.approx(0.045 / 0.04)
    assert curve.verify_cost(16, 3) == pytest.approx(0.3 / 0.09)
    assert curve.seconds(128) == pytest.approx(0.6)  # past the last point: in proportion to the tokens
    assert curve.seconds(2) == pytest.approx((0.04 * 0.045) ** 0.5)  # halfway between 1 and 4 in log-log


def test_prefix_reuse_caches_the_shared_prefix_and_keeps_the_tokens(plain, tmp_path):
    prompts = levers.shared_prefix_prompts(3, 64, 8, plain.model_config.vocab_size)
    lever = levers.prefix_reuse(_engine(enable_prefix_caching=True), _engine(enable_prefix_caching=False), prompts, 4)
    assert lever.same_output and lever.note.startswith("64 of 72")  # 64 = four full 16-token blocks
    nothing_recorded = speculation.levers_table([lever], results_dir=tmp_path)
    assert list(nothing_recorded["source"]) == ["measured here", "no benchmarks/results/levers-*.json"]
    recorded = levers.Lever("torch.compile (batch 1)", "decode", "TPOT (ms), batch 1", 2.0, 1.0, True)
    (tmp_path / "levers-cpu-2026-12-04.json").write_text(json.dumps({"rows": [recorded.row()]}))
    table = speculation.levers_table([lever], results_dir=tmp_path)
    assert list(table["source"]) == ["measured here", "recorded: levers-cpu-2026-12-04.json"]
    assert table.loc["torch.compile (batch 1)", "ratio"] == 2.0


def test_acceptance_by_position_counts_only_the_positions_reached():
    from minserve.capacity.speculation_runs import acceptance_by_position
    from minserve.trace import TraceEvent

    steps = [(3, 0), (3, 1), (3, 3), (2, 2), (0, 0)]  # (drafted, accepted)
    events = [TraceEvent("r", "decode", 0.0, 0.0, {"drafted": d, "accepted": a}) for d, a in steps]
    # position 1 reached by 4 steps, kept by 3; position 2 reached by 3, kept by 2; position 3 reached by 1, kept 1.
    assert acceptance_by_position(events, 3) == [3 / 4, 2 / 3, 1.0]


def test_the_explorer_draws_the_curve_and_the_measured_points():
    fig = speculation.speedup_figure(0.5, 0.0, 1.0, [_point(1, 1.4, 1.6, 1.15)], max_k=4)
    assert fig.data[0].y[2] == pytest.approx(1.875)  # k = 3 at α = 0.5, c = 0, v = 1
    assert list(fig.data[1].y) == [1.4]
    assert len(speculation.speedup_explorer([_point(1, 1.4, 1.6, 1.15)]).children) == 4
    assert isinstance(speculation.points_table([_point(1, 1.4, 1.6, 1.15)]), pd.DataFrame)
