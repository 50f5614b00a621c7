"""Structured output at the gateway, before submission: what `response_format` and `tools` ask of the
engine (a grammar spec, the tools for the prompt; the other constraint fields: constraint_fields.py).
Never fail open: every schema is checked (check_schema) before anything is queued. What a finished
choice is: openai/structured_result.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from cloud.grammar.schema_support import check_schema
from shared.errors import InvalidRequestError
from shared.grammar_spec import GrammarSpec, canonical_json
from shared.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    ResponseFormat,
)

JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Compile time grows faster than schema size (a 230 KB schema of nested anyOf took 11 s here, a
# 115 KB one 0.8 s) and a compilation cannot be interrupted: bound what one request may ask for.
MAX_SCHEMA_BYTES = 64 * 1024


@dataclass(slots=True)
class Structure:
    """The shape a request's output must take: JSON content (`schema`) or tool calls (`functions`)."""

    spec: GrammarSpec
    schema: dict[str, Any] | None = None  # JSON content must satisfy this
    functions: dict[str, dict[str, Any]] | None = None  # tool name -> parameters schema
    confidence: bool = False  # report field_confidence


@dataclass(slots=True)
class ToolsPrompt:
    """What the chat template needs to know about the tools (empty when tool_choice is "none")."""

    tools: list[dict[str, Any]] | None = None
    choice: str | None = None  # None: the model decides; "required"; or the forced function's name


def checked_schema(schema: object, param: str) -> None:
    """Refuse a schema we cannot enforce, cannot read, or will not spend the time to compile."""
    check_schema(schema, param)
    size = len(canonical_json(schema).encode())
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(
            f"the schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted",
            param=param,
            code="schema_too_large",
        )


def schema_structure(schema: dict[str, Any], param: str, confidence: bool, strict: bool = True) -> Structure:
    """JSON content that must satisfy `schema`, which came from the request field `param`. `strict`
    (the default, as vLLM's guided_json and xgrammar read a schema): no property the schema does not
    list, even where additionalProperties is absent; every instance generated is still valid against
    the schema, and a small model is not invited to invent keys until max_tokens. Off (a client's
    explicit `strict: false`): the schema read exactly as JSON Schema says."""
    checked_schema(schema, param)
    return Structure(GrammarSpec.json_schema(schema, strict=strict, origin=param), schema, None, confidence)


def response_format_structure(rf: ResponseFormat | None, confidence: bool) -> Structure | None:
    """The JSON that response_format json_object or json_schema asks for (None for text; type regex
    is plain text: gateway/openai/constraint_fields.py)."""
    if rf is None or rf.type not in ("json_object", "json_schema"):
        return None
    if rf.type == "json_object" or rf.json_schema is None or rf.json_schema.schema is None:
        if rf.type == "json_schema" and rf.json_schema is None:
            raise InvalidRequestError(
                "response_format type json_schema needs a json_schema object", param="response_format"
            )
        return Structure(GrammarSpec.json_schema(JSON_OBJECT, strict=False), JSON_OBJECT, None, confidence)
    strict = rf.json_schema.strict is not False  # absent: the strict reading, as before 2026-12
    return schema_structure(rf.json_schema.schema, "response_format.json_schema.schema", confidence, strict)


def _parameters(req: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools or []):
        fn = tool.function
        if not fn.name or fn.name in functions:
            raise InvalidRequestError(
                f"tool function names must be non-empty and unique; {fn.name!r} is not",
                param=f"tools[{i}].function.name",
            )
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        checked_schema(params, f"tools[{i}].function.parameters")
        if params.get("type") != "object":
            raise InvalidRequestError(
                "function parameters must be a JSON Schema of type object",
                param=f"tools[{i}].function.parameters",
            )
        functions[fn.name] = params
    return functions


def tools_structure(req: ChatCompletionRequest, confidence: bool) -> tuple[Structure | None, ToolsPrompt]:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None, ToolsPrompt()
    functions = _parameters(req)
    if choice == "none":
        return None, ToolsPrompt()
    listing: list[dict[str, Any]] = msgspec.to_builtins(req.tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        spec = GrammarSpec.tool_calls({name: functions[name]}, required=True, parallel=False)
        return Structure(spec, None, {name: functions[name]}, confidence), ToolsPrompt(listing, name)
    required = choice == "required"
    spec = GrammarSpec.tool_calls(functions, required=required, parallel=req.parallel_tool_calls)
    prompt = ToolsPrompt(listing, "required" if required else None)
    return Structure(spec, None, functions, confidence), prompt
