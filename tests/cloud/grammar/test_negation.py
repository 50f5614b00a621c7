"""`not` rewritten into positive keywords (cloud/grammar/negation.py, shapes.py), and llguidance
handed our exact date patterns (formats.llg_schema).

Each probe goes the way a request's schema goes: check_schema picks the engine, GrammarCompiler
compiles with the default model's tokenizer, and JSON text is fed token by token through that
engine's matcher, then end-of-sequence. jsonschema_rs (formats checked) labels every instance first,
so a probe cannot pass by labelling wrongly: what the schema accepts is accepted, what it rejects is
rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema_rs
import pytest

from cloud.grammar.compiler import GrammarCompiler
from cloud.grammar.negation import negated
from cloud.grammar.schema_support import Engine, check_schema
from cloud.model.tokenizer import Tokenizer
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec

from .matching import accepts

INT = {"type": "integer"}
STR = {"type": "string"}


@dataclass(frozen=True)
class Probe:
    name: str
    schema: dict[str, Any]
    engine: Engine
    accepted: list[Any]
    rejected: list[Any]


def _obj(closed: bool, negated_schema: dict[str, Any]) -> dict[str, Any]:
    extra = {"additionalProperties": False} if closed else {}
    return {"type": "object", "properties": {"a": INT, "b": STR}, **extra, "not": negated_schema}


PROBES = [
    Probe(
        "not required on an open object: the property is absent",
        _obj(False, {"required": ["b"]}),
        "llguidance",
        [{"a": 1}, {"a": 1, "c": 2}, {}],
        [{"a": 1, "b": "x"}, {"b": "x"}, "s"],
    ),
    Probe(
        "not required on a closed object: dropped from properties",
        _obj(True, {"required": ["b"]}),
        "xgrammar",
        [{"a": 1}, {}],
        [{"a": 1, "b": "x"}, {"c": 1}],
    ),
    Probe(
        "not required of two: one of them absent",
        _obj(True, {"required": ["a", "b"]}),
        "xgrammar",
        [{"a": 1}, {"b": "x"}, {}],
        [{"a": 1, "b": "x"}],
    ),
    Probe(
        "not anyOf of required, in branches (docker-compose's build or image)",
        {
            "type": "object",
            "properties": {"build": STR, "image": STR},
            "additionalProperties": False,
            "anyOf": [
                {"required": ["build"], "not": {"required": ["image"]}},
                {"required": ["image"], "not": {"anyOf": [{"required": ["build"]}]}},
            ],
        },
        "xgrammar",
        [{"build": "."}, {"image": "x"}],
        [{"build": ".", "image": "x"}, {}],
    ),
    Probe(
        "not type beside a type list",
        {"type": ["string", "null", "integer"], "not": {"type": "null"}},
        "xgrammar",
        ["s", 3],
        [None, True],
    ),
    Probe(
        "not beside an enum strikes values",
        {"enum": ["a", "b", 1, None], "not": {"anyOf": [{"const": "b"}, {"type": "null"}]}},
        "xgrammar",
        ["a", 1],
        ["b", None],
    ),
    Probe(
        "not of bounds, turned round",
        {"allOf": [STR, {"not": {"anyOf": [{"maxLength": 2}, {"minLength": 4}], "type": "string"}}]},
        "xgrammar",
        ["abc"],
        ["ab", "abcd", 3],
    ),
    Probe(
        "not not is the schema",
        {"allOf": [{"type": "array"}, {"not": {"not": {"maxItems": 2}}}]},
        "xgrammar",
        [[], [1, 2]],
        [[1, 2, 3], {}],
    ),
    Probe(
        "not minimum on a number is an exclusive maximum",
        {"type": "number", "not": {"minimum": 5}},
        "xgrammar",
        [4, 4.5],
        [5, 6, "4"],
    ),
    Probe(
        "not properties: the property present and breaking its schema",
        {"type": "object", "properties": {"a": {}}, "not": {"properties": {"a": STR}}},
        "xgrammar",
        [{"a": 1}, {"a": None, "c": 1}],
        [{"a": "s"}, {}, {"c": 1}],
    ),
]
# dates llguidance is handed as our patterns: exact where its own format takes 2023-02-29
DATE_PROBES = [
    Probe(
        "date-time beside maxLength",
        {"type": "string", "format": "date-time", "maxLength": 40},
        "llguidance",
        ["2024-02-29T12:00:00Z", "2000-02-29t23:59:59.5z", "2023-01-31T00:00:00-05:30"],
        [
            *("2023-02-29T12:00:00Z", "1900-02-29T12:00:00Z", "2023-13-01T12:00:00Z"),
            *("2023-01-31 10:00:00Z", "2023-01-31T10:00:00", "2023-01-31T24:00:00Z"),
            "2023-01-31T10:00:00+24:00",
        ],
    ),
    Probe(
        "date beside minLength",
        {"type": "string", "format": "date", "minLength": 10},
        "llguidance",
        ["2024-02-29", "2023-12-31"],
        ["2023-02-29", "2023-04-31", "2023-00-10", "2024-1-01", "2023-01-01T"],
    ),
]


@pytest.mark.parametrize("probe", PROBES + DATE_PROBES, ids=lambda p: p.name)
def test_rewrite_is_enforced_exactly(tok: Tokenizer, compiler: GrammarCompiler, probe: Probe) -> None:
    schema = probe.schema
    referee = jsonschema_rs.validator_for(schema, validate_formats=True)
    assert [referee.is_valid(v) for v in probe.accepted] == [True] * len(probe.accepted), "probe error"
    assert [referee.is_valid(v) for v in probe.rejected] == [False] * len(probe.rejected), "probe error"
    assert check_schema(schema, "schema") == probe.engine
    grammar = compiler.compile(GrammarSpec.json_schema(schema, strict=False, origin="schema"))
    assert [accepts(tok, grammar, v) for v in probe.accepted] == [True] * len(probe.accepted)
    assert [accepts(tok, grammar, v) for v in probe.rejected] == [False] * len(probe.rejected)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "not": {"const": 3}},  # "every integer but 3" is no keyword
        {"type": "string", "minLength": 1, "not": {"enum": ["upstart"]}},
        {"type": "string", "not": {"pattern": "^a"}},
        {"type": "number", "not": {"type": "integer"}},  # a number with a fraction is no type
        {"type": "object", "not": {"$ref": "#/$defs/a"}, "$defs": {"a": {"required": ["a"]}}},
        {"enum": [1, 2], "not": {"$ref": "#/$defs/a"}, "$defs": {"a": {"const": 1}}},
        {"type": "object", "not": {"minProperties": 0}},  # matches nothing: refused, not compiled
    ],
)
def test_not_that_cannot_be_rewritten_exactly_is_refused_naming_it(schema: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_schema(schema, "schema")
    assert caught.value.code == "unsupported_schema_feature"
    assert caught.value.message.startswith("not at $ is not supported"), caught.value.message


def test_date_format_beside_a_pattern_is_refused_for_llguidance() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_schema({"type": "string", "format": "date-time", "pattern": "^2"}, "schema")
    assert 'format "date-time" at $ is not supported' in caught.value.message
    assert "beside pattern" in caught.value.message


@pytest.mark.parametrize(
    ("sub", "positive"),
    [
        (False, {}),
        ({"not": INT}, INT),
        ({"type": ["number", "string"]}, {"type": ["object", "array", "boolean", "null"]}),
        ({"maxItems": 2, "title": "t"}, {"type": "array", "minItems": 3}),
        ({"minLength": 0}, None),  # holds for every string: its negation matches nothing
        (
            {"required": ["a", "b"]},
            {"anyOf": [{"type": "object", "properties": {n: False}} for n in ("a", "b")]},
        ),
        ({"oneOf": [False, {"minimum": 1}]}, {"type": "number", "exclusiveMaximum": 1}),
        ({"oneOf": [INT, STR]}, None),
        ({"multipleOf": 2}, None),
    ],
)
def test_negated(sub: Any, positive: dict[str, Any] | None) -> None:
    assert negated(sub) == positive
