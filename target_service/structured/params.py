"""StructuredOutputsParams: what a request's output must match (vLLM's `structured_outputs`).

Exactly one of: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object),
`regex`, `choice` (one of these strings, exactly), `grammar` (a Lark grammar, as llguidance reads
it; a GBNF grammar, as llama.cpp writes it, is converted). Each becomes one llguidance grammar
(`grammar_text`), compiled against the target's tokenizer by `GrammarVocabulary`, which is where
a grammar that does not compile is refused.

JSON is written without free whitespace: `", "` between items and `": "` after keys, as
`json.dumps` writes it. Free whitespace lets a model that is unsure pad the output with blanks until
max_tokens (an unguided small model does exactly that); a schema may still ask for it with
llguidance's own `"x-guidance": {"whitespace_flexible": true}`.

Bounded, so one request cannot make the server compile for seconds: the spec's text is at most
`MAX_SPEC_CHARS`, a choice at most `MAX_CHOICES` strings; llguidance's parser limits bound the rest.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPEC_CHARS = 64 * 1024  # the schema's, regex's or grammar's text; a choice's strings together
MAX_CHOICES = 256
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [kind for kind in KINDS if self._value(kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.choice is not None and not 1 <= len(self.choice) <= MAX_CHOICES:
            raise ValueError(f"choice needs 1 to {MAX_CHOICES} strings; got {len(self.choice)}")
        if self.choice is not None and not all(self.choice):
            raise ValueError("choice strings must not be empty")
        if len(self.spec_text) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} is {len(self.spec_text)} characters; at most {MAX_SPEC_CHARS} "
                             "are allowed")
        if isinstance(self.json_schema, str):
            try:
                json.loads(self.json_schema)
            except ValueError as error:
                raise ValueError(f"json is not valid JSON: {error}") from None
        return self

    def _value(self, kind: str):
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if self._value(kind) not in (None, False))

    @property
    def spec_text(self) -> str:
        value = self._value(self.kind)
        if isinstance(value, (dict, list)):
            return json.dumps(value)
        return "" if value is True else str(value)

    def grammar_text(self) -> str:
        """The llguidance grammar this spec asks for (its validity is checked when it is compiled)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

        kind = self.kind
        if kind == "json":
            schema = self.json_schema if isinstance(self.json_schema, dict) else json.loads(self.json_schema)
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(re.escape(text) for text in self.choice))
        try:
            lark = any_to_lark(self.grammar)  # GBNF (llama.cpp's), as vLLM's guided_grammar often is
        except GbnfToLarkError as error:
            raise ValueError(str(error)) from None
        except Exception as error:  # the converter's bare ones: "No 'root' rule found", "Rule 'x' not found"
            raise ValueError(f"as GBNF: {error}") from None
        return LLMatcher.grammar_from_lark(lark)
