"""Reading tool calls: exact results for hand-written outputs, and properties holding the streaming
reader equal to the whole-text reader however the text is split into pieces."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud.grammar.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALL_SEPARATOR,
    CALL_SUFFIX,
    ArgumentsDelta,
    CallEnded,
    CallStarted,
    ContentDelta,
    ParsedCall,
    StreamEvent,
    ToolCallStream,
    call_prefix,
    parse_tool_calls,
)


def call_text(name: str, arguments: str) -> str:
    return call_prefix(name) + arguments + CALL_SUFFIX


WEATHER = '{"city": "Paris", "days": 3}'
TRICKY = '{"q": "a}b\\"c\\nd{[", "nested": {"list": [1, {"x": null}], "e": {}}, "u": "\\u00e9 é"}'


# --- the format ---------------------------------------------------------------------------------


def test_call_text_is_the_hermes_format() -> None:
    assert CALL_BEGIN == "<tool_call>\n" and CALL_END == "\n</tool_call>" and CALL_SEPARATOR == ""
    assert call_text("get_weather", WEATHER) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    )


def test_call_prefix_escapes_the_name_as_json() -> None:
    assert call_prefix('a"b') == '<tool_call>\n{"name": "a\\"b", "arguments": '


# --- parse_tool_calls ---------------------------------------------------------------------------


def test_one_call_and_no_content() -> None:
    assert parse_tool_calls(call_text("get_weather", WEATHER)) == (None, [ParsedCall("get_weather", WEATHER)])


def test_two_calls_back_to_back() -> None:
    text = call_text("a", "{}") + CALL_SEPARATOR + call_text("b", '{"x": 1}')
    assert parse_tool_calls(text) == (None, [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')])


def test_content_then_call() -> None:
    text = "Let me check.\n" + call_text("get_weather", WEATHER) + "\n"
    assert parse_tool_calls(text) == ("Let me check.", [ParsedCall("get_weather", WEATHER)])


def test_text_between_and_after_calls_is_content() -> None:
    text = "A " + call_text("a", "{}") + " B " + call_text("b", "{}") + " C"
    assert parse_tool_calls(text) == ("A  B  C", [ParsedCall("a", "{}"), ParsedCall("b", "{}")])


def test_braces_quotes_and_escapes_inside_argument_strings() -> None:
    (content, calls) = parse_tool_calls(call_text("search", TRICKY))
    assert content is None and calls == [ParsedCall("search", TRICKY)]
    assert json.loads(calls[0].arguments)["q"] == 'a}b"c\nd{['


def test_unicode_name_round_trips() -> None:
    assert parse_tool_calls(call_text('météo\n"', "{}")) == (None, [ParsedCall('météo\n"', "{}")])


def test_no_call_at_all() -> None:
    assert parse_tool_calls("  The weather is fine.\n") == ("The weather is fine.", [])
    assert parse_tool_calls("") == (None, [])
    assert parse_tool_calls(" \n ") == (None, [])


def test_text_mentioning_the_tag_is_content() -> None:
    text = "Use <tool or <tool_call> tags, like <tool_call>\nthis."
    assert parse_tool_calls(text) == (text, [])


def test_cut_off_call_is_content_never_a_call() -> None:
    full = "Sure. " + call_text("get_weather", WEATHER)
    for cut in range(len("Sure. "), len(full)):
        assert parse_tool_calls(full[:cut]) == (full[:cut].strip(), []), cut


@pytest.mark.parametrize(
    "block",
    [
        call_prefix("f") + '{"a": tru}' + CALL_SUFFIX,  # brackets balance but the JSON is invalid
        call_prefix("f") + '{"a": NaN}' + CALL_SUFFIX,  # json.loads would accept it; clients would not
        call_prefix("f") + "[1, 2]" + CALL_SUFFIX,  # arguments must be an object
        call_prefix("f") + "{}}\n</tool_cal>",  # wrong end tag
        call_prefix("f") + "{} }" + CALL_END,  # no space allowed before the closing brace
        '<tool_call>\n{"name": f, "arguments": {}}' + CALL_END,  # name is not a JSON string
        '<tool_call> {"name": "f", "arguments": {}}' + CALL_END,  # space instead of newline
    ],
)
def test_malformed_block_is_content(block: str) -> None:
    assert parse_tool_calls(block) == (block.strip(), [])


def test_call_found_after_a_malformed_block() -> None:
    text = CALL_BEGIN + call_text("f", "{}")
    assert parse_tool_calls(text) == ("<tool_call>", [ParsedCall("f", "{}")])


# --- ToolCallStream: exact events ---------------------------------------------------------------


def test_stream_events_for_content_and_one_call() -> None:
    stream = ToolCallStream()
    events = stream.feed("Checking. " + call_text("get_weather", WEATHER) + "\n") + stream.finish()
    assert events == [
        ContentDelta("Checking."),
        CallStarted(0, "get_weather"),
        ArgumentsDelta(0, WEATHER),
        CallEnded(0),
    ]


def test_possible_tag_is_held_back_until_decided() -> None:
    stream = ToolCallStream()
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]
    assert stream.feed("s are fun") == [ContentDelta(" <tools are fun")]
    assert stream.feed(" <tool_call>\n{") == []
    assert stream.feed('"na') == []
    assert stream.finish() == [ContentDelta(' <tool_call>\n{"na')]


def test_call_starts_when_header_is_read_and_arguments_stream_at_once() -> None:
    stream = ToolCallStream()
    assert stream.feed('<tool_call>\n{"name": "f", "arguments"') == []
    assert stream.feed(": ") == [CallStarted(0, "f")]
    assert stream.feed('{"city": "Pa') == [ArgumentsDelta(0, '{"city": "Pa')]
    assert stream.feed('ris"}') == [ArgumentsDelta(0, 'ris"}')]
    assert stream.feed("}\n</tool_") == []  # the suffix is held until it is complete
    assert stream.feed("call>") == [CallEnded(0)]


def test_whitespace_between_calls_is_not_content() -> None:
    stream = ToolCallStream()
    events = stream.feed(call_text("a", "{}") + "\n" + call_text("b", "{}") + "\n ") + stream.finish()
    assert not [e for e in events if isinstance(e, ContentDelta)]
    assert [e for e in events if isinstance(e, CallEnded)] == [CallEnded(0), CallEnded(1)]


def test_call_cut_off_after_start_stays_started_without_end() -> None:
    stream = ToolCallStream()
    events = stream.feed(call_prefix("f") + '{"a": "b') + stream.finish()
    assert events == [CallStarted(0, "f"), ArgumentsDelta(0, '{"a": "b')]


def test_call_cut_off_inside_suffix_is_not_ended_and_not_content() -> None:
    stream = ToolCallStream()
    events = stream.feed(call_prefix("f") + "{}}\n</tool") + stream.finish()
    assert events == [CallStarted(0, "f"), ArgumentsDelta(0, "{}")]


def test_started_call_that_goes_wrong_is_abandoned_and_reading_continues() -> None:
    stream = ToolCallStream()
    events = stream.feed(call_prefix("f") + "{} oops " + call_text("g", "{}")) + stream.finish()
    assert events == [
        CallStarted(0, "f"),
        ArgumentsDelta(0, "{}"),
        ContentDelta("oops"),
        CallStarted(1, "g"),
        ArgumentsDelta(1, "{}"),
        CallEnded(1),
    ]


def test_feed_after_finish_is_an_error() -> None:
    stream = ToolCallStream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


# --- properties: streaming equals the reference for every split ---------------------------------


@dataclass(slots=True)
class Collected:
    content: str = ""
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)


def collect(events: list[StreamEvent]) -> Collected:
    """Folds events, checking their order: deltas only for the open call, nothing empty."""
    out = Collected()
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            out.content += event.text
        elif isinstance(event, CallStarted):
            assert event.index == len(out.names)
            out.names.append(event.name)
            out.arguments.append("")
            out.ended.append(False)
        elif isinstance(event, ArgumentsDelta):
            assert event.text and event.index == len(out.names) - 1 and not out.ended[-1]
            out.arguments[-1] += event.text
        else:
            assert event.index == len(out.names) - 1 and not out.ended[-1]
            out.ended[-1] = True
    return out


def stream_in_pieces(text: str, cuts: list[int]) -> Collected:
    stream = ToolCallStream()
    events: list[StreamEvent] = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        events += stream.feed(text[a:b])
    return collect(events + stream.finish())


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
NAMES = st.text(min_size=1, max_size=12)
# content built from pieces of the format, so near-misses of the tag are common; a header inside
# content would make the text not well formed (the grammar forbids it), so it is filtered out
CONTENT = (
    st.lists(
        st.sampled_from(
            ["a", " ", "\n", "é", "<", "<tool", "<tool_call>", CALL_BEGIN, "{", "}", '"', "</tool_call>"]
        ),
        max_size=6,
    )
    .map("".join)
    .filter(lambda s: CALL_BEGIN + "{" not in s)
)


@st.composite
def arguments_text(draw: st.DrawFn) -> str:
    arguments: dict[str, Any] = draw(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4))
    separators = draw(st.sampled_from([(", ", ": "), (",", ":")]))
    return json.dumps(arguments, ensure_ascii=draw(st.booleans()), separators=separators)


@st.composite
def well_formed(draw: st.DrawFn) -> tuple[str, list[int], list[str], list[ParsedCall]]:
    """(text, offset where each call begins, the content pieces, the calls)."""
    calls = draw(st.lists(st.builds(ParsedCall, NAMES, arguments_text()), max_size=3))
    contents = [draw(CONTENT) for _ in range(len(calls) + 1)]
    text, starts = contents[0], []
    for call, after in zip(calls, contents[1:], strict=True):
        starts.append(len(text))
        text += call_text(call.name, call.arguments) + after
    return text, starts, contents, calls


def splits(text: str) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(text)), max_size=8)


@settings(max_examples=200, deadline=None)
@given(well_formed())
def test_parse_finds_exactly_the_calls_written(
    case: tuple[str, list[int], list[str], list[ParsedCall]],
) -> None:
    text, _, contents, calls = case
    assert parse_tool_calls(text) == ("".join(contents).strip() or None, calls)


@settings(max_examples=200, deadline=None)
@given(well_formed(), st.data())
def test_stream_equals_parse_for_any_split(
    case: tuple[str, list[int], list[str], list[ParsedCall]], data: st.DataObject
) -> None:
    text, _, _, _ = case
    content, calls = parse_tool_calls(text)
    for got in (
        stream_in_pieces(text, data.draw(splits(text))),
        stream_in_pieces(text, list(range(len(text)))),
    ):
        assert got.content == (content or "")
        assert [ParsedCall(n, a) for n, a in zip(got.names, got.arguments, strict=True)] == calls
        assert all(got.ended)


@settings(max_examples=200, deadline=None)
@given(well_formed(), st.data())
def test_stream_of_cut_off_text_agrees_with_parse(
    case: tuple[str, list[int], list[str], list[ParsedCall]], data: st.DataObject
) -> None:
    """Output cut by max_tokens: finished calls agree with the reference; a call whose header was
    read stays started and unfinished (its raw text is the reference's content, not the stream's)."""
    full, starts, _, calls = case
    text = full[: data.draw(st.integers(0, len(full)))]
    got = stream_in_pieces(text, data.draw(splits(text)))
    dangling = len(got.ended) > 0 and not got.ended[-1]
    reference = parse_tool_calls(text[: starts[len(got.names) - 1]] if dangling else text)
    assert got.content == (reference[0] or "")
    finished = [ParsedCall(n, a) for n, a, e in zip(got.names, got.arguments, got.ended, strict=True) if e]
    assert finished == reference[1] == parse_tool_calls(text)[1]
    if dangling:
        assert calls[len(got.names) - 1].arguments.startswith(got.arguments[-1])


@settings(max_examples=200, deadline=None)
@given(well_formed(), st.data())
def test_arguments_are_streamed_as_soon_as_they_are_read(
    case: tuple[str, list[int], list[str], list[ParsedCall]], data: st.DataObject
) -> None:
    full, starts, _, calls = case
    if not calls:
        return
    which = data.draw(st.integers(0, len(calls) - 1))
    args_start = starts[which] + len(call_prefix(calls[which].name))
    args_end = args_start + len(calls[which].arguments)
    cut = data.draw(st.integers(args_start, args_end))
    got = stream_in_pieces(full[:cut], data.draw(splits(full[:cut])))
    assert got.arguments[which] == full[args_start:cut]


FRAGMENTS = st.sampled_from(
    [
        "a",
        " ",
        "\n",
        "<",
        "é",
        CALL_BEGIN,
        '{"name": ',
        '"f"',
        '"x\\"',
        ', "arguments": ',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ":",
        ",",
        "1",
        CALL_END,
        CALL_SUFFIX,
        call_prefix("f"),
        call_text("g", '{"k": "}"}'),
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(FRAGMENTS, max_size=16).map("".join), st.data())
def test_stream_events_do_not_depend_on_the_split_even_for_malformed_text(
    text: str, data: st.DataObject
) -> None:
    whole = stream_in_pieces(text, [])
    assert stream_in_pieces(text, data.draw(splits(text))) == whole
    assert stream_in_pieces(text, list(range(len(text)))) == whole
    # what the stream ended agrees with the reference unless a call was abandoned or cut off
    if all(whole.ended):
        content, calls = parse_tool_calls(text)
        assert whole.content == (content or "")
        assert [ParsedCall(n, a) for n, a in zip(whole.names, whole.arguments, strict=True)] == calls
