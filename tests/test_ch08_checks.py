"""Chapter 08's checks (minserve.lab.speculation_checks) pass on the engine and fail where the property is
gone: a greedy verifier that keeps every draft, a verifier that resamples from p, sampling that speculation
shifted, a speculative step that costs too much, a batch where speculation still pays, a profile whose phase
is not the one named. Engine runs use minserve-tiny on a few short requests; the wall-clock claims (the
speedup band, where the batch stops speculation) are tested on numbers made here."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from minserve import LLM, SamplingParams
from minserve.capacity import levers
from minserve.capacity.kv import model_config
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
    acceptance_rate,
    compare,
    edit_requests,
    greedy,
    spec_config,
    timed_run,
    workloads,
)
from minserve.engine.speculative import verifier
from minserve.engine.speculative.rejection import Verdict, verify
from minserve.lab import speculation, speculation_batch, speculation_checks, speculation_hardware


def _engine(**options) -> LLM:
    return LLM(device="cpu", num_threads=1, **options)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _engine()


def _points(plain: LLM) -> list[SpeculationPoint]:
    prompts = workloads(3)["grounded"]
    reference = timed_run(plain, prompts, greedy(24), batch=1)
    llm = _engine(speculative_config=spec_config("ngram", 3))
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


def test_greedy_identity_refuses_vacuous_runs(plain):
    [point] = _points(plain)
    with pytest.raises(AssertionError, match="check nothing"):
        speculation_checks.check_greedy_identity([dataclasses.replace(point, acceptance=0.0)])


P = torch.tensor([1, 2, 3, 4, 2, 1], dtype=torch.float64) / 13
Q = torch.tensor([5, 1, 1, 1, 3, 1], dtype=torch.float64) / 12


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


def test_the_speedup_check_holds_a_band_around_a_prediction_made_without_the_run():
    assert speculation_checks.check_speedup(_point(1, 1.4, 9.9, 1.15), 1.6)["ratio"] == pytest.approx(1.4 / 1.6)
    with pytest.raises(AssertionError, match="did not pay"):
        speculation_checks.check_speedup(_point(1, 0.9, 1.6, 1.15), 1.6)
    with pytest.raises(AssertionError, match="outside"):  # a step costing k + 1 plain ones: 1.9 / 4 of E
        speculation_checks.check_speedup(_point(1, 1.05, 2.5, 1.15), 2.5)
    with pytest.raises(AssertionError, match="outside"):  # faster than the roofline allows
        speculation_checks.check_speedup(_point(1, 2.4, 1.6, 1.0), 1.9)


def test_the_batch_check_fails_where_the_batch_does_not_take_the_speedup_away():
    paying, losing = _point(1, 1.4, 1.6, 1.15), _point(32, 0.7, 1.4, 1.5)
    assert speculation_checks.check_falls_with_batch([losing, paying]) == {32: 0.7, 1: 1.4}
    with pytest.raises(AssertionError, match="batch 32: 1.30×, not below"):
        speculation_checks.check_falls_with_batch([paying, _point(32, 1.3, 1.4, 1.2)])
    with pytest.raises(AssertionError, match="need two batch sizes"):
        speculation_checks.check_falls_with_batch([paying])


def test_edit_requests_come_from_their_seed_and_acceptance_is_measured_on_them(plain):
    first, again, other = (edit_requests(plain.encode_chat, 4, seed) for seed in (1, 1, 2))
    assert first == again and first != other and len(first) == 4
    assert all(isinstance(t, int) for t in first[0])
    alpha = acceptance_rate(_engine(speculative_config=spec_config("ngram", 3)), workloads(2)["grounded"], greedy(16))
    assert 0 < alpha < 1
    with pytest.raises(ValueError, match="no draft"):  # a plain engine runs no draft
        acceptance_rate(plain, workloads(1)["open"], greedy(4))


def test_the_prediction_places_the_stop_where_the_roofline_speedup_crosses_one():
    h100, llama = hardware("H100"), model_config(MODEL_PRESETS["Llama-3-8B"])
    prediction = speculation_batch.predict(llama, h100, 0.6, 3, context_tokens=1, max_batch=1024)
    assert prediction.at(prediction.stop_batch) >= 1 > prediction.at(prediction.stop_batch + 1)
    assert prediction.at(1) == pytest.approx(expected_tokens_per_step(0.6, 3), rel=1e-3)  # v = 1: memory-bound
    assert speculation_batch.sweep_batches(14) == (1, 30)
    assert speculation_batch.sweep_batches(40) == (1, 32)
    fig = speculation_batch.stop_paying_figure(prediction, [_point(1, 1.4, 1.6, 1.15)], "t")
    assert len(fig.data[0].x) == len(speculation_batch.CURVE_BATCHES) and list(fig.data[1].y) == [1.4]


def test_the_profile_names_the_phase_that_dominates(plain):
    long_prompts = levers.shared_prefix_prompts(2, 512, 8, plain.model_config.vocab_size)
    runs = {
        "chat": levers.one_at_a_time(plain, workloads(2)["grounded"], greedy(24)),
        "long prompt": levers.one_at_a_time(_engine(enable_prefix_caching=False), long_prompts, greedy(2)),
    }
    table = speculation.phase_table(runs)
    assert list(table["requests"]) == [2, 2]
    speculation_checks.check_profile(table, {"chat": "decode", "long prompt": "prefill"}, share=0.5)
    with pytest.raises(AssertionError, match="chat: prefill took"):
        speculation_checks.check_profile(table, {"chat": "prefill"}, share=0.5)
    assert list(speculation.phase_figure(table).data[1].x) == list(table["decode ms"])


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


def test_amdahl_from_the_profile_predicts_what_prefix_reuse_buys_end_to_end(plain):
    assert levers.amdahl_speedup(0.9, 10.0) == pytest.approx(1 / 0.19)
    prompts = levers.shared_prefix_prompts(4, 256, 8, plain.model_config.vocab_size)
    uncached = _engine(enable_prefix_caching=False)
    profile = speculation.phase_table({"system prompt": levers.one_at_a_time(uncached, prompts, greedy(4))})
    runs = levers.prefix_reuse_runs(_engine(enable_prefix_caching=True), uncached, prompts, 4)
    lever = levers.prefix_reuse_lever(runs)
    result = speculation_checks.check_amdahl(profile, "system prompt", lever, runs, band=(0.6, 1.4))
    assert result["measured"] > 1.5 and result["share"] > 0.5
    misplaced = profile.assign(**{"prefill share": 0.05})  # the time put in decode: Amdahl predicts ~1.05×
    with pytest.raises(AssertionError, match="Amdahl's law from the profile"):
        speculation_checks.check_amdahl(misplaced, "system prompt", lever, runs, band=(0.6, 1.4))


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


def test_the_production_table_places_the_stop_past_the_critical_batch_with_a_long_cache():
    table = speculation_hardware.production_table(gpus=("H100",), acceptances=(0.8,), context_tokens=1024)
    row = table.iloc[0]
    assert row["stops paying, weights only"] < row["B*"]  # weights only: before the ridge (E < k + 1)
    kv = row["stops paying, 1024-token KV"]
    assert kv == "never, up to the batch that fits" or kv > row["stops paying, weights only"]
