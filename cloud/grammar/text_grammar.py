"""Plain-text constraints: a regular expression, an EBNF/GBNF grammar, or one of a list of choices.

Where the request enters (the gateway, which carries no grammar engine) they are bounded in size and
made plain specs; the engine parses and compiles them on its grammar threads (compiler.py) before the
request is queued, so a bad pattern or grammar is still a 400 naming the field with xgrammar's reason,
before any token is decoded.
"""

from __future__ import annotations

import json

from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec

# As for schemas (gateway/openai/structured.py): compilation time grows with the source and cannot
# be interrupted, so bound what one request may ask for.
MAX_SOURCE_BYTES = 64 * 1024


def _bounded(source: str, what: str, param: str) -> None:
    size = len(source.encode())
    if size > MAX_SOURCE_BYTES:
        raise InvalidRequestError(
            f"the {what} is {size} bytes; at most {MAX_SOURCE_BYTES} are accepted",
            param=param,
            code="grammar_too_large",
        )


def regex_spec(pattern: str, param: str) -> GrammarSpec:
    """The output must match `pattern` in full (xgrammar's regex: no lookaround, no backreferences)."""
    _bounded(pattern, "regex", param)
    if not pattern:
        raise InvalidRequestError("the regex is empty", param=param, code="invalid_regex")
    return GrammarSpec.regex(pattern, param)


def ebnf_spec(grammar: str, param: str) -> GrammarSpec:
    """The output must be a sentence of `grammar` (EBNF as xgrammar reads it, which takes llama.cpp's
    GBNF), starting from the rule `root`."""
    _bounded(grammar, "grammar", param)
    return GrammarSpec.ebnf(grammar, param)


def choice_spec(choices: list[str], param: str) -> GrammarSpec:
    """The output must be exactly one of `choices`: a grammar whose root is their alternation. JSON's
    string escapes (\\" \\\\ \\n \\t \\uXXXX) are EBNF's too, so json.dumps writes each literal."""
    if not choices:
        raise InvalidRequestError("the list of choices is empty", param=param)
    if any(not c for c in choices):
        raise InvalidRequestError("a choice must not be an empty string", param=param)
    grammar = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return ebnf_spec(grammar, param)
