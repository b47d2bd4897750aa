"""Hypothesis strategies for JSON bodies from a JSON schema, the way schemathesis makes them: bodies
the schema allows (`valid_bodies`) and bodies one mutation away from allowed (`mutated_bodies`).

It covers the keywords the served OpenAPI schema uses and raises on any other, so a keyword added to
the schema cannot be ignored here without notice. `if`/`then` (alone, or an `allOf` of such rules) are
not generated from: a valid body is drawn without them, then kept only if the whole schema accepts it.
"""

from __future__ import annotations

import json
import math

import jsonschema
from hypothesis import strategies as st

KNOWN = {"$ref", "anyOf", "enum", "const", "type", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "minLength", "maxLength", "items", "minItems", "maxItems", "properties",
         "required", "additionalProperties", "title", "description", "default", "if", "then", "allOf",
         "pattern"}
LONGEST_LIST = 4  # lists drawn are at most this long (or their minItems): bodies stay small and fast
LONGEST_TEXT = 24

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


class SchemaBodies:
    """Strategies over one OpenAPI document's schemas, references resolved against it."""

    def __init__(self, document: dict):
        self.document = document

    def validator(self, ref: str) -> jsonschema.Draft202012Validator:
        return jsonschema.Draft202012Validator({"$ref": ref, "components": self.document["components"]})

    def valid_bodies(self, ref: str) -> st.SearchStrategy:
        validator = self.validator(ref)
        return self.strategy({"$ref": ref}).filter(validator.is_valid)

    def mutated_bodies(self, ref: str) -> st.SearchStrategy:
        """A valid body with one field given another JSON value, one required field dropped, one
        unknown field added, or any JSON at all in its place."""
        valid = self.strategy({"$ref": ref})

        def mutate(body, data):
            kind = data.draw(st.sampled_from(["retype", "drop", "extra", "anything"]))
            if kind == "anything" or not isinstance(body, dict) or not body:
                return data.draw(json_values)
            body = dict(body)
            key = data.draw(st.sampled_from(sorted(body)))
            if kind == "retype":
                body[key] = data.draw(json_values)
            elif kind == "drop":
                del body[key]
            else:
                body[data.draw(st.text(min_size=1, max_size=12))] = data.draw(json_values)
            return body

        return st.tuples(valid, st.data()).map(lambda pair: mutate(*pair))

    def strategy(self, schema: dict) -> st.SearchStrategy:
        unknown = set(schema) - KNOWN
        if unknown:
            raise NotImplementedError(f"no generator for the keywords {sorted(unknown)}")
        if any(set(rule) - {"if", "then"} for rule in schema.get("allOf", ())):
            raise NotImplementedError(f"no generator for an allOf of more than if/then: {schema['allOf']}")
        if "$ref" in schema:
            name = schema["$ref"].removeprefix("#/components/schemas/")
            return st.deferred(lambda: self.strategy(self.document["components"]["schemas"][name]))
        if "anyOf" in schema:
            return st.one_of([self.strategy(option) for option in schema["anyOf"]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "const" in schema:
            return st.just(schema["const"])
        kind = schema.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            ints = st.integers(schema.get("minimum"), schema.get("maximum"))
            exact = ints.filter(lambda i: abs(i) <= 2**53).map(float)  # 87.0 is the integer 87
            return ints | exact
        if kind == "number":
            low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
            exclusive = "exclusiveMinimum" in schema
            floats = st.floats(low, high, exclude_min=exclusive, allow_nan=False, allow_infinity=False)
            low_int = None if low is None else math.floor(low) + 1 if exclusive else math.ceil(low)
            high_int = None if high is None else math.floor(high)
            return floats | st.integers(low_int, high_int)  # 1 is a number too
        if kind == "string" and "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        if kind == "string":
            return st.text(min_size=schema.get("minLength", 0),
                           max_size=min(schema.get("maxLength", LONGEST_TEXT), LONGEST_TEXT))
        if kind == "array":
            low = schema.get("minItems", 0)
            high = min(schema.get("maxItems", LONGEST_LIST), max(low, LONGEST_LIST))
            return st.lists(self.strategy(schema.get("items", {})), min_size=low, max_size=high)
        if kind == "object":
            return self._object(schema)
        if not kind and set(schema) <= {"title", "description", "default"}:
            return json_values  # {}: anything
        raise NotImplementedError(f"no generator for {json.dumps(schema)[:200]}")

    def _object(self, schema: dict) -> st.SearchStrategy:
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        if not properties:
            values = json_values if extra is True else self.strategy(extra)
            return st.dictionaries(st.text(max_size=8), values, max_size=3)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {name: self.strategy(properties[name]) for name in properties if name in required},
            optional={name: self.strategy(properties[name]) for name in properties if name not in required},
        )
