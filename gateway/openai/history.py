"""When a chat drops old turns to fit the context, and how much room it keeps for the answer; which
turns go is cloud/text/history.py's. Written once in front of every backend (the engine in this
process or its child, the fleet's workers), where the chat is rendered.

- Who asks: the server's `--context-overflow drop_old_turns`, or the request itself
  (`ctxfuse.drop_old_turns`, true or false; the Responses API's `truncation` becomes it).
- The room kept for the answer: the request's max_completion_tokens or max_tokens (as vLLM checks
  prompt plus max_tokens against the context). Without one, an eighth of the context, the least
  truncate_middle leaves (LiteLLM's trim_messages keeps a quarter); the answer may then take all the
  prompt leaves.
- When the system messages and the latest turn alone leave no room (max_tokens, or one token), the
  request is refused with context_length_exceeded: cutting into the question or the instructions
  would change what was asked (truncate_middle does that, for a server that wants it).
"""

from __future__ import annotations

from typing import Any

from cloud.text.history import FittedChat, fit_history
from gateway.openai.structured import ToolsPrompt
from gateway.seam import Backend
from shared.engine_types import ChatPrompt
from shared.errors import ContextLengthExceededError
from shared.protocol import ChatCompletionRequest, ChatMessage

DROP_OLD_TURNS = "drop_old_turns"  # the --context-overflow policy


def drops_old_turns(req: ChatCompletionRequest, backend: Backend) -> bool:
    asked = req.ctxfuse.drop_old_turns if req.ctxfuse is not None else None
    return backend.context_overflow == DROP_OLD_TURNS if asked is None else asked


def kept_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages no dropping removes: system and developer ones, and the latest turn (from the last
    user message on). A lower bound: a tool result of the latest turn may bind an older one to it."""
    last = max((i for i, m in enumerate(messages) if m.role == "user"), default=0)
    return [m for i, m in enumerate(messages) if i >= last or m.role in ("system", "developer")]


def chat_prompt(
    req: ChatCompletionRequest,
    backend: Backend,
    messages: list[dict[str, Any]],
    tools: ToolsPrompt,
    max_tokens: int | None,
) -> FittedChat:
    """The request's prompt, with old turns dropped if it asks (see the module docstring).
    `max_tokens`: the request's own (checked to be positive), None when it sets none."""

    def render(ms: list[dict[str, Any]]) -> ChatPrompt:
        return backend.encode_chat(ms, tools.tools, tools.choice, req.chat_template_kwargs)

    if not drops_old_turns(req, backend):
        return FittedChat(render(messages))
    limit = backend.max_model_len
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens >= limit:  # no turn dropped could make room
        raise ContextLengthExceededError(
            f"this model's maximum context length is {limit} tokens and {field} is {max_tokens}: no "
            "room is left for the conversation",
            param=field,
        )
    room = max_tokens if max_tokens is not None else limit // 8
    tokenizer = backend.tokenizer
    fitted = fit_history(messages, render, lambda text: len(tokenizer.encode(text)), limit, limit - room)
    n = len(fitted.prompt.token_ids)
    if n + (max_tokens or 1) <= limit:
        return fitted
    reason = (
        f"this model's maximum context length is {limit} tokens; with every earlier turn dropped, the "
        f"system messages and the latest turn still take {n} tokens"
    )
    if max_tokens is None or n >= limit:
        raise ContextLengthExceededError(reason, param="messages")
    raise ContextLengthExceededError(
        f"{reason} and {field} is {max_tokens} (at most {limit - n} fit)", param=field
    )
