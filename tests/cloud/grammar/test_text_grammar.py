"""Plain-text constraints (regex, EBNF/GBNF grammar, a list of choices): what their grammars let the
model write, compiled by our GrammarCompiler for the real model's vocabulary, and the 400s that name
the field for a source that cannot be compiled or is too large."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from cloud.grammar.compiler import GrammarCompiler
from cloud.grammar.text_grammar import MAX_SOURCE_BYTES, choice_spec, ebnf_spec, regex_spec
from cloud.model.loading import LoadedModel
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec


@pytest.fixture(scope="module")
def compiler(loaded_model: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(loaded_model.tokenizer, loaded_model.tokenizer.vocab_size, cache_size=8)


def writes(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """The grammar lets the model write exactly `text` and then stop."""
    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    return bool(matcher.accept_string(text) and matcher.is_completed())


def test_a_regex_allows_only_full_matches(compiler: GrammarCompiler) -> None:
    spec = regex_spec("[0-9]{3}-[0-9]{4}", "guided_regex")
    assert spec.kind == "regex" and spec.origin == "guided_regex"
    assert writes(compiler, spec, "555-1234")
    assert not writes(compiler, spec, "555-123")  # a prefix is not a match
    assert not writes(compiler, spec, "5551234")
    assert not writes(compiler, spec, "555-12345")


def test_a_gbnf_grammar_allows_only_its_sentences(compiler: GrammarCompiler) -> None:
    spec = ebnf_spec('root ::= "A" | "B" digit\ndigit ::= [0-9]', "grammar")
    assert writes(compiler, spec, "A") and writes(compiler, spec, "B7")
    assert not writes(compiler, spec, "B") and not writes(compiler, spec, "C")


def test_a_choice_is_exactly_one_literal_even_with_quotes_and_escapes(compiler: GrammarCompiler) -> None:
    choices = ['say "yes"', "no\\maybe", "line\nbreak", "ünï"]
    spec = choice_spec(choices, "guided_choice")
    for c in choices:
        assert writes(compiler, spec, c), c
    assert not writes(compiler, spec, "say")
    assert not writes(compiler, spec, 'say "yes"no\\maybe')


def test_equal_sources_compile_once(compiler: GrammarCompiler) -> None:
    first = compiler.compile(regex_spec("x+y", "guided_regex"))
    assert compiler.compile(regex_spec("x+y", "structured_outputs.regex")) is first  # origin not in key
    # a regex and a grammar with the same text are different constraints
    assert GrammarSpec.regex("a", "p").key != GrammarSpec.ebnf("a", "p").key


@pytest.mark.parametrize(
    ("check", "source", "code", "reason"),
    [
        (regex_spec, "(ab", "invalid_regex", "parenthesis is not closed"),
        (regex_spec, "(?=a)b", "invalid_regex", "Lookahead is not supported"),
        (regex_spec, "a{3,1}", "invalid_regex", "Lower bound is larger than upper bound"),
        (regex_spec, "", "invalid_regex", "empty"),
        (ebnf_spec, "root ::= foo", "invalid_grammar", 'Rule "foo" is not defined'),
        (ebnf_spec, 'start ::= "a"', "invalid_grammar", 'root rule with name "root" is not found'),
        (ebnf_spec, 'root ::= "a" |', "invalid_grammar", "Expect element"),
        (ebnf_spec, 'root ::= "a" root', "invalid_grammar", "matches no finite string"),
        (regex_spec, "[^\\x00-\\U0010FFFF]", "invalid_regex", "matches no finite string"),
    ],
)
def test_a_bad_source_is_a_400_naming_the_field_with_the_reason(
    compiler: GrammarCompiler, check: object, source: str, code: str, reason: str
) -> None:
    # the gateway bounds the source; the engine's compile, before the request is queued, parses it
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(check(source, "the_field"))  # type: ignore[operator]
    assert err.value.param == "the_field" and err.value.code == code
    assert reason in str(err.value) and ".cc:" not in str(err.value)  # xgrammar's log prefix is cut


def test_a_source_past_the_bound_is_refused_before_parsing() -> None:
    big = "a" * (MAX_SOURCE_BYTES + 1)
    for check, source in ((regex_spec, big), (ebnf_spec, f'root ::= "{big}"')):
        with pytest.raises(InvalidRequestError) as err:
            check(source, "f")
        assert err.value.code == "grammar_too_large" and err.value.param == "f"
    with pytest.raises(InvalidRequestError) as err:
        choice_spec(["x" * 1024] * 65, "guided_choice")
    assert err.value.code == "grammar_too_large" and err.value.param == "guided_choice"


@pytest.mark.parametrize("choices", [[], ["a", ""]])
def test_an_empty_choice_list_or_choice_is_refused(choices: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        choice_spec(choices, "guided_choice")
    assert err.value.param == "guided_choice"
