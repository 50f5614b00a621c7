"""Shapes rewritten so the grammar enforces them (shapes.py): each schema passes check_schema, and
the grammar agrees with jsonschema_rs, reading the schema as sent, on every probe instance; shapes
whose rewrite would not be exact are still refused."""

from __future__ import annotations

from typing import Any

import pytest

from cloud.grammar.shapes import merge, normalized

from .test_schema_support import enforced, refusal

INT = {"type": "integer"}
STR = {"type": "string"}


def test_object_keywords_without_type_constrain_objects_only() -> None:
    schema = {"properties": {"a": INT}, "required": ["a"], "additionalProperties": False}
    enforced(schema, [{"a": 1}, "x", 3, None, True], [{}, {"a": "s"}, {"a": 1, "b": 2}])


def test_additional_properties_without_type() -> None:
    enforced({"additionalProperties": INT}, [{"x": 1}, "s"], [{"x": "s"}])


def test_max_properties_without_type() -> None:
    schema = {"properties": {"a": INT, "b": INT}, "maxProperties": 1}
    enforced(schema, [{"a": 1}, {}, 5], [{"a": 1, "b": 2}])


def test_required_property_not_listed_takes_any_value() -> None:
    schema = {"type": "object", "properties": {"a": INT}, "required": ["a", "z"]}
    enforced(schema, [{"a": 1, "z": "anything"}, {"a": 1, "z": [1, {"b": None}]}], [{"a": 1}, {"z": 1}])


def test_required_property_not_listed_follows_additional_properties() -> None:
    schema = {"type": "object", "properties": {"a": INT}, "required": ["a", "z"], "additionalProperties": STR}
    enforced(schema, [{"a": 1, "z": "s"}], [{"a": 1, "z": 2}, {"a": 1}])


def test_required_property_that_additional_properties_forbids_is_refused() -> None:
    schema = {
        "type": "object",
        "properties": {"a": INT},
        "required": ["a", "z"],
        "additionalProperties": False,
    }
    assert refusal(schema).message.startswith("required at $ ")


def test_keywords_beside_any_of_go_into_each_branch() -> None:
    schema = {
        "type": "object",
        "properties": {"id": INT},
        "required": ["id"],
        "anyOf": [
            {"properties": {"a": STR}, "required": ["a"]},
            {"properties": {"b": STR}, "required": ["b"]},
        ],
    }
    enforced(
        schema, [{"id": 1, "a": "x"}, {"id": 1, "b": "y"}], [{"a": "x"}, {"id": 1}, {"id": "1", "a": "x"}]
    )


