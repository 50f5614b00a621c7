"""Whether a grammar can ever finish, read from xgrammar's own parse of it: a rule that can only
recurse derives no finite string, and a request whose root cannot finish is refused before decoding."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from cloud.grammar.productive import unproductive_rules


@pytest.mark.parametrize(
    ("grammar", "stuck"),
    [
        ('root ::= "a" root', ["root"]),
        ("root ::= root", ["root"]),
        ('root ::= x y\nx ::= "a"\ny ::= "b" y', ["root", "y"]),
        ('root ::= "a" | root "b"', []),  # left recursion with a way out
        ('root ::= x\nx ::= "a" x | ""', []),
        ('root ::= [a-z]+ "x\\"y" (b)? | c*\nb ::= "q"{2,3}\nc ::= [^\\]]', []),
        ('root ::= "(" root ")" | "()"', []),
    ],
)
def test_rules_that_can_only_recurse_are_named(grammar: str, stuck: list[str]) -> None:
    assert unproductive_rules(str(xgr.Grammar.from_ebnf(grammar))) == stuck


@pytest.mark.parametrize(
    ("regex", "finishes"), [("[0-9]{3}-(ab|c)*", True), ("a+", True), ("[^\\x00-\\U0010FFFF]", False)]
)
def test_a_regex_of_no_string_is_found(regex: str, finishes: bool) -> None:
    stuck = unproductive_rules(str(xgr.Grammar.from_regex(regex)))
    assert stuck is not None and ("root" not in stuck) is finishes


def test_text_it_cannot_read_proves_nothing() -> None:
    assert unproductive_rules("root ::= ((root_1 @@@))") is None
    assert unproductive_rules("not a grammar") is None
