"""The request fields that ask for structured outputs, OpenAI's and vLLM's, turned into one spec.

- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
  {"name", "schema", "description", "strict"}}, on chat and (as vLLM takes it) on completions.
- vLLM: `structured_outputs` {"json" | "json_object" | "regex" | "choice" | "grammar"}, and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A request names at most one of them (two are a 400 naming both: which one should win is not ours to
guess). Whether the spec compiles is the engine's to say (`GrammarVocabulary`), before anything is
queued; here are the shapes and `StructuredOutputsParams`' bounds, each refusal naming its field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from target_service.serving.api_errors import ApiError
from target_service.structured.params import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputsParams

MAX_CHOICE_CHARS = 200  # each choice; MAX_CHOICES of them stay within MAX_SPEC_CHARS written out


class StrictPart(BaseModel):
    """A part of a request, as strict as the request: unknown keys and coerced types (0 for false)
    refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(StrictPart):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", max_length=64)  # OpenAI requires it; nothing here reads it
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema here, strict or not


class TextFormat(StrictPart):
    type: Literal["text"]


class JsonObjectFormat(StrictPart):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(StrictPart):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


SpecText = Annotated[str, Field(max_length=MAX_SPEC_CHARS)]
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]


class _OneSpec(StrictPart):
    model_config = ConfigDict(populate_by_name=True)


class JsonSpec(_OneSpec):
    json_schema: dict[str, Any] = Field(alias="json")


class JsonObjectSpec(_OneSpec):
    json_object: Literal[True]


class RegexSpec(_OneSpec):
    regex: SpecText


class ChoiceSpec(_OneSpec):
    choice: Choices


class GrammarSpec(_OneSpec):
    grammar: SpecText


# each field, and the JSON schema of a value of it that asks for a spec (null, or a text format, does not)
ASKING = {
    "response_format": {"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
    "structured_outputs": {"type": "object"},
    "guided_json": {"type": "object"},
    "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array"},
    "guided_grammar": {"type": "string"},
}


def structured_exclusions() -> list[dict]:
    """At most one field asks, in the JSON schema's words: for each pair, if the first asks, the
    second is absent or null (if/then rules, as the request schema states its other cross-field rules)."""
    names = list(ASKING)
    return [{"if": {"properties": {first: ASKING[first]}, "required": [first]},
             "then": {"properties": {second: {"type": "null"}}}}
            for i, first in enumerate(names) for second in names[i + 1:]]


class StructuredOutputFields(BaseModel):
    """Mixed into both endpoints' request models. Each shape is one the JSON schema can state (a
    structured_outputs object has exactly one key, as one of five alternatives), so the served
    OpenAPI schema allows what the model accepts; only a JSON schema's size (MAX_SPEC_CHARS once
    written out) is checked past it."""

    response_format: ResponseFormat | None = None
    structured_outputs: JsonSpec | JsonObjectSpec | RegexSpec | ChoiceSpec | GrammarSpec | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: SpecText | None = None
    guided_choice: Choices | None = None
    guided_grammar: SpecText | None = None

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _one_spec(cls, value):
        """The one member its single key names, so a refusal speaks of that key and not of the four
        other shapes it is not."""
        return _member(value, SPEC_KEYS, lambda body: next(iter(body)) if len(body) == 1 else None,
                       "structured_outputs must be an object with exactly one of "
                       f"{', '.join(SPEC_KEYS)}")

    @field_validator("response_format", mode="before")
    @classmethod
    def _one_format(cls, value):
        return _member(value, FORMATS, lambda body: body.get("type"),
                       f"response_format.type must be one of {', '.join(FORMATS)}")

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The one spec the request asks for (None: free text); ApiError 400 naming the field."""
        given = {name: value for name, value in self._asked().items() if value is not None}
        if len(given) > 1:
            raise ApiError.bad_request(f"give one of response_format, structured_outputs and guided_*; this "
                                       f"request gives {' and '.join(given)}", sorted(given)[1])
        if not given:
            return None
        (name, fields), = given.items()
        try:
            return StructuredOutputsParams.model_validate(fields)
        except ValidationError as error:
            item = error.errors()[0]
            where = ".".join([name, *(str(part) for part in item["loc"])])
            message = item["msg"].removeprefix("Value error, ")
            raise ApiError.bad_request(f"{where}: {message}", name) from None

    @property
    def structured_field(self) -> str | None:
        """The field the spec came from (what a refusal of its grammar names)."""
        return next((name for name, value in self._asked().items() if value is not None), None)

    def _asked(self) -> dict[str, dict | None]:
        """Each field, as StructuredOutputsParams' fields (None: not given, or free text)."""
        response_format = self.response_format
        as_format = None
        if response_format is not None and response_format.type == "json_object":
            as_format = {"json_object": True}
        elif response_format is not None and response_format.type == "json_schema":
            as_format = {"json": response_format.json_schema.schema_}
        return {
            "response_format": as_format,
            "structured_outputs": (None if self.structured_outputs is None
                                   else self.structured_outputs.model_dump(by_alias=True)),
            "guided_json": None if self.guided_json is None else {"json": self.guided_json},
            "guided_regex": None if self.guided_regex is None else {"regex": self.guided_regex},
            "guided_choice": None if self.guided_choice is None else {"choice": self.guided_choice},
            "guided_grammar": None if self.guided_grammar is None else {"grammar": self.guided_grammar},
        }


SPEC_KEYS = {"json": JsonSpec, "json_object": JsonObjectSpec, "regex": RegexSpec, "choice": ChoiceSpec,
             "grammar": GrammarSpec}
FORMATS = {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaResponseFormat}


def _member(value, members: dict, key_of, refusal: str):
    """`value` validated as the union member `key_of(value)` names (None and instances pass)."""
    if value is None or isinstance(value, BaseModel):
        return value
    key = key_of(value) if isinstance(value, dict) else None
    if not isinstance(key, str) or key not in members:
        raise ValueError(refusal)
    try:
        return members[key].model_validate(value)
    except ValidationError as error:
        item = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {message}" if where else message) from None
