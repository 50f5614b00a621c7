"""Older drafts (dialects.py): a draft 4, 6, 7 or 2019-09 schema passes check_schema where its
keywords mean what 2020-12's do, and the grammar compiled from it accepts exactly what the schema,
read in its own draft by jsonschema_rs, accepts among the probe instances."""

from __future__ import annotations

import pytest

from cloud.grammar.dialects import CURRENT, dialect, to_current
from cloud.grammar.schema_support import check_schema

from .test_schema_support import PARAM, enforced, refusal

D4 = "http://json-schema.org/draft-04/schema#"
D6 = "http://json-schema.org/draft-06/schema#"
D7 = "http://json-schema.org/draft-07/schema"
D2019 = "https://json-schema.org/draft/2019-09/schema"
INT = {"type": "integer"}


@pytest.mark.parametrize("uri", [D4, D6, D7, D2019, D4.rstrip("#"), CURRENT])
def test_known_drafts_are_accepted(uri: str) -> None:
    enforced({"$schema": uri, "type": "integer", "minimum": 1}, [1, 7], [0, "1"])


def test_draft4_boolean_exclusive_bounds_become_numbers() -> None:
    schema = {"$schema": D4, "type": "integer", "minimum": 1, "exclusiveMinimum": True, "maximum": 5}
    enforced({**schema, "exclusiveMaximum": True}, [2, 4], [1, 5, 0, 6])
    enforced({**schema, "exclusiveMaximum": False}, [2, 5], [1, 6])
    assert to_current({**schema, "exclusiveMaximum": True}) == {
        "$schema": CURRENT,
        "type": "integer",
        "exclusiveMinimum": 1,
        "exclusiveMaximum": 5,
    }


def test_draft4_ids_on_every_node_pass_when_no_ref_lies_under_them() -> None:
    # what generated draft 4 schemas look like: an id on each node
    schema = {
        "$schema": D4,
        "id": "http://example.com/root.json",
        "type": "object",
        "properties": {"a": {"id": "/properties/a", "type": "string", "maxLength": 3}},
        "required": ["a"],
        "additionalProperties": False,
    }
    enforced(schema, [{"a": "abc"}], [{"a": "abcd"}, {}])


def test_nested_id_above_a_ref_is_still_refused() -> None:
    schema = {
        "$schema": D4,
        "definitions": {"n": INT},
        "type": "object",
        "properties": {
            "a": {"id": "http://x.com/a", "type": "object", "properties": {"b": {"$ref": "#/definitions/n"}}}
        },
    }
    assert refusal(schema).message.startswith("$id at $.properties.a ")


def test_fragment_ids_become_anchors_or_go() -> None:
    schema = {
        "$schema": D7,
        "definitions": {"n": {"$id": "#count", **INT}, "p": {"$id": "#/definitions/p", "type": "string"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/definitions/n"}, "b": {"$ref": "#/definitions/p"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    enforced(schema, [{"a": 1, "b": "x"}], [{"a": "1", "b": "x"}, {"a": 1, "b": 2}])
    assert to_current(schema)["definitions"]["n"] == {"$anchor": "count", **INT}


def test_keywords_beside_a_ref_are_ignored_up_to_draft7() -> None:
    # in draft 7 the maximum does nothing (2020-12 applies it, and the checker refuses it there)
    schema = {
        "$schema": D7,
        "definitions": {"n": INT},
        "type": "object",
        "properties": {"a": {"$ref": "#/definitions/n", "maximum": 3}},
        "required": ["a"],
        "additionalProperties": False,
    }
    enforced(schema, [{"a": 9}, {"a": 1}], [{"a": "x"}, {}])
    newer = {**schema, "$schema": D2019, "$defs": schema["definitions"]}
    assert refusal(newer).message.startswith("maximum at $.properties.a ")


@pytest.mark.parametrize("uri", [D4, D2019])
def test_items_array_becomes_prefix_items(uri: str) -> None:
    tuple_ = {"$schema": uri, "type": "array", "items": [INT, {"type": "string"}]}
    enforced({**tuple_, "additionalItems": False}, [[1, "x"], [1]], [[1, "x", 2], ["x"], [1, 2]])
    enforced({**tuple_, "additionalItems": {"type": "boolean"}}, [[1, "x", True]], [[1, "x", 3]])


def test_additional_items_beside_one_items_schema_does_nothing_and_goes() -> None:
    schema = {"$schema": D4, "type": "array", "items": INT, "additionalItems": False, "maxItems": 3}
    enforced(schema, [[1, 2, 3]], [[1, "x"], [1, 2, 3, 4]])


def test_nested_copy_of_the_root_draft_goes_and_another_draft_is_refused() -> None:
    schema = {"$schema": D4, "definitions": {"n": {"$schema": D4, **INT}}, "$ref": "#/definitions/n"}
    enforced(schema, [3], ["3"])
    other = {**schema, "definitions": {"n": {"$schema": D7, **INT}}}
    assert refusal(other).message.startswith("$schema at $.definitions.n ")


def test_dependencies_is_refused_by_its_own_name() -> None:
    schema = {
        "$schema": D4,
        "type": "object",
        "properties": {"a": INT, "b": INT},
        "dependencies": {"a": ["b"]},
    }
    error = refusal(schema)
    assert error.code == "unsupported_schema_feature" and error.message.startswith("dependencies at $ ")


def test_malformed_in_its_own_draft_is_invalid() -> None:
    # draft 4's exclusiveMinimum is a boolean: a number there is no draft 4 schema
    error = refusal({"$schema": D4, "type": "integer", "minimum": 1, "exclusiveMinimum": 2})
    assert error.code == "invalid_schema"


def test_the_original_is_never_changed() -> None:
    schema = {"$schema": D4, "id": "x", "type": "array", "items": [INT], "additionalItems": False}
    before = repr(schema)
    check_schema(schema, PARAM)
    to_current(schema)
    assert repr(schema) == before


@pytest.mark.parametrize(
    ("uri", "name"),
    [
        (D4, "draft-04"),
        (D7, "draft-07"),
        (D2019 + "#", "2019-09"),
        ("http://json-schema.org/draft-03/schema#", None),
    ],
)
def test_dialect_names(uri: str, name: str | None) -> None:
    assert dialect({"$schema": uri}) == name
    assert dialect({}) == "2020-12"