def test_keywords_beside_one_of_go_into_each_branch_and_exclusivity_is_still_proven() -> None:
    branch = {"properties": {"kind": {"const": "a"}, "a": INT}, "required": ["kind", "a"]}
    other = {"properties": {"kind": {"const": "b"}, "b": STR}, "required": ["kind", "b"]}
    schema = {"type": "object", "required": ["kind"], "oneOf": [branch, other]}
    enforced(schema, [{"kind": "a", "a": 1}, {"kind": "b", "b": "x"}], [{"kind": "a", "b": "x"}, 5])
    overlapping = {"type": "object", "oneOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]}
    assert refusal(overlapping).message.startswith("oneOf at $ ")


def test_one_of_objects_excluded_by_a_required_property_the_other_forbids() -> None:
    closed_a = {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False}
    closed_b = {"type": "object", "properties": {"b": INT}, "required": ["b"], "additionalProperties": False}
    enforced({"oneOf": [closed_a, closed_b]}, [{"a": 1}, {"b": 1}], [{}, {"a": 1, "b": 1}])
    # {"a": 1} satisfies both: the open branch requires only what the closed one lists
    open_a = {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a"]}
    assert refusal({"oneOf": [closed_a, open_a]}).message.startswith("oneOf at $ ")


def test_all_of_several_schemas_merges_into_one() -> None:
    schema = {"allOf": [{"type": "integer", "maximum": 5}, {"type": "number", "minimum": 1}]}
    enforced(schema, [1, 5], [0, 9, 1.5, "3"])


def test_all_of_objects_and_refs_merge() -> None:
    schema = {
        "$defs": {"named": {"type": "object", "properties": {"name": STR}, "required": ["name"]}},
        "allOf": [{"$ref": "#/$defs/named"}, {"properties": {"age": INT}, "required": ["age"]}],
    }
    enforced(schema, [{"name": "a", "age": 1}], [{"name": "a"}, {"age": 1}, {"name": "a", "age": "1"}])


def test_all_of_that_cannot_merge_exactly_is_refused() -> None:
    # beside the allOf, additionalProperties forbids every property its own schema does not list
    named = {"type": "object", "properties": {"name": STR}}
    assert refusal({"allOf": [named], "additionalProperties": False}).message.startswith(
        "additionalProperties at $ "
    )
    # the first branch forbids "b", which the second lists: side by side, "b" would be allowed
    closed = {"type": "object", "properties": {"a": INT}, "additionalProperties": False}
    schema = {"allOf": [closed, {"type": "object", "properties": {"b": INT}}]}
    assert refusal(schema).message.startswith("allOf at $ ")
    different = {"allOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "maximum": 7}]}
    assert refusal(different).message.startswith("allOf at $ ")


def test_pattern_properties_matching_every_name_is_additional_properties() -> None:
    schema = {
        "type": "object",
        "properties": {"a": INT},
        "patternProperties": {".*": {"type": "integer", "minimum": 0}},
    }
    enforced(schema, [{"a": 1, "b": 2}, {}], [{"a": -1}, {"b": "s"}, {"b": -1}])


def test_pattern_properties_on_one_line_names_only_where_other_names_are_free() -> None:
    schema = {"type": "object", "patternProperties": {"^.+$": STR}}
    enforced(schema, [{"b": "s"}], [{"b": 1}])
    closed = {**schema, "additionalProperties": False}
    assert refusal(closed).message.startswith("patternProperties at $ ")


def test_pattern_properties_that_pick_names_are_refused() -> None:
    assert refusal({"type": "object", "patternProperties": {"^x-": STR}}).message.startswith(
        "patternProperties at $ "
    )


@pytest.mark.parametrize(
    ("a", "b", "merged"),
    [
        ({"type": "number"}, {"type": "integer"}, {"type": ["integer"]}),
        ({"required": ["a"]}, {"required": ["b", "a"]}, {"required": ["a", "b"]}),
        ({"type": "string"}, {"type": "integer"}, None),
        ({"items": INT}, {"prefixItems": [INT]}, None),
        ({"properties": {"a": INT}}, {"properties": {"a": STR}}, None),
        ({"unevaluatedProperties": False}, {"properties": {"a": INT}}, None),
    ],
)
def test_merge(a: dict[str, Any], b: dict[str, Any], merged: dict[str, Any] | None) -> None:
    assert merge(a, b) == merged


def test_normalized_leaves_the_schema_as_sent() -> None:
    schema = {
        "properties": {"a": INT},
        "required": ["a", "b"],
        "allOf": [{"minProperties": 1}, {"maxProperties": 3}],
    }
    before = repr(schema)
    normalized(schema)
    assert repr(schema) == before


@pytest.mark.parametrize("word", ["dependencies", "dependentRequired"])
def test_property_dependencies_on_a_closed_object(word: str) -> None:
    schema = {
        "type": "object",
        "properties": {"cost": INT, "model": STR, "id": STR},
        "required": ["id"],
        "additionalProperties": False,
        word: {"cost": ["model"]},
    }
    # instances in the schema's order of properties, the order the grammar writes
    accepted = [{"id": "a"}, {"model": "m", "id": "a"}, {"cost": 1, "model": "m", "id": "a"}]
    enforced(schema, accepted, [{"cost": 1, "id": "a"}, {"cost": 1, "model": "m"}, {"id": "a", "x": 1}])


def test_two_dependencies_and_one_on_a_required_property() -> None:
    schema = {
        "type": "object",
        "properties": {"a": INT, "b": INT, "c": INT},
        "required": ["a"],
        "additionalProperties": False,
        "dependentRequired": {"a": ["b"], "c": ["a"]},
    }
    enforced(schema, [{"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}], [{"a": 1}, {"a": 1, "c": 3}, {"b": 2}])


def test_dependencies_on_an_open_object_or_with_schemas_are_refused() -> None:
    open_ = {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}}
    assert refusal(open_).message.startswith("dependentRequired at $ ")
    closed = {"type": "object", "properties": {"a": INT, "b": INT}, "additionalProperties": False}
    schemas = {**closed, "dependentSchemas": {"a": {"required": ["b"]}}}
    assert refusal(schemas).message.startswith("dependentSchemas at $ ")


def test_a_recursive_ref_merged_into_a_branch_is_refused_not_unrolled() -> None:
    schema = {
        "type": "object",
        "properties": {"a": INT, "next": {"$ref": "#"}},
        "anyOf": [{"$ref": "#"}, {"required": ["a"]}],
    }
    assert refusal(schema).message.startswith("properties at $ ")


def test_a_schema_nested_too_deeply_is_invalid_not_a_crash() -> None:
    schema: dict[str, Any] = INT
    for _ in range(3000):
        schema = {"anyOf": [schema]}
    error = refusal(schema)
    assert error.code == "invalid_schema" and "nests too deeply" in error.message
