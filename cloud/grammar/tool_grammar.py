"""The grammar of tool calls: each call is a tagged JSON object whose arguments follow the function's
parameter schema, written exactly as tool_calls.py reads it back (one format, two directions).

The arguments grammar is built from the schema with compact separators (no whitespace padding) and
embedded as EBNF: xgrammar's structural-tag JSON format would allow any whitespace.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from .formats import grammar_schema
from .tool_calls import CALL_BEGIN, CALL_SEPARATOR, CALL_SUFFIX, call_prefix


def _call_tag(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    schema = json.dumps(grammar_schema(parameters))
    arguments = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return {
        "type": "tag",
        "begin": call_prefix(name),
        "content": {"type": "grammar", "grammar": str(arguments)},
        "end": CALL_SUFFIX,
    }


def tool_call_structural_tag(source: str) -> str:
    """The structural tag (JSON text) for a `tool_calls` GrammarSpec source."""
    spec = json.loads(source)
    tags = [_call_tag(name, params) for name, params in spec["functions"].items()]
    once = not spec["parallel"]
    if spec["required"]:
        # only calls: the output opens with the first one
        fmt: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": once,
        }
    else:
        # free text until the model opens a call; then the call must be well formed
        fmt = {
            "type": "triggered_tags",
            "triggers": [CALL_BEGIN.strip()],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": once,
        }
    return json.dumps({"type": "structural_tag", "format": fmt})
