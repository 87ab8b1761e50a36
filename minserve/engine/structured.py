"""Structured output: a grammar the generated text must follow, enforced token by token while decoding.

A client that asks for JSON and gets prose breaks, so asking for a format must guarantee it, not hint at it.
The request names the format (:class:`StructuredOutputs`: OpenAI's ``response_format`` json_object or
json_schema, or vLLM's structured outputs: a JSON schema, a regex, a list of choices, a Lark grammar). At
admission the grammar is compiled against the tokenizer into a *matcher*: before each token it says which
tokens of the vocabulary keep the text a prefix of something the grammar accepts (a bitmask), and after
each token it advances. The sampler sees ``-inf`` for every other token (:func:`constrain_logits`), so
greedy or sampled, penalised or biased, the text stays in the grammar; once the grammar is complete the only
token left is end-of-turn, so the request stops where the format ends.

The grammar engine is llguidance (the Rust library behind Guidance, one of vLLM's structured-output
backends). xgrammar, the other well-kept engine vLLM and SGLang use, was measured beside it on SmolLM2's
49,152-token vocabulary (a three-field JSON schema, this course's 2-core Intel Xeon, 2026-12-07): compiling
takes 1.6 ms with llguidance and 21 ms with xgrammar, a token's mask 42 µs and 3 µs, building the
tokenizer index about 1.4 s with either. Both masks cost well under 1% of a 10–50 ms CPU decode step, so
speed does not decide; weight does: llguidance is one 3 MB wheel with no dependencies that reads the
``tokenizer.json`` the engine already holds, while xgrammar needs transformers, triton and a TVM runtime,
which the engine's core install leaves out.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import torch

if TYPE_CHECKING:
    from minserve.model.tokenizer import Tokenizer

Matcher = llguidance.LLMatcher
BITS = 32  # tokens per word of llguidance's bitmask
# JSON is written in one layout, Python's ``json.dumps``': ", " and ": ", no other whitespace. A grammar that
# allows any whitespace lets a model that has lost its way emit newlines until max_tokens and never close
# the object (a failure vLLM users met with any-whitespace JSON grammars); the fixed layout bounds the
# output by the schema alone and parses the same.
FIELD = "structured_outputs"  # what an error names: the request field (response_format is read into it)
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """The requested format cannot be compiled (a malformed schema, regex or grammar): the request's fault."""


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must be: exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text) the output must validate against;
    * ``json_object``: any JSON object (OpenAI's ``{"type": "json_object"}``);
    * ``regex``: a regular expression the whole output must match;
    * ``choice``: one of these strings, exactly;
    * ``grammar``: a context-free grammar in Lark's syntax (llguidance's dialect), ``start`` its first rule.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"{FIELD}: need exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{FIELD}: choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    def llguidance_grammar(self) -> str:
        """The format as llguidance's grammar description (a JSON string); raises on a malformed schema."""
        if self.json_object:
            return Matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
        if self.json is not None:
            return Matcher.grammar_from_json_schema(self.json, overrides=JSON_LAYOUT)
        if self.regex is not None:
            return Matcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return Matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        return Matcher.grammar_from_lark(self.grammar)

    def describe(self) -> str:
        """A few words naming the format, for error messages."""
        kind = next(n for n in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, n))
        return {"json": "JSON schema", "json_object": "JSON object", "choice": "choice"}.get(kind, kind)


class GrammarCompiler:
    """Compiles formats into matchers for one tokenizer.

    The tokenizer's index (every token's bytes, which llguidance walks to build masks) takes about a second
    to build, so it is built once, on the first structured request, and never for an engine that gets none.
    ``end_token_id`` is the token that ends a reply (end of turn, else EOS): the one the mask allows once the
    grammar is complete. ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    (padded embeddings): tokens past the tokenizer's are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, end_token_id: int, vocab_size: int) -> None:
        self._tokenizer, self.end_token_id, self.vocab_size = tokenizer, end_token_id, vocab_size

    @functools.cached_property
    def _index(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self._tokenizer.tokenizer_json(), n_vocab=self.vocab_size, eos_token=self.end_token_id
        )

    def matcher(self, outputs: StructuredOutputs) -> Matcher:
        """A fresh matcher at the start of the output; :class:`StructuredOutputError` says what is malformed."""
        try:
            grammar = outputs.llguidance_grammar()
        except Exception as error:  # llguidance raises ValueError or RuntimeError, by what is wrong
            raise StructuredOutputError(f"{FIELD}: invalid {outputs.describe()}: {_summary(str(error))}") from None
        problem = Matcher.validate_grammar(grammar, self._index)
        if problem:
            raise StructuredOutputError(f"{FIELD}: invalid {outputs.describe()}: {_summary(problem)}")
        return Matcher(self._index, grammar)


def _summary(message: str) -> str:
    """llguidance's message without its caret diagram: the first line, and the line that names the error."""
    lines = [line.strip() for line in message.strip().splitlines()]
    return " ".join(lines[:1] + [line for line in lines[1:] if line.startswith("error:")])


def constrain_logits(logits: torch.Tensor, matchers: list[Matcher | None]) -> torch.Tensor:
    """``logits`` (``[rows, vocab]``) with ``-inf`` wherever a row's matcher forbids the token; rows
    without a matcher unchanged. Returns ``logits`` itself when no row has one (nothing copied)."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    words = torch.zeros(len(rows), -(-vocab // BITS), dtype=torch.int32)
    for i, row in enumerate(rows):
        matcher = matchers[row]
        assert matcher is not None
        matcher.unsafe_compute_mask_ptr(words[i].data_ptr(), words.shape[1] * 4)
        if matcher.is_error():
            raise RuntimeError(f"the grammar matcher failed: {matcher.get_error()}")
    allowed = allowed_tokens(words, vocab).to(logits.device)
    constrained = logits.clone()
    constrained[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return constrained


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask (``[rows, ⌈vocab / 32⌉]`` int32, token t at bit t mod 32 of word t // 32) as booleans
    ``[rows, vocab_size]``."""
    shifts = torch.arange(BITS, dtype=torch.int32)
    bits = (words[:, :, None] >> shifts) & 1  # an arithmetic shift: bit 31's sign copies are masked off by & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def advance(matcher: Matcher, token: int) -> None:
    """Move ``matcher`` past a token the sampler chose; a token it forbids is a bug, reported as such."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"token {token} is outside the requested format: {matcher.get_error() or 'refused'}")
