"""Schemathesis, a property-based API tester, against the live server's own ``/openapi.json``.

It generates requests from the schema, valid and invalid, for every route, and checks each answer: never a
5xx, a status code and content type the schema documents, a body that matches the documented shape. The
model is fixed so generated requests reach the engine, and lengths are kept small so the run is bounded;
afterwards the server must be healthy and serve a request.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from minserve.config import ServerConfig
from tests.servers import MODEL, RunningServer

MAX_TOKENS = 4  # generated requests ask for few tokens: the schema, not the model, is under test
VALID, INVALID = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# Each route with valid requests; the routes that take a body with invalid ones too (a GET without
# parameters has no invalid request to make).
RUNS = [
    ("GET", "/health", VALID),
    ("GET", "/v1/models", VALID),
    ("GET", "/metrics", VALID),
    ("POST", "/v1/completions", VALID),
    ("POST", "/v1/completions", INVALID),
    ("POST", "/v1/chat/completions", VALID),
    ("POST", "/v1/chat/completions", INVALID),
]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def live_server():
    config = ServerConfig(max_body_bytes=64 * 1024, default_max_tokens=MAX_TOKENS, request_timeout_s=30)
    running = RunningServer(config, num_kv_blocks=128, max_model_len=256)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def api_schema(live_server):
    return schemathesis.openapi.from_url(live_server.url + "/openapi.json")


@schemathesis.hook
def map_body(context, body):
    """Aim generated bodies at the served model, and keep each one short to run."""
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = MODEL
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and not isinstance(body[field], bool) and body[field] > MAX_TOKENS:
                body[field] = MAX_TOKENS
        timeout = body.get("timeout")  # a valid timeout of 5e-324 s is a 504 by design: give it time
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
            body["timeout"] = 30
    return body


# Schemathesis' own pytest plugin does not run under pytest 9 yet, so each operation's strategy is driven
# with hypothesis directly: valid requests (POSITIVE) and requests that break the schema (NEGATIVE).
@pytest.mark.parametrize(("method", "path", "mode"), RUNS, ids=[f"{m} {p} {g.value}" for m, p, g in RUNS])
def test_generated_requests_get_documented_answers_and_never_a_5xx(api_schema, live_server, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    def run(case):
        case.call_and_validate(base_url=live_server.url, timeout=60, checks=CHECKS)

    run()


def test_the_server_is_healthy_and_serving_after_the_fuzz(live_server):
    assert httpx.get(live_server.url + "/health").json()["status"] == "ok"
    finished = [
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(live_server.url + "/metrics").text.splitlines()
        if line.startswith("minserve:request_success_total{")
    ]
    assert sum(finished) >= 10, "generated requests must reach the engine, not only its validation"
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 2}
    assert httpx.post(live_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    live_server.wait_until_idle()
    assert live_server.engine.stats().kv_blocks_used == 0
