"""The probes behind what cloud/grammar/schema_support.py trusts llguidance with, and the choice of
engine per schema.

A probe compiles a schema the way the engine does (GrammarCompiler, the default model's tokenizer)
and feeds JSON text token by token through llguidance's matcher, then end-of-sequence: instances
that satisfy the schema are accepted, every instance that violates only the probed keyword is
rejected. jsonschema_rs, the referee of finished output, labels every instance first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema_rs
import pytest

from cloud.grammar.compiler import GrammarCompiler
from cloud.grammar.llg_engine import LlgGrammar
from cloud.grammar.schema_support import LLG_ENFORCED, LLG_FORMATS, check_schema
from cloud.model.tokenizer import Tokenizer
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec

from .matching import accepts

INT = {"type": "integer"}


@dataclass(frozen=True)
class Probe:
    name: str
    schema: dict[str, Any]
    accepted: list[Any]
    rejected: list[Any]


PROBES = [
    Probe(
        "patternProperties",
        {"type": "object", "patternProperties": {"^x-": INT}, "additionalProperties": False},
        [{"x-a": 1}, {}],
        [{"x-a": "s"}, {"y": 1}],
    ),
    Probe(
        "pattern beside lengths",
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 4},
        ["abc", "abcd"],
        ["ab", "abcde", "ABC"],
    ),
    Probe(
        "unanchored pattern", {"type": "string", "pattern": "a", "minLength": 1}, ["bab", "a"], ["bbb", ""]
    ),
    Probe(
        "pattern \\d is ASCII", {"type": "string", "pattern": "^\\d+$", "minLength": 1}, ["12"], ["١٢", "1a"]
    ),
    Probe("pattern without type", {"pattern": "^a+$"}, ["aa", 5], ["b"]),
    Probe(
        "format beside maxLength",
        {"type": "string", "format": "email", "maxLength": 10},
        ["a@b.co"],
        ["aaaaaaa@b.co", "nope"],
    ),
    Probe(
        "format beside pattern",
        {"type": "string", "format": "uri", "pattern": "^https"},
        ["https://a.b"],
        ["http://a.b", "https//"],
    ),
    Probe("multipleOf on a number", {"type": "number", "multipleOf": 0.01}, [1.01, 3], [1.005, 0.001]),
    Probe("enum beside type", {"type": "integer", "enum": ["code", 1, 2]}, [1], ["code", 3]),
    Probe("enum beside minLength", {"enum": ["a", "bb", "ccc"], "minLength": 2}, ["bb"], ["a"]),
    Probe(
        "maxLength beside $ref",
        {"$ref": "#/$defs/s", "maxLength": 2, "$defs": {"s": {"type": "string"}}},
        ["ab"],
        ["abc", 1],
    ),
]
# formats llguidance checks itself; each gets instances its own format rejects. Its "date" and
# "date-time" take 2023-02-29, so it gets our patterns for them (probed in test_negation.py)
FORMATS = {
    "time": ("10:00:00Z", ["24:00:00Z", "10:60:00Z", "10:00"]),
    "email": ("a.b@c.de", ["a b@c.de", "a@", "@c.de"]),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", ["123e4567", "123e4567-e89b-12d3-a456-42661417400g"]),
    "uri": ("http://a.b/c?d#e", ["not a uri", "//no-scheme"]),
    "ipv4": ("192.168.0.1", ["256.1.1.1", "01.2.3.4", "1.2.3"]),
}


def enforced(
    tok: Tokenizer,
    compiler: GrammarCompiler,
    schema: dict[str, Any],
    accepted: list[Any],
    rejected: list[Any],
) -> None:
    referee = jsonschema_rs.validator_for(schema, validate_formats=True)
    assert all(referee.is_valid(v) for v in accepted) and not any(referee.is_valid(v) for v in rejected)
    assert check_schema(schema, "schema") == "llguidance"
    # read as JSON Schema says, as the referee does (the strict reading narrows objects: below)
    grammar = compiler.compile(GrammarSpec.json_schema(schema, strict=False, origin="schema"))
    assert [accepts(tok, grammar, v) for v in accepted] == [True] * len(accepted)
    assert [accepts(tok, grammar, v) for v in rejected] == [False] * len(rejected)


@pytest.mark.parametrize("probe", PROBES, ids=[p.name for p in PROBES])
def test_llguidance_enforces_what_xgrammar_cannot(
    tok: Tokenizer, compiler: GrammarCompiler, probe: Probe
) -> None:
    enforced(tok, compiler, probe.schema, probe.accepted, probe.rejected)


@pytest.mark.parametrize("name", sorted(LLG_FORMATS))
def test_llguidance_enforces_format_beside_a_length(
    tok: Tokenizer, compiler: GrammarCompiler, name: str
) -> None:
    # maxLength beside the format sends the schema to llguidance, whose own format is then probed
    good, bad = FORMATS[name]
    enforced(tok, compiler, {"type": "string", "format": name, "maxLength": 60}, [good], bad)


def test_every_llguidance_keyword_and_format_has_a_probe() -> None:
    assert {p.name for p in PROBES} >= LLG_ENFORCED and set(FORMATS) == LLG_FORMATS


def test_engine_is_chosen_per_schema(compiler: GrammarCompiler) -> None:
    plain = {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False}
    assert check_schema(plain, "schema") == "xgrammar"
    assert not isinstance(compiler.compile(GrammarSpec.json_schema(plain)), LlgGrammar)
    assert check_schema(PROBES[0].schema, "schema") == "llguidance"
    assert isinstance(compiler.compile(GrammarSpec.json_schema(PROBES[0].schema)), LlgGrammar)


def test_the_strict_reading_closes_objects_where_that_is_sound(
    tok: Tokenizer, compiler: GrammarCompiler
) -> None:
    # the default reading (xgrammar's strict_mode) reaches llguidance's schemas too: a property the
    # schema does not list is refused unless the client sent strict false
    tagged = {
        "type": "object",
        "properties": {"a": INT},
        "patternProperties": {"^x_": {"type": "string"}},
        "required": ["a"],
    }
    assert check_schema(tagged, "schema") == "llguidance"
    strict = compiler.compile(GrammarSpec.json_schema(tagged, origin="schema"))
    open_ = compiler.compile(GrammarSpec.json_schema(tagged, strict=False, origin="schema"))
    listed, unlisted, wrong = {"a": 1, "x_k": "v"}, {"a": 1, "z": 1}, {"a": 1, "x_k": 2}
    assert [accepts(tok, strict, v) for v in (listed, unlisted, wrong)] == [True, False, False]
    assert [accepts(tok, open_, v) for v in (listed, unlisted, wrong)] == [True, True, False]
    # under oneOf, closing the branches could let llguidance prove exclusive what is not: as written
    either = {"oneOf": [{**tagged, "required": ["a"]}, {"type": "array"}]}
    assert accepts(tok, compiler.compile(GrammarSpec.json_schema(either, origin="schema")), unlisted)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        # neither engine: refused naming the keyword, never compiled without it
        ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems at $ is not supported"),
        ({"type": "object", "patternProperties": {"^a": INT}, "not": {"multipleOf": 2}}, "not at $"),
        ({"type": "string", "pattern": "^a", "format": "hostname"}, 'format "hostname" at $'),
        ({"type": "string", "pattern": "^2", "format": "date-time"}, 'format "date-time" at $'),
        ({"type": "string", "pattern": "(?=a)b", "minLength": 1}, "pattern at $"),
        # overlapping oneOf: llguidance refuses it too rather than read it as anyOf
        (
            {"oneOf": [INT, {"type": "number", "minimum": 0}]},
            "nor can llguidance (oneOf constraints are not supported)",
        ),
    ],
)
def test_what_neither_engine_enforces_is_refused_with_the_reason(schema: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_schema(schema, "schema")
    assert caught.value.code == "unsupported_schema_feature" and named in caught.value.message


def test_tool_parameters_needing_llguidance_are_refused_by_the_tool_grammar(
    compiler: GrammarCompiler,
) -> None:
    spec = GrammarSpec.tool_calls({"f": PROBES[0].schema}, required=True, parallel=False)
    with pytest.raises(InvalidRequestError) as caught:
        compiler.compile(spec)
    assert caught.value.code == "unsupported_schema_feature" and "'f'" in caught.value.message
