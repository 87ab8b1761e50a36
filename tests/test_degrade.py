"""Degraded modes: the hysteresis switch does not flap, the modes cap what a request gets, speculation turns
off in the engine core and back on without changing a greedy answer, and a real server shows it all."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minserve import LLM, SamplingParams
from minserve.admission import QueueState
from minserve.config import ServerConfig
from minserve.engine.service_rates import ServiceRates
from minserve.serve.degrade import HEADER, DegradedModes, Degrader, Hysteresis, make_degrader
from tests.servers import MODEL, RunningServer

RATES = ServiceRates(prefill_tokens_per_s=100.0, decode_step_s=0.02)


def load(num_requests: int, queued_prompt_tokens: int = 0) -> QueueState:
    return QueueState(num_waiting=num_requests, num_running=0, queued_prompt_tokens=queued_prompt_tokens, rates=RATES)


# --- the switch ----------------------------------------------------------------------------------------------


@given(st.lists(st.floats(min_value=4.01, max_value=9.99), max_size=200))
def test_a_signal_between_the_thresholds_never_flips_the_switch(readings):
    for start_active in (False, True):
        switch = Hysteresis(enter=10, exit=4)
        switch.active = start_active
        assert not any(switch.update(signal) for signal in readings)
        assert switch.active is start_active


def test_the_switch_turns_on_at_enter_and_off_only_at_exit():
    switch = Hysteresis(enter=10, exit=4)
    states = []
    for signal in [9, 10, 7, 5, 9, 4.5, 4, 6, 9.9, 12]:
        switch.update(signal)
        states.append(switch.active)
    assert states == [False, True, True, True, True, True, False, False, False, True]
    with pytest.raises(ValueError, match="exit .* below enter"):
        Hysteresis(enter=4, exit=4)


# --- the modes -----------------------------------------------------------------------------------------------


def test_degraded_modes_cap_max_tokens_and_the_context_and_refuse_what_does_not_fit():
    changes = []
    degrader = Degrader(Hysteresis(8, 2), DegradedModes(max_tokens=64, max_model_len=256), changes.append)
    params = SamplingParams(max_tokens=500, min_tokens=100)
    assert degrader.observe(load(7)) is False and degrader.apply(100, params, load(7)) == (params, None)
    assert params.max_tokens == 500  # normal: untouched
    assert degrader.observe(load(8)) is True and changes == [True]
    capped, refusal = degrader.apply(100, params, load(8))
    assert refusal is None and (capped.max_tokens, capped.min_tokens) == (64, 64) and params.max_tokens == 500
    short, refusal = degrader.apply(230, SamplingParams(max_tokens=500), load(8))
    assert refusal is None and short.max_tokens == 26  # what the context leaves
    _, refusal = degrader.apply(256, SamplingParams(max_tokens=1), load(8, queued_prompt_tokens=300))
    assert refusal.reason == "degraded_context" and refusal.retry_after_s == pytest.approx(3.0)
    assert "256 tokens" in refusal.message
    assert degrader.observe(load(2)) is False and changes == [True, False]


def test_the_header_names_the_modes_in_use():
    assert DegradedModes(max_tokens=64).describe() == "max_tokens=64"
    both = DegradedModes(max_tokens=64, max_model_len=512, speculation=False)
    assert both.describe() == "max_tokens=64, max_model_len=512, speculation=off"


def test_degraded_settings_that_cannot_work_are_refused_with_their_names():
    assert make_degrader(ServerConfig(), print) is None  # off by default
    with pytest.raises(ValueError, match="degraded_max_tokens: set degrade_enter_requests"):
        make_degrader(ServerConfig(degraded_max_tokens=8), print)
    with pytest.raises(ValueError, match="name a degraded mode"):
        make_degrader(ServerConfig(degrade_enter_requests=8), print)
    with pytest.raises(ValueError, match=r"degrade_exit_requests \(8\) must be below"):
        make_degrader(ServerConfig(degrade_enter_requests=8, degrade_exit_requests=8, degraded_max_tokens=4), print)
    switched = []
    config = ServerConfig(degrade_enter_requests=8, degraded_no_speculation=True)
    degrader = make_degrader(config, switched.append)
    assert degrader.switch.exit == 4  # half of enter by default
    degrader.observe(load(9))
    degrader.observe(load(1))
    assert switched == [False, True]  # speculation off while degraded, on again after


# --- speculation off and on, in the engine core -----------------------------------------------------------


def test_speculation_switched_off_mid_request_stops_drafting_and_keeps_the_greedy_answer():
    llm = LLM(num_threads=1, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = "import os\nimport sys\nimport os\nimport"
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [expected] = llm.generate(prompt, params)
    engine, core = llm.engine, llm.engine.core
    engine.add_request(prompt, params)
    drafted_by_phase, tokens = [], []
    for enabled in (True, False, True):
        core.speculation_enabled = enabled
        before = core.num_draft_tokens
        for _ in range(4):
            tokens = [o.token_ids for o in engine.step() if o.finished] or tokens
        drafted_by_phase.append(core.num_draft_tokens - before)
    core.speculation_enabled = True
    while engine.has_unfinished_requests():
        tokens = [o.token_ids for o in engine.step() if o.finished] or tokens
    assert drafted_by_phase[0] > 0 and drafted_by_phase[1] == 0 and drafted_by_phase[2] > 0
    assert tokens == [expected.token_ids]


# --- a real server -----------------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
LONG = {"model": MODEL, "prompt": "import os\nimport sys\nimport os\nimport", "max_tokens": 1500,
        "ignore_eos": True, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(degrade_enter_requests=2, degrade_exit_requests=0, degraded_max_tokens=4,
                          degraded_max_model_len=64, degraded_no_speculation=True)  # fmt: skip
    running = RunningServer(config, num_kv_blocks=256, max_num_seqs=4, speculative_config=NGRAM)
    yield running
    running.stop()


def _gauge(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


def _hold(server, started: threading.Event, stop: threading.Event) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                started.set()
            if stop.is_set():
                return


def _complete(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True} | fields
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_load_turns_the_degraded_modes_on_visibly_and_back_off_when_it_falls(server):
    normal = _complete(server)
    assert normal.status_code == 200 and HEADER not in normal.headers
    assert normal.json()["usage"]["completion_tokens"] == 8 and _gauge(server, "minserve:degraded_mode") == 0

    stop, holders = threading.Event(), []
    try:
        for _ in range(2):  # two requests in the server: the enter threshold
            started = threading.Event()
            holders.append(threading.Thread(target=_hold, args=(server, started, stop), daemon=True))
            holders[-1].start()
            assert started.wait(60)
        degraded = _complete(server)
        assert degraded.status_code == 200 and degraded.headers[HEADER] == (
            "max_tokens=4, max_model_len=64, speculation=off"
        )
        assert degraded.json()["usage"]["completion_tokens"] == 4
        too_long = _complete(server, prompt=[7] * 64)
        assert too_long.status_code == 429 and too_long.json()["error"]["code"] == "degraded_context"
        assert int(too_long.headers["retry-after"]) >= 1
        assert _gauge(server, "minserve:degraded_mode") == 1
        # The core has stopped drafting for the two long requests still decoding.
        drafted = server.engine.stats().num_draft_tokens
        assert _complete(server, max_tokens=4).status_code == 200  # a few more steps, in which nobody drafts
        assert server.engine.stats().num_draft_tokens == drafted
    finally:
        stop.set()
        for holder in holders:
            holder.join(60)
    server.wait_until_idle()
    # No request and no scrape: the server's own watch sees the load fall and turns speculation back on.
    for _ in range(100):
        if server.engine.speculation_enabled:
            break
        time.sleep(0.05)
    assert server.engine.speculation_enabled

    recovered = _complete(server)  # the load has fallen to the exit threshold: back to normal
    assert recovered.status_code == 200 and HEADER not in recovered.headers
    assert recovered.json()["usage"]["completion_tokens"] == 8 and _gauge(server, "minserve:degraded_mode") == 0
    drafted = server.engine.stats().num_draft_tokens
    # Greedy, so the prompt's repeated "import" line is sure to give the n-gram proposer a match; sampled at
    # temperature 1, the tiny model can wander where no n-gram repeats for all 24 tokens.
    assert _complete(server, prompt=LONG["prompt"], max_tokens=24, temperature=0.0).status_code == 200
    assert server.engine.stats().num_draft_tokens > drafted  # speculation is back on
