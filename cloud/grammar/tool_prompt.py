"""Putting tools into the prompt. A chat template that refers to `tools` gets them as Hugging Face
templates expect; for one that does not (SmolLM2's), we write the tools and the call format into the
system message ourselves, render past calls in that format and tool results as user turns. The
format is the one the grammar enforces and tool_calls.py reads (Hermes-style <tool_call> blocks).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from .tool_calls import CALL_SEPARATOR, CALL_SUFFIX, call_prefix

_USES_TOOLS = re.compile(r"\btools\b")


def template_takes_tools(source: str) -> bool:
    return bool(_USES_TOOLS.search(source))


def tools_instruction(tools: list[dict[str, Any]], choice: str | None) -> str:
    """The system-prompt section that describes the tools. `choice`: None (the model decides),
    "required", or the name of the function that must be called."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if choice is None:
        must = "Call functions only when they help with the request; otherwise answer in plain text."
    elif choice == "required":
        must = "Answer with at least one function call and nothing else."
    else:
        must = f"Answer with a call of the function {json.dumps(choice)} and nothing else."
    example = call_prefix("function name") + '{"argument name": "value"}' + CALL_SUFFIX
    return (
        "# Tools\n\nYou can call the functions described as JSON Schema inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To call a function, write its name and arguments as a JSON object inside <tool_call></tool_call>"
        f" tags, one block per call:\n{example}\n{must}"
    )


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return call_prefix(str(fn.get("name", ""))) + args + CALL_SUFFIX


def messages_with_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, choice: str | None
) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools (see the module docstring)."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if after_tool:  # consecutive results: one user turn
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            after_tool = True
            continue
        after_tool = False
        m = dict(m)
        if m.get("tool_calls"):
            blocks = CALL_SEPARATOR.join(_call_text(c) for c in m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
        out.append(m)
    if tools:
        section = tools_instruction(tools, choice)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that takes tools: past call arguments as objects, as such templates
    expect (they write them with `tojson`)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_parsed_arguments(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    with contextlib.suppress(TypeError, ValueError):  # not JSON: the template gets the text as sent
        fn["arguments"] = json.loads(fn.get("arguments") or "{}")
    return {**call, "function": fn}
