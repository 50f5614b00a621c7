"""Tools in the prompt: our own section for templates that know nothing of tools (past calls and tool
results written in the format the grammar enforces), and Hugging Face's convention for those that do."""

from __future__ import annotations

from cloud.grammar.tool_calls import CALL_SUFFIX, call_prefix
from cloud.grammar.tool_prompt import (
    messages_with_tools,
    template_messages,
    template_takes_tools,
    tools_instruction,
)
from cloud.model.chat_template import CHATML_TEMPLATE, ChatTemplate

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
CONVERSATION = [
    {"role": "user", "content": "Time?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "10:00"},
    {"role": "tool", "tool_call_id": "call_1", "content": "10:01"},
    {"role": "user", "content": "Thanks"},
]


def test_a_template_without_tools_gets_our_section_and_formats() -> None:
    out = messages_with_tools(CONVERSATION, [TOOL], None)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert '"name": "get_time"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    written = call_prefix("get_time") + '{"zone": "UTC"}' + CALL_SUFFIX
    assert out[2]["content"] == written + written  # calls back to back, as the grammar writes them
    assert (
        out[3]["content"]
        == "<tool_response>\n10:00\n</tool_response>\n<tool_response>\n10:01\n</tool_response>"
    )
    assert "tool_calls" not in out[2]
    ChatTemplate(CHATML_TEMPLATE).render(out)  # renders with a template that knows only content


def test_the_section_joins_an_existing_system_message_and_follows_tool_choice() -> None:
    out = messages_with_tools(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], [TOOL], "get_time"
    )
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert 'call of the function "get_time"' in out[0]["content"]
    assert "at least one function call" in tools_instruction([TOOL], "required")


def test_no_tools_leaves_the_conversation_but_still_renders_past_calls() -> None:
    out = messages_with_tools(CONVERSATION, None, None)
    assert out[0]["role"] == "user" and out[1]["content"].startswith("<tool_call>")


def test_templates_that_take_tools_get_hugging_faces_shapes() -> None:
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_takes_tools(CHATML_TEMPLATE)
    out = template_messages(CONVERSATION)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}  # an object, for `tojson`
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"zone": "UTC"}'  # input untouched
