"""The JSON scanners against Python's json module: the leaf parser finds the same values at spans
that spell them and accepts exactly what json.loads accepts; the container scan finds the end of
any document however it is split."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud.grammar.json_scan import MAX_DEPTH, ContainerScan, Leaf, container_end, find_leaves

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def value_at(document: Any, path: tuple[str | int, ...]) -> Any:
    for part in path:
        document = document[part]
    return document


def test_leaves_of_a_small_document() -> None:
    text = '{"a": [1, "x\\"y"], "b": {}, "c": -2.5e3}'
    assert find_leaves(text) == [
        Leaf(("a", 0), 7, 8, "number"),
        Leaf(("a", 1), 10, 16, "string"),
        Leaf(("b",), 24, 26, "object"),
        Leaf(("c",), 33, 39, "number"),
    ]


def test_root_scalars_and_surrounding_whitespace() -> None:
    assert find_leaves(" true\n") == [Leaf((), 1, 5, "boolean")]
    assert find_leaves("null") == [Leaf((), 0, 4, "null")]
    assert find_leaves("[]") == [Leaf((), 0, 2, "array")]


def test_too_deep_is_not_reported() -> None:
    assert find_leaves("[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH) is not None
    assert find_leaves("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)) is None


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES, st.booleans(), st.sampled_from([None, 1]), st.sampled_from([(", ", ": "), (",", ":")]))
def test_leaves_spell_the_values_json_loads_reads(
    value: Any, ascii_only: bool, indent: int | None, separators: tuple[str, str]
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent, separators=separators)
    document = json.loads(text)
    found = find_leaves(text)
    assert found is not None
    for leaf in found:
        assert json.loads(text[leaf.start : leaf.end]) == value_at(document, leaf.path)
        if leaf.kind == "number":  # the literal is whole: the next character cannot continue it
            assert text[leaf.end : leaf.end + 1] not in set("0123456789.eE+-")


JSONISH = st.lists(
    st.sampled_from(['{"a": ', "{", "}", "[", "]", ",", ":", " ", "\n", '"', '"k"', "\\", "\\u00e9", "é"])
    | st.sampled_from(
        ["1", "0", "-", ".", "e", "+", "01", "true", "nul", "null", "NaN", "\x01", "\t", "\x0c", "\u00a0"]
    ),
    max_size=10,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(JSONISH)
def test_accepts_exactly_what_json_loads_accepts(text: str) -> None:
    def reject(word: str) -> None:
        raise ValueError(word)

    try:
        json.loads(text, parse_constant=reject)
        valid = True
    except ValueError:
        valid = False
    assert (find_leaves(text) is not None) == valid


@settings(max_examples=150, deadline=None)
@given(
    st.lists(JSON_VALUES, max_size=3) | st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=3),
    st.text(max_size=5),
    st.data(),
)
def test_container_end_for_any_split(value: Any, after: str, data: st.DataObject) -> None:
    document = json.dumps(value, ensure_ascii=data.draw(st.booleans()))
    text = document + after
    assert container_end(text, 0) == len(document)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(text)), max_size=8))))
    scan, start, end = ContainerScan(), 0, None
    for cut in [*cuts, len(text)]:
        end = scan.feed(text[start:cut])
        if end is not None:
            assert start + end == len(document)
            break
        start = cut
    assert end is not None


def test_container_end_of_an_unclosed_container_is_none() -> None:
    assert container_end('{"a": "}"', 0) is None
    assert container_end('x{"a": "\\"}"}', 1) == 13


def test_container_scan_must_start_at_a_bracket() -> None:
    with pytest.raises(ValueError):
        ContainerScan().feed('"a"')
