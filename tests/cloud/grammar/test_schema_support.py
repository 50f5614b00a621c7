"""The probes behind the lists in cloud/grammar/schema_support.py, and check_schema's verdicts.

A probe compiles a small schema with xgrammar exactly as the engine does and feeds it JSON text.
Supported keyword (or format value): the grammar accepts instances that satisfy it and rejects every
instance that violates only it. Refused: the grammar accepts an instance that violates it (or cannot
compile it), and check_schema names the keyword and where it is. jsonschema_rs, which checks finished
output, is the referee for what satisfies and what violates.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jsonschema_rs
import pytest
import xgrammar as xgr

from cloud.grammar.formats import FORMAT_PATTERNS, grammar_schema
from cloud.grammar.schema_paths import RefError, format_path
from cloud.grammar.schema_support import (
    REFUSED_KEYWORDS,
    SUPPORTED_FORMATS,
    SUPPORTED_KEYWORDS,
    check_schema,
)
from shared.errors import InvalidRequestError

from .schema_suite import MALFORMED, SUITE, UNSUPPORTED, SuiteCase

# one token per printable ASCII character, so any ASCII JSON text can be fed a character at a time
VOCAB = [chr(i) for i in range(32, 127)] + ["<eos>"]
EOS = len(VOCAB) - 1
PARAM = "response_format.json_schema.schema"


class Text(str):
    """JSON text fed as written, for spellings json.dumps never produces (1.0, 15e-1, compact)."""


@cache
def _compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), max_threads=1)


def _compile(schema: dict[str, Any]) -> xgr.CompiledGrammar:
    return _compiler().compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


def grammar_accepts(schema: dict[str, Any], instance: Any) -> bool:
    """Whether the grammar lets the model write `instance` and stop. With any_whitespace=False the
    grammar writes json.dumps's default separators (", " and ": "), so instances are dumped that way."""
    with contextlib.suppress(RefError):  # a refused remote $ref is probed as xgrammar reads it
        schema = grammar_schema(schema)  # as the engine compiles it
    matcher = xgr.GrammarMatcher(_compile(schema))
    text = instance if isinstance(instance, Text) else json.dumps(instance)
    return bool(matcher.accept_string(text) and matcher.accept_token(EOS))


def valid(schema: dict[str, Any], instance: Any) -> bool:
    """Whether jsonschema_rs finds `instance` satisfies `schema` (text that is not JSON never does)."""
    try:
        value = json.loads(instance) if isinstance(instance, Text) else instance
    except ValueError:
        return False
    return jsonschema_rs.validator_for(schema, validate_formats=True).is_valid(value)


def enforced(schema: dict[str, Any], accepted: list[Any], rejected: list[Any]) -> None:
    """The schema passes, and the grammar agrees with the schema's own draft on every instance."""
    check_schema(schema, PARAM)
    for instance in accepted:
        assert valid(schema, instance), f"probe error: {instance!r} should satisfy"
        assert grammar_accepts(schema, instance), instance
    for instance in rejected:
        assert not valid(schema, instance), f"probe error: {instance!r} should violate"
        assert not grammar_accepts(schema, instance), instance


def refusal(schema: object) -> InvalidRequestError:
    """xgrammar's verdict: what it refuses here may still go to llguidance (test_llg_support.py)."""
    with pytest.raises(InvalidRequestError) as caught:
        check_schema(schema, PARAM, engines=("xgrammar",))
    assert caught.value.param == PARAM
    return caught.value


# --- supported keywords --------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    keyword: str
    schema: dict[str, Any]
    satisfying: list[Any]
    violating: list[Any]
    # satisfying instances the grammar refuses all the same: it is stricter, never looser
    stricter: list[Any] = field(default_factory=list)


INT = {"type": "integer"}
STR = {"type": "string"}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **more: Any) -> dict[str, Any]:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, **more}


