"""The OpenAI request bodies minserve accepts, as pydantic models, and the error body it answers with.

Field checks live here, so a bad request is answered 400 with the field named before it reaches the
engine. minserve extensions to the OpenAI schema (``top_k``, ``ignore_eos``) are marked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from minserve.engine.outputs import RequestOutput

NonNegativeFloat = Annotated[float, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields minserve does not use

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: NonNegativeFloat = 1.0
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)  # minserve extension, as in vLLM
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # minserve extension, as in vLLM
    priority: int = 0  # minserve extension, as in vLLM: lower runs first under --scheduling-policy priority
    n: int = Field(default=1, ge=1, le=1)  # one choice per request

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("one prompt per request; send a batch as separate requests")
            return prompt[0]
        return prompt


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error_body(message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(output: RequestOutput) -> str | None:
    """The engine's finish reason as OpenAI and vLLM name it: ``stop``, ``length``, ``abort`` (or ``error``)."""
    if output.finish_reason is None:
        return None
    return {"cancelled": "abort"}.get(output.finish_reason, output.finish_reason)
