"""Structured output at the gateway, after generation: what a finished choice is (JSON content or
tool calls, checked against their schemas, with how sure the model was of each field when asked).

A result says `valid: false` with the reason unless the output is complete and satisfies its
schema; output cut off by max_tokens keeps finish_reason "length" and is never presented as a tool
call or valid JSON.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema_rs

from cloud.grammar.confidence import field_confidence, token_spans
from cloud.grammar.tool_calls import CALL_BEGIN, call_prefix, parse_tool_calls
from cloud.model.detokenizer import IncrementalDecoder
from cloud.model.tokenizer import Tokenizer
from gateway.openai.structured import JSON_OBJECT, Structure
from shared.engine_types import SampleResult
from shared.grammar_spec import canonical_json
from shared.protocol import FunctionCall, StructuredResult, ToolCall

_CUT = "the output was cut off by max_tokens before it was complete"


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    return jsonschema_rs.validator_for(json.loads(schema_json), validate_formats=True)


def schema_error(value: Any, schema: dict[str, Any]) -> str | None:
    """Why `value` fails `schema` (the first error, with where), or None when it satisfies it."""
    for err in _validator(canonical_json(schema)).iter_errors(value):
        where = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in err.instance_path)
        return f"{err.message} (at ${where})" if where else err.message
    return None


@dataclass(slots=True)
class Outcome:
    content: str | None
    tool_calls: list[ToolCall] | None
    finish_reason: str | None
    result: StructuredResult


class TokenEvidence:
    """Per-token text pieces and constrained logprobs of a choice, for field confidence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self.pieces: list[str] = []
        self.logprobs: list[float] = []
        self._pending = 0.0  # logprob of tokens that completed no character yet (part of a UTF-8 char)

    def add(self, samples: Sequence[SampleResult]) -> None:
        for s in samples:
            piece = self._decoder.feed([s.token_id])
            self._pending += s.constrained_logprob or 0.0
            if piece:
                self.pieces.append(piece)
                self.logprobs.append(self._pending)
                self._pending = 0.0

    def confidence(self, text: str, start: int, end: int, base: str = "") -> dict[str, float]:
        """Field confidence of the JSON in text[start:end] (text is the whole output)."""
        spans = token_spans(self.pieces)
        if not spans or spans[-1][1] != len(text):
            return {}  # the pieces do not spell the text (a stop string cut it): report nothing
        local = [(a - start, b - start) for a, b in spans]
        return field_confidence(text[start:end], local, self.logprobs, base)


def finish_json(
    structure: Structure, text: str, finish_reason: str | None, evidence: TokenEvidence | None
) -> Outcome:
    if finish_reason == "length":
        return Outcome(text, None, finish_reason, StructuredResult(valid=False, error=_CUT))
    try:
        value = json.loads(text)
    except ValueError as exc:
        return Outcome(text, None, finish_reason, StructuredResult(valid=False, error=f"not JSON: {exc}"))
    error = schema_error(value, structure.schema or JSON_OBJECT)
    result = StructuredResult(valid=error is None, error=error)
    if structure.confidence and evidence is not None:
        result.field_confidence = evidence.confidence(text, 0, len(text))
    return Outcome(text, None, finish_reason, result)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def finish_tool_calls(
    structure: Structure, text: str, finish_reason: str | None, evidence: TokenEvidence | None
) -> Outcome:
    content, parsed = parse_tool_calls(text)
    if finish_reason == "length":
        # a call cut short is not a call: parse_tool_calls left it in the content
        return Outcome(content, None, finish_reason, StructuredResult(valid=False, error=_CUT))
    functions = structure.functions or {}
    errors: list[str] = []
    calls: list[ToolCall] = []
    confidence: dict[str, float] = {}
    offset = 0
    for i, call in enumerate(parsed):
        error = _call_error(call.name, call.arguments, functions)
        if error:
            errors.append(f"tool call {i}: {error}")
        calls.append(
            ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
        )
        if structure.confidence and evidence is not None:
            start = text.find(call_prefix(call.name), offset) + len(CALL_BEGIN)
            end = text.find(call.arguments, start) + len(call.arguments) + 1  # the closing brace
            offset = end
            confidence |= evidence.confidence(text, start, end, f"/{i}")
    result = StructuredResult(valid=not errors, error="; ".join(errors) or None)
    if structure.confidence:
        result.field_confidence = confidence
    if calls:
        return Outcome(content, calls, "tool_calls", result)
    return Outcome(content, None, finish_reason, result)


def _call_error(name: str, arguments: str, functions: dict[str, dict[str, Any]]) -> str | None:
    if name not in functions:
        return f"unknown function {name!r}"
    try:
        args = json.loads(arguments)
    except ValueError as exc:
        return f"arguments are not JSON: {exc}"
    return schema_error(args, functions[name])


def finish(
    structure: Structure, text: str, finish_reason: str | None, evidence: TokenEvidence | None
) -> Outcome:
    if structure.functions is not None:
        return finish_tool_calls(structure, text, finish_reason, evidence)
    return finish_json(structure, text, finish_reason, evidence)


class ChoiceTrace:
    """A structured choice as its outputs arrive (streaming): its text and the confidence evidence."""

    def __init__(self, structure: Structure, tokenizer: Tokenizer) -> None:
        self.structure = structure
        self.text = ""
        self.evidence = TokenEvidence(tokenizer) if structure.confidence else None

    def add(self, text: str, samples: Sequence[SampleResult]) -> None:
        self.text += text
        if self.evidence is not None:
            self.evidence.add(samples)

    def finish(self, finish_reason: str | None) -> Outcome:
        return finish(self.structure, self.text, finish_reason, self.evidence)
