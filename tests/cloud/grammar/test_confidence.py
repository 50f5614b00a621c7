"""Per-field confidence: hand-computed values for small documents, the pointer format, and the rules
for which tokens count toward a leaf."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud.grammar.confidence import field_confidence, json_pointer, token_spans
from cloud.grammar.json_scan import find_leaves


def confidence(pieces: list[str], logprobs: list[float], base: str = "") -> dict[str, float]:
    return field_confidence("".join(pieces), token_spans(pieces), logprobs, base)


def p(*logprobs: float) -> float:
    return float(f"{math.exp(sum(logprobs)):.6g}")


def test_token_spans_are_cumulative_offsets() -> None:
    assert token_spans(["{", '"a"', "", ": 1}"]) == [(0, 1), (1, 4), (4, 4), (4, 8)]
    assert token_spans([]) == []


def test_string_leaf_counts_the_tokens_holding_its_quotes() -> None:
    # the first token holds the opening quote, the third the closing one; "}" writes no leaf
    got = confidence(['{"city": "', "Par", 'is"', "}"], [-0.1, -0.2, -0.3, -0.4])
    assert got == {"/city": p(-0.1, -0.2, -0.3)}


def test_number_leaf_includes_the_token_that_ends_it() -> None:
    got = confidence(['{"n": ', "4", "2", "}"], [-0.5, -0.1, -0.2, -0.3])
    assert got == {"/n": p(-0.1, -0.2, -0.3)}


def test_number_delimiter_is_one_character_only() -> None:
    # "," ends 1; " " after the comma is not part of any leaf of 1; `true` is written by its own tokens
    got = confidence(['{"a": ', "1", ",", ' "b": ', "true", "}"], [-1.0, -0.1, -0.2, -0.4, -0.3, -0.7])
    assert got == {"/a": p(-0.1, -0.2), "/b": p(-0.3)}


def test_token_overlapping_two_leaves_counts_for_both() -> None:
    got = confidence(["[", "true,false", "]"], [-0.1, -0.2, -0.3])
    assert got == {"/0": p(-0.2), "/1": p(-0.2)}


def test_arrays_nested_objects_and_empty_containers() -> None:
    text = '{"a": [1, {"b": null}, []], "c": {}, "d": [["x"]]}'
    got = field_confidence(text, [(0, len(text))], [-0.25])
    assert got == {"/a/0": p(-0.25), "/a/1/b": p(-0.25), "/a/2": p(-0.25), "/c": p(-0.25), "/d/0/0": p(-0.25)}


def test_pointer_escapes_tilde_and_slash() -> None:
    text = '{"a/b": {"m~n": 1, "~1": 2, "": 3}}'
    got = field_confidence(text, [], [])
    assert got == {"/a~1b/m~0n": 1.0, "/a~1b/~01": 1.0, "/a~1b/": 1.0}
    assert json_pointer(["a/b", 0, "~"]) == "/a~1b/0/~0"


def test_root_scalar_has_the_empty_pointer_and_base_prefixes_every_key() -> None:
    assert confidence(['"yes"'], [-0.1]) == {"": p(-0.1)}
    got = confidence(['{"x": ', "true}"], [-0.1, -0.2], base="/0/arguments")
    assert got == {"/0/arguments/x": p(-0.2)}


def test_root_number_counts_an_empty_end_token() -> None:
    # an end-of-sequence token decodes to "" at the end; it is where the number was finished
    assert field_confidence("42", [(0, 2), (2, 2)], [-0.1, -0.2]) == {"": p(-0.1, -0.2)}


def test_empty_token_counts_toward_the_character_after_it() -> None:
    # byte-fallback: the first bytes of "é" decode to "", the last one to the whole character
    text = '{"k": "é", "n": 1}'
    at = text.index("é")
    spans = [(0, at), (at, at), (at, at + 1), (at + 1, len(text))]
    got = field_confidence(text, spans, [-0.1, -0.2, -0.3, -0.4])
    assert got == {"/k": p(-0.1, -0.2, -0.3, -0.4), "/n": p(-0.4)}


def test_unicode_and_escapes_use_code_point_offsets() -> None:
    pieces = ['{"😀": "', '\\u00e9\\"😀', '", "x": ', "7", "}"]
    got = confidence(pieces, [-0.1, -0.2, -0.3, -0.4, -0.5])
    assert got == {"/😀": p(-0.1, -0.2, -0.3), "/x": p(-0.4, -0.5)}


def test_whitespace_around_the_value_is_tolerated() -> None:
    assert confidence([' \n{"a": ', "null", "} \n"], [-0.1, -0.2, -0.3]) == {"/a": p(-0.2)}


def test_duplicate_key_reports_the_value_json_loads_keeps() -> None:
    text = '{"a": {"x": 1}, "a": 2}'
    assert field_confidence(text, [], []) == {"/a": 1.0}


def test_probability_is_clamped_and_rounded() -> None:
    assert confidence(['{"a": ', "1}"], [0.0, 1e-9]) == {"/a": 1.0}
    assert confidence(['{"a": ', "1}"], [0.0, -math.inf]) == {"/a": 0.0}
    assert confidence(['{"a": ', "1}"], [0.0, math.log(0.12345678)]) == {"/a": 0.123457}
    # six significant digits, so an unlikely long string is small, never 0
    assert confidence(['{"a": ', '"xyz"}'], [0.0, math.log(1.23456789e-7)]) == {"/a": 1.23457e-7}


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        '{"a": 1',
        '{"a": 1}}',
        '{"a": 1,}',
        "[1 2]",
        "01",
        "1.",
        "-",
        "NaN",
        "{'a': 1}",
        '"\n"',
        "tru",
        '{"a" 1}',
        "[1,]",
        '{"a": 1} x',
        '"\\x"',
        "1e",
        "+1",
        '{"a": "b}',
    ],
)
def test_invalid_json_gives_nothing(text: str) -> None:
    assert field_confidence(text, token_spans([text]), [-0.1]) == {}


def test_misaligned_inputs_are_errors() -> None:
    with pytest.raises(ValueError):
        field_confidence("1", [(0, 1)], [])
    with pytest.raises(ValueError):
        field_confidence("[1, 2]", [(3, 5), (0, 3)], [-0.1, -0.1])
    with pytest.raises(ValueError):
        field_confidence("1", [(0, 1)], [math.nan])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def leaves(value: Any, pointer: str = "") -> dict[str, Any]:
    """The expected leaves, walked from json.loads' result."""
    if isinstance(value, dict) and value:
        return {
            k: v
            for key, item in value.items()
            for k, v in leaves(item, pointer + json_pointer([key])).items()
        }
    if isinstance(value, list) and value:
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{pointer}/{i}").items()}
    return {pointer: value}


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES, st.booleans(), st.sampled_from([None, 0, 2]), st.data())
def test_every_leaf_is_reported_and_certain_text_is_certain(
    value: Any, ascii_only: bool, indent: int | None, data: st.DataObject
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    got = confidence(pieces, [0.0] * len(pieces), base="/r")
    assert got == {"/r" + k: 1.0 for k in leaves(json.loads(text))}


def naive_confidence(text: str, spans: list[tuple[int, int]], logprobs: list[float]) -> dict[str, float]:
    """The definition, token by token against leaf by leaf: the reference for the bisection."""
    out: dict[str, float] = {}
    for leaf in find_leaves(text) or []:
        start, end = leaf.start, leaf.end + (leaf.kind == "number")
        total = math.fsum(
            lp for (a, b), lp in zip(spans, logprobs, strict=True) if a < end and start < max(b, a + 1)
        )
        out[json_pointer(leaf.path)] = float(f"{min(1.0, math.exp(total)):.6g}")
    return out


@settings(max_examples=150, deadline=None)
@given(JSON_VALUES, st.data())
def test_bisection_equals_the_token_by_token_definition(value: Any, data: st.DataObject) -> None:
    text = json.dumps(value, ensure_ascii=data.draw(st.booleans()))
    # repeated cut points make empty tokens, as byte-fallback tokens do
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    logprobs = data.draw(st.lists(st.floats(-5.0, 0.0), min_size=len(pieces), max_size=len(pieces)))
    spans = token_spans(pieces)
    assert field_confidence(text, spans, logprobs) == naive_confidence(text, spans, logprobs)
