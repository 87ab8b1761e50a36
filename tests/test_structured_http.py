"""Structured output over HTTP, through the official openai client: a JSON schema's reply validates, every
format kind is served, a malformed one is a 400 naming the field, and no field is accepted and ignored.
(SmolLM2 answering the capital of France as JSON was checked by hand: ``{"city": "Paris", …}``.)"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.servers import MODEL, RunningServer

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["France", "Germany", "Italy"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    """The embedded model: the grammar, not the model, makes the reply parse, so the smallest model shows it."""
    server = RunningServer(enable_tracing=False)
    yield server
    server.stop()


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_a_json_schema_reply_validates(server):
    reply = _client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY, "strict": True}},
        max_completion_tokens=60,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


def test_json_object_regex_and_choice_are_served(server):
    client = _client(server)
    ask = [{"role": "user", "content": "Describe Paris."}]
    as_json = client.chat.completions.create(
        model=MODEL, messages=ask, response_format={"type": "json_object"}, max_completion_tokens=80, temperature=0
    )
    if as_json.choices[0].finish_reason == "stop":  # an object the model never closes runs to the token limit
        assert isinstance(json.loads(as_json.choices[0].message.content), dict)
    else:
        assert as_json.choices[0].message.content.startswith("{")
    year = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "In which year did the Bastille fall?"}],
        extra_body={"structured_outputs": {"regex": r"1[0-9]{3}"}}, max_completion_tokens=8, temperature=0,
    )  # fmt: skip
    assert re.fullmatch(r"1[0-9]{3}", year.choices[0].message.content)
    verdict = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", extra_body={"structured_outputs": {"choice": [" yes", " no"]}},
        max_tokens=4, temperature=0,
    )  # fmt: skip
    assert verdict.choices[0].text in (" yes", " no")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "structured_outputs", "invalid JSON schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None, "send one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "no place for tools"),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"parallel_tool_calls": True}, "parallel_tool_calls", "Extra inputs"),
        ({"user": "u-1"}, "user", "Extra inputs"),
        ({"modalities": ["audio"]}, "modalities", "Extra inputs"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_it(server, body, param, says):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param is None or error["param"] == param, error
    assert says is None or says in error["message"], error


def test_every_published_field_reaches_the_engine(server):
    """Each field of the published chat request either changes what the engine is asked (sent alone, its
    SamplingParams or prompt differ from the defaults') or is one of the few that shape the reply itself."""
    from minserve.serve.protocol import ChatCompletionRequest

    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["components"]["schemas"]
    published = set(schema["ChatCompletionRequest"]["properties"])
    shapes_the_reply = {"model", "messages", "stream", "stream_options", "priority", "timeout", "tools", "tool_choice"}
    samples = {
        "temperature": 0.5, "top_p": 0.5, "top_k": 5, "seed": 7, "stop": ["x"], "ignore_eos": True, "min_tokens": 2,
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1,
        "logit_bias": {"5": 1.0}, "n": 1, "best_of": 1, "max_tokens": 3, "max_completion_tokens": 3,
        "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "a+"},
    }  # fmt: skip
    assert published - shapes_the_reply == set(samples), "a published field has no sample here: add one"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    default = ChatCompletionRequest(**base).sampling_params(16, None)
    for name, value in samples.items():
        extra = {"logprobs": True} if name == "top_logprobs" else {}
        if name == "ignore_eos":
            extra = {}
        body = ChatCompletionRequest(**base, **extra, **{name: value})
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(body.max_completion_tokens or body.max_tokens or 16, top)
        if name in ("n", "best_of"):
            continue  # 1 is the only value served; above 1 is a 400 (tests/test_api.py)
        assert params != default, f"{name} changed nothing the engine is asked"
