"""The HTTP server, driven as users drive it: the official openai client, raw HTTP, bad input, disconnects."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.config import ServerConfig
from tests.servers import MODEL, RunningServer


@pytest.fixture(scope="module")
def server():
    running = RunningServer(ServerConfig(max_body_bytes=64 * 1024))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _kv_blocks_used(server) -> int:
    return server.engine.stats().kv_blocks_used


def test_openai_client_completion(client):
    out = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 0
    assert isinstance(out.choices[0].text, str)


def test_openai_client_streams_completion_with_usage(client):
    stream = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 16
    full = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == full.choices[0].text


def test_openai_client_chat_streaming_and_not(client):
    messages = [{"role": "user", "content": "Write a function."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert out.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, temperature=0)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content
    assert client.models.list().data[0].id == MODEL


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1] * 5000}, 400, "prompt"),
        ({"model": MODEL, "prompt": [99999]}, 400, "prompt"),
        ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "n": 3}, 400, "n"),
    ],
)
def test_bad_requests_get_an_openai_error_naming_the_field(server, body, status, param):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # and the server goes on


def test_malformed_json_and_oversized_bodies(server):
    bad = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    huge = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 100_000})
    assert huge.status_code == 413


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    body = {"model": MODEL, "prompt": "class Parser:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
        assert received and _kv_blocks_used(server) > 0
    server.wait_until_idle()  # the engine notices at its next step
    assert _kv_blocks_used(server) == 0 and server.engine.num_in_flight == 0


def test_metrics_use_vllm_names_and_count_requests(server, client):
    client.completions.create(model=MODEL, prompt="x = ", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "minserve:num_requests_running",
        "minserve:num_requests_waiting",
        "minserve:kv_cache_usage_perc",
        "minserve:time_to_first_token_seconds_bucket",
        "minserve:inter_token_latency_seconds_bucket",
        "minserve:e2e_request_latency_seconds_count",
        "minserve:request_queue_time_seconds_count",
        "minserve:prefix_cache_hits_total",
    ):
        assert name in text, name
    finished = [line for line in text.splitlines() if line.startswith("minserve:request_success_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in finished) >= 1


def test_full_queue_answers_429_with_retry_after_at_once():
    running = RunningServer(ServerConfig(max_waiting_requests=0, retry_after_s=2), num_kv_blocks=64)
    try:
        response = httpx.post(running.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
        assert response.status_code == 429 and response.headers["retry-after"] == "2"
        assert response.json()["error"]["code"] == "queue_full"
        # Refused before the prompt is tokenized or checked: a full queue costs the server no tokenizer work.
        processed = []
        process = running.engine.inputs.process
        running.engine.inputs.process = lambda *args: processed.append(args) or process(*args)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}]}
        response = httpx.post(running.url + "/v1/chat/completions", json=chat, timeout=30)
        assert response.status_code == 429 and processed == []
    finally:
        running.stop()


def test_api_key_is_required_everywhere_but_health():
    running = RunningServer(ServerConfig(api_key="s3cret"), num_kv_blocks=64)
    try:
        assert httpx.get(running.url + "/health").status_code == 200
        assert httpx.get(running.url + "/v1/models").status_code == 401
        ok = httpx.get(running.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    finally:
        running.stop()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False, width=32) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other"]) | json_values,
        "prompt": st.text(max_size=30) | st.lists(st.integers(-3, 3000), max_size=5) | json_values,
        "max_tokens": st.integers(-2, 6) | json_values,
        "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
        "top_p": st.floats(-1, 2, allow_nan=False) | json_values,
        "top_k": st.integers(-3, 50) | json_values,
        "stop": st.lists(st.text(max_size=3), max_size=5) | json_values,
        "seed": st.integers(-5, 5) | json_values,
        "stream": st.booleans() | json_values,
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": json_values})),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=fields, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_requests_never_get_a_500(server, body, route):
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 6:
        body["max_tokens"] = 6  # keep the run short; the schema is what is under test
    response = httpx.post(server.url + route, content=json.dumps(body), timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


def test_graceful_shutdown_drains_a_running_request():
    running = RunningServer(ServerConfig(), num_kv_blocks=64)
    result = {}

    def call():
        body = {"model": MODEL, "prompt": "def drain():", "max_tokens": 80, "ignore_eos": True}
        result["response"] = httpx.post(running.url + "/v1/completions", json=body, timeout=60)

    caller = threading.Thread(target=call)
    caller.start()
    for _ in range(200):  # wait until the request is inside the engine
        if running.engine.num_in_flight:
            break
        time.sleep(0.01)
    running.stop()  # like SIGTERM: stop accepting, finish what runs
    caller.join(60)
    response = result["response"]
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 80


def test_a_request_past_its_timeout_is_cancelled_and_frees_its_blocks():
    running = RunningServer(ServerConfig(request_timeout_s=0.3), num_kv_blocks=64)
    try:
        body = {"model": MODEL, "prompt": "def slow():", "max_tokens": 900, "ignore_eos": True}
        plain = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
        assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
        streamed = httpx.post(running.url + "/v1/completions", json=body | {"stream": True}, timeout=60)
        events = [line for line in streamed.text.splitlines() if line.startswith("data:")]
        assert '"timeout"' in events[-1] and "[DONE]" not in events[-1]
        running.wait_until_idle()
        assert running.engine.stats().kv_blocks_used == 0
        reasons = httpx.get(running.url + "/metrics").text
        assert 'minserve:request_success_total{finished_reason="abort"} 2.0' in reasons
    finally:
        running.stop()


def test_refusals_are_counted_by_reason(server):
    before = httpx.get(server.url + "/metrics").text
    httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 9})
    after = httpx.get(server.url + "/metrics").text

    def count(text: str, reason: str) -> float:
        prefix = f'minserve:requests_rejected_total{{reason="{reason}"}} '
        return sum(float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix))

    assert count(after, "model_not_found") == count(before, "model_not_found") + 1
    assert count(after, "invalid") == count(before, "invalid") + 1


def test_priority_reaches_the_engine(server):
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 2, "priority": 3}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    bad = httpx.post(server.url + "/v1/completions", json=body | {"priority": "high"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


@pytest.mark.slow
def test_the_openai_client_chats_with_smollm2_through_minserve_serve():
    """A real chat model behind the real server: SmolLM2-135M-Instruct from its GGUF file, in its own process."""
    from openai import OpenAI

    from minserve.serve.launch import ServerProcess

    name = "smollm2-135m-instruct"
    # Eager: the compile a server of 4-bit codes does by default costs minutes cold, more than this test's
    # share of the suite; tests/test_compile.py checks compiled steps give eager steps' tokens.
    with ServerProcess(["--no-compile"], model=name, startup_timeout_s=300) as running:
        client = OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ask = {"model": name, "messages": messages, "temperature": 0, "max_tokens": 32}
        out = client.chat.completions.create(**ask)
        answer = out.choices[0].message.content
        assert "Paris" in answer
        assert out.choices[0].finish_reason == "stop"  # on the template's end of turn, before max_tokens
        chunks = client.chat.completions.create(**ask, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
