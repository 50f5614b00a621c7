"""Plain-text constraints: a regular expression, an EBNF/GBNF grammar, or one of a list of choices.

They are checked where the request enters (the gateway), before anything is queued: xgrammar parses
the source without a tokenizer in well under a millisecond for the sizes we accept, so a bad pattern
or grammar is a 400 naming the field with xgrammar's reason, never a failure inside the engine. The
grammar is compiled for the tokenizer later, on the engine's grammar threads (compiler.py).
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from shared.errors import InvalidRequestError

from .spec import GrammarSpec

# As for schemas (gateway/openai/structured.py): compilation time grows with the source and cannot
# be interrupted, so bound what one request may ask for.
MAX_SOURCE_BYTES = 64 * 1024
# xgrammar prefixes its C++ messages with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def xgrammar_reason(exc: Exception) -> str:
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


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
    try:
        xgr.Grammar.from_regex(pattern)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequestError(
            f"the regex cannot be compiled: {xgrammar_reason(exc)}", param=param, code="invalid_regex"
        ) from None
    return GrammarSpec.regex(pattern, param)


def ebnf_spec(grammar: str, param: str) -> GrammarSpec:
    """The output must be a sentence of `grammar` (EBNF as xgrammar reads it, which takes llama.cpp's
    GBNF), starting from the rule `root`."""
    _bounded(grammar, "grammar", param)
    try:
        xgr.Grammar.from_ebnf(grammar)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequestError(
            f"the grammar cannot be compiled: {xgrammar_reason(exc)}", param=param, code="invalid_grammar"
        ) from None
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
