"""The tool-call grammar: what it lets a model write for each tool_choice, on a one-character-per-token
vocabulary, and that it writes exactly what tool_calls.py reads back."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from cloud.grammar.tool_calls import CALL_SEPARATOR, CALL_SUFFIX, ParsedCall, call_prefix, parse_tool_calls
from cloud.grammar.tool_grammar import tool_call_structural_tag
from shared.grammar_spec import GrammarSpec

VOCAB = [chr(i) for i in range(32, 127)] + ["\n", ""]
EOS = len(VOCAB) - 1
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "day": {"type": "string", "format": "date"}},
    "required": ["city", "day"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
FUNCTIONS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), max_threads=1)


def call(name: str, args: dict[str, object]) -> str:
    return call_prefix(name) + json.dumps(args) + CALL_SUFFIX


def writes(compiler: xgr.GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(tool_call_structural_tag(spec.source)))
    return bool(matcher.accept_string(text) and matcher.accept_token(EOS))


PARIS = call("get_weather", {"city": "Paris", "day": "2024-02-29"})
UTC = call("get_time", {"zone": "UTC"})


def test_required_allows_only_well_formed_calls(compiler: xgr.GrammarCompiler) -> None:
    spec = GrammarSpec.tool_calls(FUNCTIONS, required=True, parallel=True)
    assert writes(compiler, spec, PARIS)
    assert writes(compiler, spec, PARIS + CALL_SEPARATOR + UTC)
    assert parse_tool_calls(PARIS + CALL_SEPARATOR + UTC) == (
        None,
        [
            ParsedCall("get_weather", '{"city": "Paris", "day": "2024-02-29"}'),
            ParsedCall("get_time", '{"zone": "UTC"}'),
        ],
    )
    assert not writes(compiler, spec, "")  # at least one call
    assert not writes(compiler, spec, "Sure! " + PARIS)  # nothing but calls
    assert not writes(
        compiler, spec, call("get_weather", {"city": "Paris", "day": "2023-02-29"})
    )  # no such day
    assert not writes(compiler, spec, call("get_time", {"zone": "PST"}))
    assert not writes(compiler, spec, call("get_weather", {"city": "Paris"}))  # a required argument missing
    assert not writes(compiler, spec, call("set_alarm", {}))  # not a given function
    assert not writes(compiler, spec, PARIS.replace('{"city": "Paris"', '{ "city": "Paris"'))  # no padding


def test_parallel_false_allows_one_call(compiler: xgr.GrammarCompiler) -> None:
    spec = GrammarSpec.tool_calls(FUNCTIONS, required=True, parallel=False)
    assert writes(compiler, spec, UTC)
    assert not writes(compiler, spec, UTC + CALL_SEPARATOR + PARIS)


def test_auto_allows_text_calls_or_both(compiler: xgr.GrammarCompiler) -> None:
    spec = GrammarSpec.tool_calls(FUNCTIONS, required=False, parallel=True)
    assert writes(compiler, spec, "It is sunny.")
    assert writes(compiler, spec, "Let me look.\n" + PARIS)
    assert not writes(
        compiler, spec, "Let me look.\n" + call("get_time", {"zone": "PST"})
    )  # a call must be valid


def test_a_named_function_is_the_only_one_allowed(compiler: xgr.GrammarCompiler) -> None:
    spec = GrammarSpec.tool_calls({"get_time": TIME}, required=True, parallel=False)
    assert writes(compiler, spec, UTC)
    assert not writes(compiler, spec, PARIS)
