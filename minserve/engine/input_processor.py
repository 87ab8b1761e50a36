"""Admission checks: a request's prompt as token ids, refused early if it could never run.

The offline engine and the server's front end both use this, so a request is judged the same way wherever it
enters. It needs only the tokenizer and three numbers, never the model, so a process that does not hold the
model (the HTTP server, when the engine core runs in a process of its own) can check requests itself.

Tokenizing is the one check that costs: a 4 MB prompt takes seconds. A prompt so long that it cannot fit
the context whatever its tokens are is refused before it is tokenized. No token of this vocabulary covers
more characters than its longest entry spells (a byte-level token of n bytes covers at most n characters),
so a text of more than ``max_model_len × longest × SLACK`` characters surely has more tokens than the
context holds; ``SLACK`` leaves room for normalizers that shorten text before it is split.
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.engine.sampling_params import SamplingParams
from minserve.engine.structured import GrammarCompiler, Matcher, StructuredOutputError
from minserve.model.tokenizer import Tokenizer

Prompt = str | list[int]
SLACK = 4  # how much shorter a normalizer could make a text before it is split into tokens, at most
MIN_CHARS_PER_TOKEN = 16  # a floor on a token's reach, whatever the vocabulary's longest entry


@dataclass(frozen=True)
class EngineInput:
    """A request as :meth:`InputProcessor.process` passed it: the prompt as sent (text or token ids), its
    token ids and its params. Lowering ``max_tokens`` keeps it valid (``dataclasses.replace`` with params'
    :meth:`~minserve.engine.sampling_params.SamplingParams.with_max_tokens`); nothing else should change it."""

    prompt: Prompt
    prompt_token_ids: list[int]
    params: SamplingParams

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputProcessor:
    """Tokenizes and checks prompts against the context length and the KV cache's size (both in tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, kv_capacity_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        longest = max((len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)), default=0)
        self.max_prompt_chars = max_model_len * max(longest, MIN_CHARS_PER_TOKEN) * SLACK
        end_token_id = tokenizer.end_of_turn_token_id or tokenizer.eos_token_id
        self.grammars = None if end_token_id is None else GrammarCompiler(tokenizer, end_token_id, vocab_size)

    def encode(self, prompt: Prompt, index: int | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of a prompt, checked. ``index`` only makes the error message point at the prompt.

        ``parse_special=False`` for text a client sent: control-token text in it stays text (a client who
        means control tokens sends token ids). Offline, a prompt is the programmer's own, often a rendered
        chat template, and its control tokens are parsed."""
        where = "prompt" if index is None else f"prompt {index}"
        if isinstance(prompt, str):
            self._check_text(prompt, where)
            ids = self.tokenizer.encode(prompt, parse_special=parse_special)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"{where}: token ids must be integers in [0, {self.vocab_size})")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        return ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """A chat's prompt text and token ids, checked: the template's markers are control tokens, what the
        messages say is plain text (:meth:`~minserve.model.tokenizer.Tokenizer.encode_chat`); ``tools`` go to a
        template that takes them, and are refused by one that does not."""
        for i, message in enumerate(messages):
            self._check_text(str(message.get("content") or ""), f"messages.{i}.content")
        text, ids = self.tokenizer.encode_chat(messages, tools=tools)
        self._check_text(text, "messages")
        return text, ids

    def _check_text(self, text: str, where: str) -> None:
        problem = unicode_problem(text)
        if problem:
            raise ValueError(f"{where}: {problem}; send valid Unicode text")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{where}: {len(text)} characters cannot fit the context of {self.max_model_len} tokens "
                f"(refused without tokenizing); shorten the prompt"
            )

    def process(
        self,
        prompt: Prompt,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        index: int | None = None,
    ) -> EngineInput:
        """The one way in for a request: its prompt tokenized (unless ``prompt_token_ids`` are given, already
        checked by :meth:`encode` or :meth:`encode_chat`) and the whole request checked (:meth:`check_fits`).
        A bad request raises ``ValueError`` naming what to change (``index``: which of a batch of prompts)."""
        ids = self.encode(prompt, index) if prompt_token_ids is None else prompt_token_ids
        self.check_fits(ids, params)
        return EngineInput(prompt, ids, params)

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that could never run as asked: too long for the context, a prompt plus
        ``max_tokens`` beyond the context (as vLLM's server does: a caller is never surprised by a shorter
        answer than it asked for), more than the whole KV cache, or a ``logit_bias`` for a token the
        vocabulary lacks, or a structured-output format that does not compile. The offline API and the
        server both refuse by this one rule."""
        params.check_token_ids(self.vocab_size)
        self.grammar(params)
        n = len(prompt_token_ids)
        check_fits(n, params.max_tokens, self.max_model_len, self.kv_capacity_tokens)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: the context holds {self.max_model_len} tokens and the prompt takes {n}, so "
                f"max_tokens can be at most {self.max_model_len - n}; you asked for {params.max_tokens}"
            )

    def grammar(self, params: SamplingParams) -> Matcher | None:
        """A fresh matcher for the request's structured-output format (None without one); a format that does
        not compile is a :class:`~minserve.engine.structured.StructuredOutputError` (a ``ValueError``)."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise StructuredOutputError("structured_outputs: this model's tokenizer names no end token to stop on")
        return self.grammars.matcher(params.structured_outputs)


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int | None, kv_capacity_tokens: int) -> None:
    """The rule the engine core, the simulator and the server's front end all refuse by: a prompt that leaves
    no room to generate within the context (``None``: no limit), or a request bigger than the whole KV cache
    (``min(prompt + max_tokens, context)`` tokens, since a request stops at the end of the context)."""
    n = num_prompt_tokens
    if max_model_len is not None and n >= max_model_len:
        raise ValueError(
            f"prompt: {n} tokens leave no room to generate within the context (max_model_len) of {max_model_len} "
            "tokens; shorten the prompt"
        )
    needed = n + max_tokens if max_model_len is None else min(n + max_tokens, max_model_len)
    if needed > kv_capacity_tokens:
        raise ValueError(
            f"max_tokens: prompt ({n}) + max_tokens ({max_tokens}) = {needed} tokens is more than the whole KV "
            f"cache holds ({kv_capacity_tokens} tokens); lower max_tokens or give the cache more memory"
        )


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is no text the tokenizer can take, or None: it must encode as UTF-8, and a lone
    surrogate (``"\\ud800"`` in JSON, which Python's JSON parser lets through) does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"holds a lone surrogate (U+{ord(text[error.start]):04X} at character {error.start}), not text"
    return None
