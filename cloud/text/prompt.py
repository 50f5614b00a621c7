"""A conversation as the model's prompt: the chat template, tools in the prompt as the template
allows (cloud/grammar/tool_prompt.py), image_features parts as text blocks (image_text.py), then
token ids. The engine builds its prompts here, and so does a gateway that routes by prefix: the same
messages give both the same token ids, hence the same block hashes."""

from __future__ import annotations

from typing import Any

from cloud.grammar.tool_prompt import messages_with_tools, template_messages, template_takes_tools
from cloud.model.chat_template import ChatTemplate
from cloud.model.tokenizer import Tokenizer
from shared.engine_types import ChatPrompt

from .image_text import flatten_content, locate_images


def render_chat_prompt(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPrompt:
    messages, images = flatten_content(messages)
    text = render_chat_text(template, messages, tools, tool_choice, template_kwargs)
    if not images:
        return ChatPrompt(tokenizer.encode(text, add_special=False))
    ids, offsets = tokenizer.encode_with_offsets(text)
    return ChatPrompt(ids, tuple(locate_images(text, offsets, images)))


def render_chat_text(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt's text for messages whose content is flat (flatten_content's): tools go to the
    template where it takes them, else into the messages."""
    if template_takes_tools(template.source):
        return template.render(template_messages(messages), tools=tools or None, extra=template_kwargs)
    return template.render(messages_with_tools(messages, tools, tool_choice), extra=template_kwargs)
