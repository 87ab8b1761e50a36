"""The OpenAI request and response bodies minserve speaks, as pydantic models, and its error body.

Field checks live here, so a bad request is answered 400 with the field named before it reaches the
engine, and the OpenAPI schema at ``/openapi.json`` states every rule the server enforces. Types are strict:
``"16"`` is not a number, ``"yes"`` is not a boolean, ``true`` is not a token id, and ``NaN`` or ``Infinity``
(which Python's JSON parser accepts) are no numbers at all. An integer is what JSON Schema calls one, so a
whole float (``1.0``) is an integer, and ``1.5`` is not. Text must be valid Unicode: a lone surrogate
(``"\\ud800"`` in JSON) cannot be encoded, so it is refused rather than left to break the tokenizer.
minserve extensions to the OpenAI schema (``top_k``, ``ignore_eos``, ``priority``, ``timeout``) are marked, and
so are vLLM's (``repetition_penalty``, ``min_p``). Every sampling field is honoured (:meth:`SamplingFields.
sampling_params` hands each to the engine, which checks it by the same rule as offline); ``n`` and ``best_of``
above 1 are refused with a 400 that says so, never ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from minserve.engine.input_processor import unicode_problem
from minserve.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
    MIN_TIMEOUT_S,
    ONE_CHOICE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from minserve.engine.structured import StructuredOutputs
from minserve.serve.formats import ResponseFormat, StructuredOutputsField, requested_format

if TYPE_CHECKING:
    from minserve.engine.outputs import RequestOutput

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit on `logprobs`
# A field the server does not know is refused (400, naming it), never accepted and ignored: a client that asked
# for something and did not get it must be told.
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


def _valid_unicode(text: str) -> str:
    problem = unicode_problem(text)
    if problem:
        raise ValueError(problem)
    return text


def _whole(value: object) -> object:
    """A whole float as the integer it is (JSON Schema's ``integer`` includes ``1.0``); anything else as it came,
    for the strict check to judge."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_whole)]
Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[Int, Field(ge=0)]
Seed = Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # JSON object keys are strings: "50256"
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = STRICT

    model: str
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: Int = Field(default=0, ge=-1, description="minserve extension, as in vLLM: 0 or -1 is off")
    seed: Seed | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        default=None, description=f"at most {MAX_STOP_STRINGS} non-empty strings"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, description="minserve extension, as in vLLM")
    min_tokens: Int = Field(
        default=0, ge=0, description="vLLM extension: no end token or stop string ends the reply before this many"
    )
    priority: Int = Field(default=0, description="minserve extension, as in vLLM: lower runs first")
    timeout: float | None = Field(
        default=None, ge=MIN_TIMEOUT_S, description=f"minserve extension: seconds (at least {MIN_TIMEOUT_S:g}) "
        "after arrival past which the request is stopped (504); a longer one than the server's request timeout "
        "is capped at it; also the header X-Request-Timeout"
    )  # fmt: skip
    presence_penalty: Penalty = Field(default=0.0, description="subtracted from a token's logit if it was generated")
    frequency_penalty: Penalty = Field(default=0.0, description="subtracted once per time a token was generated")
    repetition_penalty: float = Field(
        default=1.0,
        gt=0,
        description="vLLM extension: 1 is off; above 1, tokens of the prompt or output are less likely",
    )
    min_p: float = Field(default=0.0, ge=0, le=1, description="vLLM extension: drop tokens below min_p × the top one")
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        default=None, description="token id (as a string) → added to its logit; ids must be in the vocabulary"
    )
    # The engine refuses n, best_of > 1 with its own words (a 400 naming the field); the schema still says so.
    n: Int = Field(default=1, ge=1, json_schema_extra={"maximum": 1}, description=f"only 1: {ONE_CHOICE}")
    best_of: Int | None = Field(default=None, ge=1, json_schema_extra={"maximum": 1}, description="only 1 (or null)")
    structured_outputs: StructuredOutputsField | None = Field(
        default=None, description="vLLM extension: one of json, json_object, regex, choice, grammar (Lark)"
    )

    def output_format(self) -> StructuredOutputs | None:
        """The format the reply must follow, if the request asks for one."""
        return requested_format(self.structured_outputs)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
        """The engine's settings for this request, every sampling field included; ``top_logprobs`` None asks
        for no logprobs. A value the engine refuses raises its ``ValueError``, which names the field."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop_strings,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias={int(token): bias for token, bias in self.logit_bias.items()} if self.logit_bias else None,
            n=self.n,
            best_of=self.best_of,
            structured_outputs=self.output_format(),
        )


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyText
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)]
    ) = Field(description="a non-empty string, a non-empty list of token ids, or a list of one string")
    max_tokens: Int | None = Field(default=16, ge=1, description="at most the context left after the prompt")
    logprobs: Int | None = Field(
        default=None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="chosen tokens' logprobs, and this many more"
    )
    echo: bool = Field(default=False, description="not supported: true is refused")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            return prompt[0]
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported: minserve returns the completion only")
        return echo


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(default=None, ge=1, description="deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: Int | None = Field(
        default=None, ge=1, description="default: the server's --default-max-tokens, or the context left"
    )
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs: true")
    response_format: ResponseFormat | None = Field(default=None, description="text, json_object or json_schema")
    tools: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = Field(
        default=None, description="rendered by the model's chat template where it takes tools; else a 400"
    )
    tool_choice: Literal["none", "auto"] | None = Field(
        default=None, description="none or auto; a forced call (required, a named function) is not supported"
    )

    def output_format(self) -> StructuredOutputs | None:
        return requested_format(self.structured_outputs, self.response_format)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is given: none when the request says ``tool_choice: none``."""
        return None if self.tool_choice == "none" else self.tools


# --- responses (documented in the OpenAPI schema; the handlers build them as plain dicts) -----------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort", "deadline", "error"] | None


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


def error_body(message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(output: RequestOutput) -> str | None:
    """The engine's finish reason as OpenAI and vLLM name it: ``stop``, ``length``, ``abort`` (or ``error``).

    A request stopped at its deadline (the server's timeout) was aborted by the server: ``abort``, as a
    cancelled one."""
    if output.finish_reason is None:
        return None
    return {"cancelled": "abort", "deadline": "abort"}.get(output.finish_reason, output.finish_reason)