SUPPORTED = [
    Probe("type", STR, ["a"], [1, None]),
    Probe("type", INT, [1, -3], [1.5, "1", Text("01")], stricter=[Text("1.0"), Text("1e2"), Text("-0")]),
    Probe("type", {"type": "number"}, [1, 1.5, Text("-0.5"), Text("1e5")], ["1", Text(".5"), Text("NaN")]),
    Probe("type", {"type": "boolean"}, [True, False], [1, "true"]),
    Probe("type", {"type": "null"}, [None], [0, ""]),
    Probe("type", {"type": ["string", "null"]}, ["a", None], [1, False]),
    Probe("type", {"type": "object"}, [{}, {"a": 1}], [[], "x"]),
    Probe("type", {"type": "array"}, [[], [1, "x"]], [{}, "x"]),
    Probe("enum", {"enum": ["a", 1, None]}, ["a", 1, None], ["b", 2, False]),
    Probe("enum", {"type": "string", "enum": ["a", "b"]}, ["a"], ["c"]),
    Probe("const", {"const": "hi"}, ["hi"], ["ho", 1]),
    # an object const is written compactly, whatever the separators
    Probe("const", {"const": {"x": [1, 2]}}, [Text('{"x":[1,2]}')], [{"x": [1]}], stricter=[{"x": [1, 2]}]),
    # strict_mode: properties not listed are refused, and listed ones come in the schema's order
    Probe(
        "properties",
        _obj({"a": INT, "b": INT}, []),
        [{"a": 1, "b": 2}],
        [{"a": "x"}],
        stricter=[{"c": 1}, {"b": 2, "a": 1}],
    ),
    Probe("required", _obj({"a": INT, "b": INT}, ["a"]), [{"a": 1}, {"a": 1, "b": 2}], [{"b": 2}, {}]),
    Probe(
        "additionalProperties", _obj({"a": INT}, additionalProperties=False), [{"a": 1}], [{"a": 1, "b": 1}]
    ),
    Probe(
        "additionalProperties",
        _obj({"a": INT}, additionalProperties=True),
        [{"a": 1, "b": "x"}],
        [{"a": "x"}],
    ),
    Probe(
        "additionalProperties",
        _obj({"a": INT}, additionalProperties={"type": "string", "maxLength": 2}),
        [{"a": 1, "b": "xy"}],
        [{"a": 1, "b": 1}, {"a": 1, "b": "xyz"}],
    ),
    Probe("minProperties", _obj({"a": INT, "b": INT}, [], minProperties=1), [{"a": 1}], [{}]),
    Probe("maxProperties", _obj({"a": INT, "b": INT}, [], maxProperties=1), [{"b": 1}], [{"a": 1, "b": 2}]),
    Probe(
        "maxProperties",
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        [{"k": 1}],
        [{"k": 1, "j": 2}],
    ),
    Probe("unevaluatedProperties", _obj({"a": INT}, [], unevaluatedProperties=False), [{"a": 1}], [{"b": 1}]),
    Probe("unevaluatedProperties", _obj({"a": INT}, [], unevaluatedProperties=STR), [{"b": "x"}], [{"b": 1}]),
    Probe("items", {"type": "array", "items": INT}, [[], [1, 2]], [["x"], [1, "x"]]),
    Probe("prefixItems", {"type": "array", "prefixItems": [INT, STR]}, [[1, "a"], [1], []], [["a"], [1, 2]]),
    Probe("items", {"type": "array", "prefixItems": [INT], "items": False}, [[1]], [[1, 2]]),
    Probe("items", {"type": "array", "prefixItems": [INT], "items": STR}, [[1, "a", "b"]], [[1, 2]]),
    Probe("minItems", {"type": "array", "items": INT, "minItems": 2}, [[1, 2]], [[1], []]),
    Probe("maxItems", {"type": "array", "items": INT, "maxItems": 2}, [[], [1, 2]], [[1, 2, 3]]),
    Probe(
        "maxItems",
        {"type": "array", "prefixItems": [INT], "items": INT, "maxItems": 2},
        [[1, 2]],
        [[1, 2, 3]],
    ),
    Probe(
        "unevaluatedItems",
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": False},
        [[1]],
        [[1, 2]],
    ),
    Probe(
        "unevaluatedItems",
        {"type": "array", "prefixItems": [INT], "unevaluatedItems": STR},
        [[1, "a"]],
        [[1, 2]],
    ),
    Probe("minLength", {"type": "string", "minLength": 2}, ["ab"], ["a", ""]),
    Probe("maxLength", {"type": "string", "maxLength": 2}, ["ab", ""], ["abc"]),
    Probe("maxLength", {"type": ["string", "null"], "maxLength": 2}, ["ab", None], ["abc"]),
    # an unanchored side matches anywhere, as JSON Schema's search does (formats.full_match), but
    # not across a line break
    Probe("pattern", {"type": "string", "pattern": "^[0-9]{3}-[a-z]+$"}, ["123-ab"], ["12-ab", "123-", "x"]),
    Probe("pattern", {"type": "string", "pattern": "^(cat|dog)$"}, ["cat"], ["cow", "catdog"]),
    Probe("pattern", {"type": "string", "pattern": "b"}, ["b", "abc"], ["a"], stricter=["a\nb"]),
    Probe("pattern", {"type": "string", "pattern": "^a|b$"}, ["a", "b"], ["c", "ba"], stricter=["ab", "cb"]),
    Probe("pattern", {"type": "string", "pattern": r"^\d{2}\s\w+$"}, ["12 a_b"], ["1a b", "12 a-b"]),
    Probe(
        "pattern",
        {"type": "string", "pattern": "^(?<y>[0-9]{4})(?:-[0-9]{2})?$"},
        ["2024", "2024-01"],
        ["24"],
    ),
    Probe("format", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["x"]),
    Probe("minimum", {"type": "integer", "minimum": 3}, [3, 40], [2, -3]),
    Probe("maximum", {"type": "integer", "maximum": 3}, [3, -100], [4, 40]),
    Probe("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0}, [1], [0, -1]),
    Probe("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 3}, [2], [3, 4]),
    Probe("minimum", {"type": "number", "minimum": 1.5}, [1.5, 2], [1.4, 1, Text("1.49999"), Text("14e-1")]),
    Probe("maximum", {"type": "number", "maximum": 1.5}, [1.5, -2], [1.6, 2, Text("1.50001"), Text("1e1")]),
    Probe("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 1.5}, [1.6], [1.5, Text("15e-1"), 1]),
    Probe("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, [1.4], [1.5, Text("1.50"), 2]),
    Probe("minimum", {"type": ["integer", "null"], "minimum": 2}, [3, None], [1]),
    Probe("multipleOf", {"type": "integer", "multipleOf": 3}, [6, -9, 0], [7, -1, 100]),
    Probe("multipleOf", {"type": "integer", "multipleOf": 1024}, [2048, 1024 * 10**9], [1025, 10**12 + 1]),
    Probe("multipleOf", {"type": ["integer", "null"], "multipleOf": 3}, [6, None], [7]),
    Probe(
        "multipleOf",
        {"type": "integer", "multipleOf": 7, "minimum": -5000, "maximum": 4999},
        [-4998, 0],
        [1, 4997],
    ),
    Probe(
        "multipleOf",
        {"type": "integer", "multipleOf": 3, "exclusiveMinimum": 0, "exclusiveMaximum": 10001},
        [3],
        [1, 10000],
    ),
    Probe("anyOf", {"anyOf": [{"type": "string", "maxLength": 2}, INT]}, ["ab", 1], ["abc", 1.5]),
    Probe("oneOf", {"oneOf": [INT, {"type": "string", "maxLength": 2}]}, [1, "ab"], ["abc", 1.5, None]),
    Probe(
        "oneOf",
        {
            "$defs": {
                "cat": _obj({"kind": {"const": "cat"}}, additionalProperties=False),
                "dog": _obj({"kind": {"enum": ["dog", "wolf"]}, "bark": INT}),
            },
            "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
        },
        [{"kind": "cat"}, {"kind": "wolf", "bark": 1}],
        [{"kind": "cow"}, {"kind": "dog"}, {"kind": "cat", "bark": 1}],
    ),
    Probe("allOf", {"allOf": [{"type": "integer", "maximum": 5}], "title": "t"}, [3], [9]),
    Probe("$ref", {"$defs": {"x": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/x"}, [3], [4, "a"]),
    Probe(
        "$ref",
        {"definitions": {"a/b": INT}, "type": "object", "properties": {"v": {"$ref": "#/definitions/a~1b"}}},
        [{"v": 1}],
        [{"v": "x"}],
    ),
    Probe(
        "$ref",
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": INT}, **_obj({"v": {"$ref": "#/$defs/a"}})},
        [{"v": 1}],
        [{"v": "x"}],
    ),
    Probe(  # recursion through the root
        "$ref",
        _obj({"v": INT, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}),
        [{"v": 1, "next": {"v": 2, "next": None}}],
        [{"v": 1, "next": {"v": "x", "next": None}}, {"v": 1, "next": {"v": 2}}],
    ),
    Probe(  # recursion through $defs, breadth bounded by maxItems
        "$ref",
        {
            "$defs": {
                "n": _obj(
                    {"v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}}
                )
            },
            "$ref": "#/$defs/n",
        },
        [{"v": 1, "kids": [{"v": 2, "kids": []}]}],
        [{"v": 1, "kids": [{"v": "x", "kids": []}]}, {"v": 1, "kids": [{"v": 2, "kids": []}] * 3}],
    ),
]

# for each format: values jsonschema_rs accepts, and malformed ones, each rejected by the grammar
FORMATS = {
    # compiled as exact patterns (formats.py); xgrammar's own accepted each of the last values here
    "date": (
        ["2024-02-29", "2000-02-29", "2023-12-31", "0001-01-01", "2023-04-30"],
        ["2023-02-29", "1900-02-29", "2024-02-30", "2023-04-31", "2023-13-01", "2023-00-10", "2024-1-01"],
    ),
    "time": (
        ["23:59:59Z", "00:00:00+01:00", "12:00:00.125Z", "08:30:00-05:30", "23:59:59z"],
        ["24:00:00Z", "12:60:00Z", "12:00:00", "12:00:00+24:00", "22:59:60Z"],
    ),
    "date-time": (
        ["2024-02-29T12:00:00Z", "2023-01-31T23:59:59.5+02:00", "2024-02-29t12:00:00z"],
        ["2023-02-29T12:00:00Z", "2023-01-31 23:59:59Z", "2023-01-31T23:59:59"],
    ),
    "ipv4": (
        ["0.0.0.0", "255.255.255.255", "192.168.1.20"],
        ["256.1.1.1", "1.2.3", "1.2.3.4.5", "01.2.3.4"],
    ),
    "duration": (
        ["P1D", "PT1H30M", "P1W", "P1Y2M3DT4H5M6S"],
        ["1D", "P", "PT", "P1W1D", "P1DT", "PT1.5H", "PT1M1H"],
    ),
    "email": (
        ["a@b.co", "a.b+c@d.org", '"a b"@c.com'],
        ["ab.co", "a@", "@b.co", "a..b@c.com", ".a@b.com", "a@b_c.com"],
    ),
    "ipv6": (
        ["::1", "::", "1:2:3:4:5:6:7:8", "::ffff:1.2.3.4"],
        ["1::2::3", "g::1", "12345::", "1:2:3:4:5:6:7", ":1"],
    ),
    "uri": (
        ["http://a.com/x", "urn:isbn:1", "http://a:b@c.com:80/p?q=1#f"],
        ["x", "/a", "http://a b", "1a:b", "a:%zz"],
    ),
    "uri-reference": (["/a/b", "a", "", "#f", "?q", "//a.com/x"], ["a b", "#f#g", "%zz", "\\\\x"]),
    "uri-template": (
        ["http://a.com/{id}", "{+a}", "{a,b}", "{a:3}"],
        ["http://a.com/{id", "{a b}", "{}", "a}"],
    ),
    "uuid": (
        ["123e4567-e89b-12d3-a456-426614174000"],
        ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"],
    ),
    "json-pointer": (["", "/", "/a/b", "/a~0b~1c"], ["a", "/a~", "/a~2", "#/a"]),
    "relative-json-pointer": (["0", "0/a", "1#"], ["-1/a", "01/a", "0#/a", "/a", "0##"]),
}

# for each refused format: a value the grammar accepts though jsonschema_rs finds it malformed
REFUSED_FORMATS = {
    "hostname": "a" * 64 + ".com",
    "idn-email": "x",
    "idn-hostname": "x y",
    "iri": "a b",
    "iri-reference": "a b",
    "regex": "(",
}


@pytest.mark.parametrize("probe", SUPPORTED, ids=lambda p: p.keyword)
def test_grammar_enforces_supported_keyword(probe: Probe) -> None:
    check_schema(probe.schema, PARAM)
    for instance in probe.satisfying:
        assert valid(probe.schema, instance), f"probe error: {instance!r} should satisfy"
        assert grammar_accepts(probe.schema, instance), instance
    for instance in probe.violating:
        assert not valid(probe.schema, instance), f"probe error: {instance!r} should violate"
        assert not grammar_accepts(probe.schema, instance), instance
    for instance in probe.stricter:
        assert valid(probe.schema, instance) and not grammar_accepts(probe.schema, instance), instance


def test_every_supported_keyword_has_a_probe() -> None:
    assert {probe.keyword for probe in SUPPORTED} == SUPPORTED_KEYWORDS


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammar_enforces_supported_format(name: str) -> None:
    schema = {"type": "string", "format": name}
    check_schema(schema, PARAM)
    satisfying, violating = FORMATS[name]
    for value in satisfying:
        assert valid(schema, value) and grammar_accepts(schema, value), value
    for value in violating:
        assert not valid(schema, value), f"probe error: {value!r} should be malformed"
        assert not grammar_accepts(schema, value), value


def test_every_supported_format_has_a_probe() -> None:
    assert set(FORMATS) == SUPPORTED_FORMATS


@pytest.mark.parametrize("name", sorted(REFUSED_FORMATS))
def test_unenforced_format_is_refused(name: str) -> None:
    schema = _obj({"when": {"type": "string", "format": name}})
    value = {"when": REFUSED_FORMATS[name]}
    assert grammar_accepts(schema, value) and not valid(schema, value)
    error = refusal(schema)
    assert error.code == "unsupported_schema_feature"
    assert f'format "{name}" at $.properties.when is not supported' in error.message


def test_unknown_format_is_refused() -> None:
    assert refusal({"type": "string", "format": "int32"}).code == "unsupported_schema_feature"


def test_format_on_a_non_string_is_inert_and_allowed() -> None:
    # JSON Schema applies format to strings only; xgrammar ignores it elsewhere too
    check_schema({"type": "integer", "format": "int64"}, PARAM)


# --- refused keywords and combinations -----------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    keyword: str  # as the message names it
    path: str
    schema: dict[str, Any]
    # an instance that violates the keyword and that the grammar accepts; NO_GRAMMAR: does not compile
    accepted: Any


NO_GRAMMAR = object()
TWO_INTS = {"type": "object", "properties": {"a": INT, "b": INT}}
DRAFT_2019 = "https://json-schema.org/draft/2019-09/schema"

REFUSED = [
    Refused(
        "uniqueItems",
        "$.properties.t",
        _obj({"t": {"type": "array", "items": INT, "uniqueItems": True}}),
        {"t": [1, 1]},
    ),
    Refused("contains", "$", {"type": "array", "items": INT, "contains": {"const": 5}}, [1]),
    Refused(
        "minContains",
        "$",
        {"type": "array", "items": INT, "minContains": 2, "contains": {"const": 5}},
        [5, 1],
    ),
    Refused(
        "maxContains",
        "$",
        {"type": "array", "items": INT, "maxContains": 1, "contains": {"const": 5}},
        [5, 5],
    ),
    Refused(
        "patternProperties",
        "$",
        {**_obj({"x_a": INT}), "patternProperties": {"^x_.*$": {"type": "integer", "minimum": 5}}},
        {"x_a": 1},
    ),
    Refused("propertyNames", "$", {**_obj({"xyz": INT}), "propertyNames": {"maxLength": 2}}, {"xyz": 1}),
    Refused("dependentRequired", "$", {**TWO_INTS, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    Refused("dependentSchemas", "$", {**TWO_INTS, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    Refused("dependencies", "$", {**TWO_INTS, "dependencies": {"a": ["b"]}}, {"a": 1}),
    Refused("not", "$", {"type": "integer", "not": {"const": 3}}, 3),
    Refused("if", "$", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, 7),
    Refused("then", "$", {"type": "integer", "then": {"maximum": 6}, "if": {"minimum": 5}}, 7),
    Refused("else", "$", {"type": "integer", "else": {"minimum": 3}, "if": {"minimum": 5}}, 1),
    Refused(
        "$dynamicRef",
        "$.properties.a",
        {"$dynamicAnchor": "m", **_obj({"a": {"$dynamicRef": "#m"}})},
        {"a": 1},
    ),
    Refused(
        "$recursiveRef",
        "$.properties.a",
        {"$schema": DRAFT_2019, "$recursiveAnchor": True, **_obj({"a": {"$recursiveRef": "#"}})},
        {"a": 1},
    ),
    # annotations in 2020-12, so jsonschema_rs passes the probe value; refused because users mean them
    Refused("contentEncoding", "$", {"type": "string", "contentEncoding": "base64"}, "!!!"),
    Refused("contentMediaType", "$", {"type": "string", "contentMediaType": "application/json"}, "{"),
    Refused(
        "contentSchema",
        "$",
        {"type": "string", "contentSchema": {"type": "object"}, "contentMediaType": "application/json"},
        "1",
    ),
    # only acts beside an items array (2019-09 and older), which dialects.py rewrites into
    # prefixItems and items; written in 2020-12 it does nothing, though its writer means something
    Refused("additionalItems", "$", {"type": "array", "prefixItems": [INT], "additionalItems": False}, [1]),
]
_ANNOTATIONS_IN_2020_12 = {"contentEncoding", "contentMediaType", "contentSchema", "additionalItems"}

# keywords the grammar enforces alone but drops in this company, and values it cannot honour
REFUSED_COMBINATIONS = [
    Refused("maxLength", "$", {"type": "string", "enum": ["a", "abcdef"], "maxLength": 3}, "abcdef"),
    Refused("anyOf", "$", {"enum": ["a", 1], "anyOf": [STR]}, 1),
    Refused("enum", "$", {"type": "integer", "enum": [1, "a"]}, "a"),
    Refused("const", "$", {"type": "integer", "const": "hi"}, "hi"),
    Refused("const", "$", {"const": 12345678901234567891}, Text("1.2345678901234567e+19")),
    # keywords beside an anyOf, an allOf of several, object keywords with no type and a required
    # property not listed are rewritten and enforced now: tests/cloud/grammar/test_shapes.py
    Refused("type", "$", {"type": "string", "anyOf": [INT]}, 1),
    Refused(
        "maximum",
        "$.properties.a",
        {"$defs": {"x": INT}, **_obj({"a": {"$ref": "#/$defs/x", "maximum": 3}})},
        {"a": 4},
    ),
    Refused("oneOf", "$", {"oneOf": [INT, {"type": "number"}]}, 1),
    Refused(
        "oneOf", "$", {"oneOf": [_obj({"k": {"enum": ["a", "b"]}}), _obj({"k": {"const": "b"}})]}, {"k": "b"}
    ),
    Refused("oneOf", "$", {"oneOf": [_obj({"k": {"const": 1}}), _obj({"k": {"const": 1.0}})]}, {"k": 1}),
    Refused("minimum", "$", {"minimum": 3}, 1),
    Refused("maxLength", "$", {"maxLength": 2}, "abc"),
    Refused("pattern", "$", {"pattern": "^a+$"}, "b"),
    Refused("minItems", "$", {"minItems": 2}, [1]),
    Refused("maxLength", "$", {"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa"),
    Refused("minLength", "$", {"type": "string", "pattern": "^a+$", "minLength": 2}, "a"),
    Refused("maxLength", "$", {"type": "string", "format": "email", "maxLength": 6}, "ab@c.com"),
    Refused("pattern", "$", {"type": "string", "pattern": "^a.*$", "format": "email"}, "b@c.com"),
    Refused("pattern", "$", {"type": "string", "pattern": "^(?=.*x)[a-z]{2}$"}, "ab"),
    Refused("pattern", "$", {"type": "string", "pattern": "^(?!ab)[a-z]{2}$"}, "ab"),
    Refused("pattern", "$", {"type": "string", "pattern": "a^b"}, "ab"),
    Refused("pattern", "$", {"type": "string", "pattern": "^a$b"}, "ab"),
    Refused("pattern", "$", {"type": "string", "pattern": "^[a-z](?<=a)$"}, NO_GRAMMAR),
    Refused("pattern", "$", {"type": "string", "pattern": r"^(a|b)\1$"}, NO_GRAMMAR),
    Refused("pattern", "$", {"type": "string", "pattern": r"^a\b$"}, NO_GRAMMAR),
    Refused("pattern", "$", {"type": "string", "pattern": r"^\p{L}$"}, NO_GRAMMAR),
    Refused("pattern", "$", {"type": "string", "pattern": "(?m)^a$"}, NO_GRAMMAR),
    Refused("multipleOf", "$", {"type": "number", "multipleOf": 0.5}, 1.3),
    Refused("multipleOf", "$", {"type": "integer", "multipleOf": 1.5}, 4),
    Refused("multipleOf", "$", {"type": "integer", "multipleOf": 1025}, 1),
    Refused("multipleOf", "$", {"type": "integer", "multipleOf": 3, "minimum": 4}, 7),
    Refused("multipleOf", "$", {"type": "integer", "multipleOf": 3, "maximum": 20}, 7),
    Refused("multipleOf", "$", {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000}, 7),
    Refused("multipleOf", "$", {"type": "integer", "multipleOf": 2000, "minimum": 0, "maximum": 10}, 1),
    Refused('$ref "#foo"', "$", {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "s"),
    Refused(
        '$ref "a.json"',
        "$",
        {"$id": "http://x.com/s", "$defs": {"a": {"$id": "a.json", **INT}}, "$ref": "a.json"},
        "s",
    ),
    Refused(  # xgrammar resolves "#/$defs/b" from the document root, not from the nested $id
        "$id",
        "$.$defs.r",
        {
            "$defs": {
                "b": STR,
                "r": {"$id": "http://x.com/r", "$defs": {"b": INT}, **_obj({"x": {"$ref": "#/$defs/b"}})},
            },
            "$ref": "#/$defs/r",
        },
        {"x": "s"},
    ),
]


@pytest.mark.parametrize("case", REFUSED + REFUSED_COMBINATIONS, ids=lambda case: case.keyword)
def test_grammar_ignores_what_is_refused(case: Refused) -> None:
    if case.accepted is NO_GRAMMAR:
        with pytest.raises(RuntimeError):
            _compile(case.schema)
        return
    assert grammar_accepts(case.schema, case.accepted)
    if case.keyword not in _ANNOTATIONS_IN_2020_12:
        assert not valid(case.schema, case.accepted), f"probe error: {case.accepted!r} should violate"


@pytest.mark.parametrize("case", REFUSED + REFUSED_COMBINATIONS, ids=lambda case: case.keyword)
def test_check_schema_refuses_naming_keyword_and_path(case: Refused) -> None:
    error = refusal(case.schema)
    assert error.code == "unsupported_schema_feature"
    assert error.message.startswith(f"{case.keyword} at {case.path} is not supported: "), error.message


def test_every_refused_keyword_has_a_probe() -> None:
    assert {case.keyword for case in REFUSED} == REFUSED_KEYWORDS


def test_keyword_lists_do_not_overlap() -> None:
    assert not SUPPORTED_KEYWORDS & REFUSED_KEYWORDS


def test_unique_items_false_asks_nothing_and_is_allowed() -> None:
    check_schema({"type": "array", "items": INT, "uniqueItems": False}, PARAM)


@pytest.mark.parametrize(
    "dialect",
    [
        "http://json-schema.org/draft-03/schema#",
        "https://example.com/my-meta",
        "https://json-schema.org/draft-07/schema#",
    ],
)
def test_unknown_dialect_is_refused_before_jsonschema_rs_would_fetch_it(
    dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fetches(schema: object) -> None:
        raise AssertionError("jsonschema_rs saw a $schema it would download")

    monkeypatch.setattr(jsonschema_rs.meta, "validate", fetches)
    error = refusal({"$schema": dialect, "type": "integer"})
    assert error.code == "unsupported_schema_feature" and error.message.startswith("$schema at $ ")


def test_nested_dialect_is_refused() -> None:
    error = refusal(_obj({"a": {"$schema": "https://example.com/x", "type": "integer"}}))
    assert error.message.startswith("$schema at $.properties.a ")


def test_refused_keyword_reached_only_through_a_ref_is_found() -> None:
    schema = {**_obj({"a": {"$ref": "#/x-defs/t"}}), "x-defs": {"t": {"type": "array", "uniqueItems": True}}}
    assert refusal(schema).message.startswith('uniqueItems at $["x-defs"].t ')


def test_refused_keyword_in_an_unused_def_is_refused() -> None:
    schema = {"$defs": {"unused": {"not": {"multipleOf": 2}}}, "type": "integer"}
    assert refusal(schema).message.startswith("not at $.$defs.unused ")


def test_annotations_and_unknown_keywords_are_allowed() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://example.com/person",
        "$comment": "c",
        "title": "Person",
        "description": "d",
        "x-vendor": {"uniqueItems": True},
        "discriminator": {"propertyName": "kind"},
        **_obj(
            {
                "name": {
                    "type": "string",
                    "maxLength": 5,
                    "examples": ["Ann"],
                    "default": "Bo",
                    "deprecated": True,
                },
                "id": {"type": "integer", "readOnly": True, "writeOnly": False, "$anchor": "id"},
            }
        ),
    }
    check_schema(schema, PARAM)
    assert grammar_accepts(schema, {"name": "Ann", "id": 1})


# --- malformed schemas ---------------------------------------------------------------------------

MALFORMED_AT = [
    ({"type": "strng"}, "$.type", "strng"),
    ({"type": ["string", "nul"]}, "$.type", "nul"),
    (
        _obj({"age": {"type": "integer", "minimum": "x"}}),
        "$.properties.age.minimum",
        '"x" is not of type "number"',
    ),
    ({"type": "object", "required": "a"}, "$.required", "array"),
    ({"type": "object", "properties": []}, "$.properties", "object"),
    ({"anyOf": []}, "$.anyOf", "less than 1 item"),
    ({"type": "array", "items": [INT]}, "$.items", ""),  # an items array is not 2020-12
    ({"type": "string", "pattern": "(a"}, "$.pattern", "regex"),
    (
        _obj({"a b": {"$ref": "#/$defs/missing"}}),
        '$.properties["a b"]',
        '$ref "#/$defs/missing" points at nothing',
    ),
    ({"$ref": "#/properties/0"}, "$", "points at nothing"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$.$defs.a", "loops back"),
    ([], "$", "not an array"),
    ("x", "$", "not a string"),
    (5, "$", "not a number"),
    (True, "$", "not a boolean"),
    (None, "$", "not null"),
]


@pytest.mark.parametrize(("schema", "where", "what"), MALFORMED_AT)
def test_malformed_schema_is_invalid_naming_where(schema: object, where: str, what: str) -> None:
    error = refusal(schema)
    assert error.code == "invalid_schema"
    assert error.message.startswith(f"{PARAM} is not a valid JSON Schema: at {where}: "), error.message
    assert what in error.message


def test_bad_regex_inside_a_property_is_located() -> None:
    error = refusal(_obj({"zip": {"type": "string", "pattern": "[0-9"}}))
    assert error.message.startswith(f"{PARAM} is not a valid JSON Schema: at $.properties.zip.pattern: ")


@pytest.mark.parametrize(
    ("path", "written"),
    [
        ((), "$"),
        (("properties", "age", "minimum"), "$.properties.age.minimum"),
        (("anyOf", 1, "properties", "first name"), '$.anyOf[1].properties["first name"]'),
        (("$defs", "node", "items"), "$.$defs.node.items"),
        (("properties", "1st", "items"), '$.properties["1st"].items'),
        (("properties", 'say "hi"'), '$.properties["say \\"hi\\""]'),
    ],
)
def test_paths_are_written_as_jsonpath(path: tuple[str | int, ...], written: str) -> None:
    assert format_path(path) == written


# --- the shared suite ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", SUITE, ids=lambda case: case.name)
def test_suite_schema_is_supported_and_compiles(case: SuiteCase) -> None:
    check_schema(case.schema, PARAM)
    _compile(case.schema)


def test_suite_is_large_and_named_uniquely() -> None:
    assert len(SUITE) >= 32 and len({case.name for case in SUITE}) == len(SUITE)


@pytest.mark.parametrize(("name", "schema", "keyword", "path"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_suite_unsupported_case_is_refused(
    name: str, schema: dict[str, Any], keyword: str, path: str
) -> None:
    error = refusal(schema)
    assert error.code == "unsupported_schema_feature"
    assert error.message.startswith(f"{keyword} at {path} is not supported: "), error.message


@pytest.mark.parametrize(("name", "schema"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_suite_malformed_case_is_invalid(name: str, schema: object) -> None:
    assert refusal(schema).code == "invalid_schema"


def _calendar() -> list[str]:
    years = ("0000", "1900", "2000", "2023", "2024", "2100", "9999")
    return [f"{y}-{m:02d}-{d:02d}" for y in years for m in range(14) for d in (0, 1, 28, 29, 30, 31, 32)]


@pytest.mark.parametrize("name", sorted(FORMAT_PATTERNS))
def test_format_patterns_never_accept_what_the_format_rejects(name: str) -> None:
    # the rewrite may be narrower than the format (no leap seconds), never looser
    samples = _calendar() if name in ("date", "date-time") else [*FORMATS[name][0], *FORMATS[name][1]]
    if name == "date-time":
        samples = [f"{d}T10:20:30Z" for d in samples]
    schema = {"type": "string", "format": name}
    accepted = [s for s in samples if grammar_accepts(schema, s)]
    assert accepted and all(valid(schema, s) for s in accepted)
    if name == "date":  # and for dates it is exact
        assert accepted == [s for s in samples if valid(schema, s)]
