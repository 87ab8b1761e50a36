"""minserve.workload: one definition of arrivals and lengths, so a spec and a seed mean the same requests in
the load tester, the simulator and the chapters."""

from __future__ import annotations

import pytest

from minserve.bench.arrivals import OpenLoop
from minserve.bench.workload import WorkloadSpec, build_requests
from minserve.workload import LengthDist, parse_length, poisson_arrivals, request_lengths, timetable


@pytest.mark.parametrize("seed", [0, 7])
def test_the_load_tester_draws_the_lengths_the_simulator_draws(seed):
    prompt, output = parse_length("lognormal:64:32", 512), parse_length("uniform:20:10")
    spec = WorkloadSpec(num_requests=40, prompt_len=prompt, output_len=output, seed=seed)
    sent = [(r.prompt_len_target, r.max_tokens) for r in build_requests(spec)]
    assert sent == request_lengths(prompt, output, 40, seed)  # what `minserve plan simulate` draws
    assert sent != request_lengths(prompt, output, 40, seed + 1)


def test_the_load_testers_timetable_is_the_simulators_arrivals():
    assert OpenLoop(3.0, "gamma", burstiness=0.5, seed=4).timetable(30) == poisson_arrivals(30, 3.0, 4, 0.5)
    assert OpenLoop(3.0, seed=4).timetable(30) == poisson_arrivals(30, 3.0, 4) == timetable(30, 3.0, seed=4)


def test_output_lengths_do_not_move_when_the_prompt_spec_changes():
    output = LengthDist("uniform", 50, 40)
    first = [o for _, o in request_lengths(LengthDist("fixed", 8), output, 25, seed=3)]
    second = [o for _, o in request_lengths(LengthDist("lognormal", 300, 100), output, 25, seed=3)]
    assert first == second


def test_a_bad_length_spec_says_what_is_expected():
    with pytest.raises(ValueError, match="length spec 'uniform:x:1'"):
        parse_length("uniform:x:1")
    with pytest.raises(ValueError, match="fixed, uniform or lognormal"):
        parse_length("pareto:1:2")
