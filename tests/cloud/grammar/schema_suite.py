"""Schemas for end-to-end structured-output tests: SUITE (each passes check_schema and is run against
a real tiny model), UNSUPPORTED (each refused with code unsupported_schema_feature) and MALFORMED
(each refused with code invalid_schema).

SUITE is sized for SmolLM2-135M, greedy, about 100 new tokens: every free string has a maxLength of
at most 20 (or an enum or a pattern), every array a maxItems of at most 4, every integer bounds, so
the shortest valid output, and the likely one, is short. Strings with a format cannot also carry a
maxLength (xgrammar drops it), so their prompts ask for a typical, short value (a bare "ISO 8601
duration" prompt gets P2000... until max_tokens). Recursion cannot bound depth in a grammar: the
recursive tree bounds breadth with maxItems and leaves children optional, and a second tree bounds
its depth by unrolling two levels through $defs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SuiteCase:
    name: str
    schema: dict[str, Any]
    prompt: str  # the user message asking for that data


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object with these properties, all required unless `required` says otherwise, and no others."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _text(max_length: int = 20) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


_POINT = _obj({"x": _int(-100, 100), "y": _int(-100, 100)})
_PET = {
    "$defs": {
        "cat": _obj({"kind": {"const": "cat"}, "name": _text(12), "indoor": {"type": "boolean"}}),
        "dog": _obj({"kind": {"const": "dog"}, "name": _text(12), "good": {"type": "boolean"}}),
    },
    "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
}


def _list_of(ref: str, max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": {"$ref": ref}, "maxItems": max_items}


# children optional: greedy SmolLM2, once it opens a child list, nests the same node until max_tokens
_TREE = {
    "$defs": {"node": _obj({"name": _text(10), "children": _list_of("#/$defs/node", 2)}, required=["name"])},
    "$ref": "#/$defs/node",
}
# the depth bound made explicit: two levels unrolled through $defs, the last one holding no children
_FAMILY = {
    "$defs": {
        "child": _obj({"name": _text(10)}),
        "parent": _obj({"name": _text(10), "children": _list_of("#/$defs/child", 2)}),
    },
    **_obj({"name": _text(10), "children": _list_of("#/$defs/parent", 1)}),
}

SUITE: list[SuiteCase] = [
    SuiteCase("string", _obj({"name": _text()}), "Give a fictional person's first name as JSON."),
    SuiteCase("integer", _obj({"age": _int(0, 120)}), "How old is a typical student? Answer as JSON."),
    SuiteCase(
        "number",
        _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
        "What does a cup of coffee cost in dollars? Answer as JSON.",
    ),
    SuiteCase(
        "boolean", _obj({"is_raining": {"type": "boolean"}}), "Is it raining in London? Answer as JSON."
    ),
    SuiteCase(
        "null",
        _obj({"middle_name": {"type": "null"}, "first_name": _text()}),
        "A person with no middle name, as JSON.",
    ),
    SuiteCase(
        "string_enum",
        _obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
        "What color is the sky? Answer as JSON.",
    ),
    SuiteCase(
        "mixed_enum",
        _obj({"answer": {"enum": ["yes", "no", 0, 1, None]}}),
        "Is water wet? Answer as JSON.",
    ),
    SuiteCase(
        "const",
        _obj({"version": {"const": "v1"}, "title": _text()}),
        "Describe a book title as JSON, version v1.",
    ),
    SuiteCase(
        "nested_object",
        _obj(
            {
                "name": _text(),
                "address": _obj({"city": _text(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
            }
        ),
        "Describe a fictional person and their address as JSON.",
    ),
    SuiteCase(
        "array_of_strings",
        _obj({"tags": {"type": "array", "items": _text(10), "minItems": 1, "maxItems": 3}}),
        "Give up to three tags for a blog post about cooking, as JSON.",
    ),
    SuiteCase(
        "array_bounds",
        _obj({"digits": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 4}}),
        "List a few single digits as JSON.",
    ),
    SuiteCase(
        "array_of_enums",
        _obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}}),
        "Which weekdays do you work? Answer as JSON.",
    ),
    SuiteCase(
        "tuple",
        _obj({"pair": {"type": "array", "prefixItems": [_text(10), _int(0, 99)], "items": False}}),
        "Give a fruit name and a count as a JSON pair.",
    ),
    SuiteCase(
        "any_of_scalar",
        _obj({"value": {"anyOf": [_text(10), _int(0, 1000)]}}),
        "Give any value as JSON.",
    ),
    SuiteCase(
        "any_of_nullable_object",
        _obj({"owner": {"anyOf": [_obj({"name": _text()}), {"type": "null"}]}}),
        "Who owns the moon? Answer as JSON.",
    ),
    SuiteCase(
        "one_of_types",
        _obj({"id": {"oneOf": [_int(0, 9999), {"type": "string", "pattern": "^[a-z]{3}$"}]}}),
        "Give an identifier as JSON.",
    ),
    SuiteCase("one_of_discriminated", _PET, "Describe a pet as JSON."),
    SuiteCase(
        "ref_defs",
        {
            "$defs": {"point": _POINT},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
        "Give a line segment's two end points as JSON.",
    ),
    SuiteCase(
        "definitions",
        {"definitions": {"name": _text()}, **_obj({"first": {"$ref": "#/definitions/name"}})},
        "Give a first name as JSON.",
    ),
    SuiteCase(
        "all_of_single_ref",
        {"$defs": {"point": _POINT}, **_obj({"at": {"allOf": [{"$ref": "#/$defs/point"}], "title": "At"}})},
        "Give a point on a grid as JSON.",
    ),
    SuiteCase("recursive_tree", _TREE, "Describe a tiny family tree as JSON."),
    SuiteCase("depth_bounded_tree", _FAMILY, "Describe a tiny family tree as JSON."),
    SuiteCase(
        "pattern",
        _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
        "Give a product code like ABC-123 as JSON.",
    ),
    SuiteCase(
        "pattern_alternation",
        _obj({"size": {"type": "string", "pattern": "^(small|medium|large)$"}}),
        "What size coffee do you want? Answer as JSON.",
    ),
    SuiteCase(
        "format_date",
        _obj({"event": {"type": "string", "maxLength": 20}, "day": {"type": "string", "format": "date"}}),
        "Give a holiday and its date (YYYY-MM-DD) as JSON.",
    ),
    SuiteCase(
        "format_date_time",
        _obj({"sent_at": {"type": "string", "format": "date-time"}}),
        "Give the time a message was sent (like 2024-05-01T09:30:00Z) as JSON.",
    ),
    SuiteCase(
        "format_email",
        _obj({"email": {"type": "string", "format": "email"}}),
        "Give a contact email as JSON.",
    ),
    SuiteCase(
        "format_uuid", _obj({"id": {"type": "string", "format": "uuid"}}), "Give a random UUID as JSON."
    ),
    SuiteCase(
        "format_duration",
        _obj({"length": {"type": "string", "format": "duration"}}),
        "How long is a typical movie? Answer as JSON with an ISO 8601 duration such as PT1H30M.",
    ),
    SuiteCase(
        "format_uri", _obj({"homepage": {"type": "string", "format": "uri"}}), "Give a website URL as JSON."
    ),
    SuiteCase(
        "format_ipv6",
        _obj({"address": {"type": "string", "format": "ipv6"}}),
        "Give the IPv6 loopback address as JSON.",
    ),
    SuiteCase(
        "exclusive_bounds",
        _obj({"rating": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 6}}),
        "Rate a movie from 1 to 5 as JSON.",
    ),
    SuiteCase(
        "number_bounds",
        _obj({"probability": {"type": "number", "minimum": 0, "maximum": 1}}),
        "What is the chance of rain tomorrow? Answer as JSON.",
    ),
    SuiteCase(
        "multiple_of",
        _obj({"minutes": {"type": "integer", "multipleOf": 15, "minimum": 0, "maximum": 120}}),
        "How long is a meeting in minutes? Answer as JSON.",
    ),
    SuiteCase(
        "optional_fields",
        _obj({"name": _text(), "nickname": _text(), "age": _int(0, 120)}, required=["name"]),
        "Describe a fictional person as JSON.",
    ),
    SuiteCase(
        "nullable_string",
        _obj({"note": {"type": ["string", "null"], "maxLength": 20}}),
        "Leave a short note, or none, as JSON.",
    ),
    SuiteCase(
        "nullable_integer",
        _obj({"floor": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}}),
        "Which floor is the office on? Answer as JSON.",
    ),
    SuiteCase(
        "tool_parameters",
        _obj({"location": _text(), "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
        "What is the weather in Paris? Give the call arguments as JSON.",
    ),
    SuiteCase(
        "unevaluated_properties",
        {
            "type": "object",
            "properties": {"city": _text()},
            "required": ["city"],
            "unevaluatedProperties": False,
        },
        "Name a city as JSON.",
    ),
]

# (name, schema, the keyword as the message names it, the JSON path of the schema holding it)
UNSUPPORTED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "unique_items",
        _obj({"tags": {"type": "array", "items": _text(), "uniqueItems": True}}),
        "uniqueItems",
        "$.properties.tags",
    ),
    ("not", _obj({"n": {"type": "integer", "not": {"const": 3}}}), "not", "$.properties.n"),
    (
        "if_then",
        {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}},
        "if",
        "$",
    ),
    (
        "format_hostname",
        {"anyOf": [{"type": "null"}, _obj({"first name": {"type": "string", "format": "hostname"}})]},
        'format "hostname"',
        '$.anyOf[1].properties["first name"]',
    ),
    (
        "pattern_lookahead",
        _obj({"code": {"type": "string", "pattern": "^(?!000)[0-9]{3}$"}}),
        "pattern",
        "$.properties.code",
    ),
    (
        "one_of_overlapping",
        _obj({"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}),
        "oneOf",
        "$.properties.v",
    ),
    (
        "all_of_two",
        {"allOf": [_obj({"a": _text()}), _obj({"b": _text()})]},
        "allOf",
        "$",
    ),
    (
        "contains",
        {"type": "array", "items": _int(0, 9), "contains": {"const": 5}},
        "contains",
        "$",
    ),
    (
        "remote_ref",
        _obj({"who": {"$ref": "https://example.com/person.json"}}),
        '$ref "https://example.com/person.json"',
        "$.properties.who",
    ),
    (
        "max_length_beside_pattern",
        {"$defs": {"zip": {"type": "string", "pattern": "^[0-9]+$", "maxLength": 5}}, "$ref": "#/$defs/zip"},
        "maxLength",
        "$.$defs.zip",
    ),
    (
        "minimum_without_type",
        _obj({"n": {"minimum": 3}}),
        "minimum",
        "$.properties.n",
    ),
    (
        "pattern_properties",
        {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
        "patternProperties",
        "$",
    ),
]

# xgrammar refuses these, llguidance enforces them (cloud/grammar/llg_engine.py): served all the same
LLGUIDANCE_ONLY = frozenset({"max_length_beside_pattern", "minimum_without_type", "pattern_properties"})
REFUSED = [u for u in UNSUPPORTED if u[0] not in LLGUIDANCE_ONLY]  # by both engines

MALFORMED: list[tuple[str, object]] = [
    ("bad_type_name", {"type": "object", "properties": {"a": {"type": "strng"}}}),
    ("minimum_not_a_number", {"type": "object", "properties": {"age": {"type": "integer", "minimum": "x"}}}),
    ("required_not_a_list", {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"}),
    ("dangling_ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
    ("ref_loop", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ("bad_regex", {"type": "string", "pattern": "(unclosed"}),
    ("empty_any_of", {"anyOf": []}),
    ("array_root", []),
    ("string_root", "x"),
]  # not None: the API reads a null schema as "any JSON object"
