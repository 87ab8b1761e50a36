"""Structured output's grammar layer, without a model: formats compile or fail with a message, and any walk
through the masked vocabulary (random logits, sampled) ends in text the format accepts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve.engine.sampling_params import SamplingParams
from minserve.engine.structured import (
    GrammarCompiler,
    StructuredOutputError,
    StructuredOutputs,
    advance,
    allowed_tokens,
    constrain_logits,
)
from minserve.model.loader import resolve_model_path
from minserve.model.tokenizer import Tokenizer

END = 0  # the embedded model's end-of-sequence token
VOCAB = 2048  # the embedded model's tokenizer
PADDED_VOCAB = VOCAB + 8  # a few logits past the tokenizer's, as a padded embedding has


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = Tokenizer(resolve_model_path("minserve-tiny"))
    assert tokenizer.eos_token_id == END and tokenizer.vocab_size == VOCAB
    return GrammarCompiler(tokenizer, END, PADDED_VOCAB)


def walk(compiler: GrammarCompiler, outputs: StructuredOutputs, seed: int, max_tokens: int = 200) -> str | None:
    """Sample from random logits under the format's mask until the end token; the text, or None if the walk
    ran out of tokens first. Random logits are the worst model: it never wants what the format wants."""
    matcher = compiler.matcher(outputs)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = constrain_logits(torch.randn(1, PADDED_VOCAB, generator=generator), [matcher])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        if token == END:
            return compiler._tokenizer.decode(tokens)
        advance(matcher, token)
        tokens.append(token)
    return None


def test_a_format_is_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputs(choice=())


@pytest.mark.parametrize(
    ("outputs", "named"),
    [
        (StructuredOutputs(regex="(unclosed"), "invalid regex"),
        (StructuredOutputs(json={"type": "frobnicate"}), "invalid JSON schema"),
        (StructuredOutputs(json="{not json"), "invalid JSON schema"),
        (StructuredOutputs(grammar="start: missing_rule"), "invalid grammar"),
    ],
)
def test_a_malformed_format_is_the_requests_error(compiler, outputs, named):
    with pytest.raises(StructuredOutputError, match=named):
        compiler.matcher(outputs)


def test_the_mask_unpacks_bit_by_bit():
    words = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0 and 2; token 63 (the sign bit)
    allowed = allowed_tokens(words, 64)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 2, 63]


def test_rows_without_a_format_are_untouched(compiler):
    logits = torch.randn(3, PADDED_VOCAB)
    constrained = constrain_logits(logits, [None, compiler.matcher(StructuredOutputs(choice=("yes", "no"))), None])
    assert torch.equal(constrained[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(constrained[1]).nonzero().flatten().tolist()
    assert allowed and END not in allowed and all(t < VOCAB for t in allowed)  # nothing past the tokenizer
    assert constrain_logits(logits, [None, None, None]) is logits


def test_a_complete_format_leaves_only_the_end_token(compiler):
    matcher = compiler.matcher(StructuredOutputs(choice=("yes", "no")))
    for token in compiler._tokenizer.encode("yes", add_special_tokens=False):
        advance(matcher, token)
    logits = constrain_logits(torch.zeros(1, PADDED_VOCAB), [matcher])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [END]
    with pytest.raises(RuntimeError, match="outside the requested format"):
        advance(matcher, compiler._tokenizer.encode("!", add_special_tokens=False)[0])


SCHEMAS = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(
            st.from_regex(r"[a-z]{1,6}", fullmatch=True),
            st.sampled_from(
                [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "boolean"},
                    {"type": "string", "maxLength": 8},
                    {"enum": ["red", "green", "blue"]},
                    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 3},
                ]
            ),
            min_size=1,
            max_size=3,
        ),
    }
).map(lambda s: {**s, "required": sorted(s["properties"]), "additionalProperties": False})


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_every_walk_through_a_schema_validates(compiler, schema, seed):
    text = walk(compiler, StructuredOutputs(json=schema), seed)
    if text is not None:  # a random walk may wander (whitespace) past the budget; a finished one must validate
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16))
def test_every_walk_through_a_regex_matches(compiler, seed):
    pattern = r"[A-Z][a-z]{2,5} (is|was) [0-9]{1,3}"
    text = walk(compiler, StructuredOutputs(regex=pattern), seed)
    assert text is not None and re.fullmatch(pattern, text)


# --- in the engine -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from minserve import LLM

    return LLM(enable_tracing=False)


def _params(outputs: StructuredOutputs, **options) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "structured_outputs": outputs, **options})


def test_the_engine_keeps_greedy_and_sampled_rows_in_their_formats(tiny):
    number, choice = StructuredOutputs(regex=r"-?[0-9]{1,4}"), StructuredOutputs(choice=("alpha", "beta", "gamma"))
    outs = tiny.generate(
        ["x = ", "def f():", "x = ", "import os"],
        [_params(number), _params(choice), _params(number, temperature=1.0, seed=3), SamplingParams(max_tokens=5)],
    )
    assert re.fullmatch(r"-?[0-9]{1,4}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in ("alpha", "beta", "gamma") and outs[1].finish_reason == "stop"
    assert re.fullmatch(r"-?[0-9]{1,4}", outs[2].text)
    assert len(outs[3].token_ids) == 5  # a row without a format beside them, untouched


def test_a_bad_format_is_refused_before_anything_runs(tiny):
    with pytest.raises(ValueError, match="invalid regex"):
        tiny.generate(["a", "b"], [SamplingParams(max_tokens=2), _params(StructuredOutputs(regex="(unclosed"))])
    assert tiny.stats()["num_running"] == tiny.stats()["num_waiting"] == 0
    with pytest.raises(ValueError, match="ignore_eos"):
        _params(StructuredOutputs(json_object=True), ignore_eos=True)


def test_speculation_leaves_a_formatted_request_exact():
    from minserve import LLM

    spec = LLM(enable_tracing=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    plain = LLM(enable_tracing=False)
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = [1, 2, 3]\nx = ["]
    params = [_params(StructuredOutputs(regex=r"[a-z ():+\n]{1,40}")), SamplingParams(max_tokens=16, temperature=0)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    assert spec.engine.core.num_draft_tokens > 0  # the plain row beside it was still speculated
