"""The request fields that ask for an output format, in the shapes clients send them.

* OpenAI's chat ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": true}}``.
* vLLM's ``structured_outputs`` (completions and chat): exactly one of ``json`` (a schema), ``json_object``,
  ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark).

Each becomes the engine's :class:`~minserve.engine.structured.StructuredOutputs`; the engine's input
processor compiles it and refuses one that does not compile, so a malformed schema is a 400 that names it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minserve.engine.structured import StructuredOutputs

FIELDS = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``json_schema`` object. ``strict`` is accepted either way: the schema is always enforced."""

    model_config = FIELDS
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON schema the reply must validate against")
    strict: bool | None = Field(default=None, description="always enforced, whatever this says")


class ResponseFormat(BaseModel):
    model_config = FIELDS
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description="required with type json_schema")

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def structured_outputs(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputs(json=self.json_schema.json_schema)
        return None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one kind of format."""

    model_config = FIELDS
    json_format: dict[str, Any] | str | None = Field(default=None, alias="json", description="a JSON schema")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, description="a Lark grammar (llguidance's dialect)")

    def structured_outputs(self) -> StructuredOutputs:
        """The engine's format; ``ValueError`` (a 400) unless exactly one kind is given."""
        return StructuredOutputs(
            json=self.json_format,
            json_object=self.json_object,
            regex=self.regex,
            choice=None if self.choice is None else tuple(self.choice),
            grammar=self.grammar,
        )


def requested_format(
    structured: StructuredOutputsField | None, response_format: ResponseFormat | None = None
) -> StructuredOutputs | None:
    """The one format a request asks for, from whichever field asked; both at once is refused."""
    from_response = response_format.structured_outputs() if response_format is not None else None
    if structured is not None and from_response is not None:
        raise ValueError("response_format and structured_outputs both ask for a format: send one")
    return structured.structured_outputs() if structured is not None else from_response
