"""Old turns out of a conversation too long for the context: `--context-overflow drop_old_turns`, a
chat request's `ctxfuse.drop_old_turns`, the Responses API's `truncation: "auto"`. Whole turns go,
chosen by a time-decay score, and the rest is rendered again through the chat template.

A conversation is cut into turns: a turn begins at a user message and holds what follows up to the
next one (the assistant's answer, its tool calls and their results); messages before the first user
message are a turn of their own. System messages (developer ones arrive as system) belong to no turn
and are always kept. A tool result answering a call made in an earlier turn joins that turn and
every one between into one, so a call and its results always go together, whatever their order.

Turns go whole: part of one would leave an answer without its question (templates that require
alternating roles, Gemma's among them, refuse that) or a tool call without its result.

Which turn goes first is decided by its score, lowest first (ties: the earlier turn):

    score = DECAY ** age * min(1, (context / 8) / tokens)

`age`: how many turns follow it (0 for the latest); `tokens`: its estimated length (its text through
the tokenizer plus MESSAGE_OVERHEAD per message); `context`: the model's context in tokens. Each turn
of age halves the score; a turn longer than an eighth of the context counts as older by
log2(tokens / (context / 8)) turns, so a pasted document goes before a few shorter, older exchanges.
The latest turn is never dropped. The turns younger than KEEP_RECENT_TURNS go last, oldest first,
so the exchange the question refers to stays while anything older remains.

The fewest turns, in that order, whose dropping makes the prompt fit are dropped: a guess from the
estimates, then checked (and corrected) by rendering, so what is reported is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.engine_types import ChatPrompt

from .image_text import render_image

DECAY = 0.5  # a turn's score halves with each turn after it
KEEP_RECENT_TURNS = 2  # the latest turn (always kept) and the one before it go last
MESSAGE_OVERHEAD = 4  # the template's tokens around a message (ChatML: 5), for the estimates only

Messages = list[dict[str, Any]]
Render = Callable[[Messages], ChatPrompt]
CountTokens = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class Turn:
    messages: tuple[int, ...]  # its messages' positions in the conversation, ascending
    age: int  # turns after it; 0: the latest
    tokens: int  # estimated
    score: float  # DECAY ** age * min(1, (context / 8) / tokens): the lowest goes first


@dataclass(frozen=True, slots=True)
class FittedChat:
    """A conversation's prompt after old turns were dropped to fit `budget` tokens. `fits` False:
    every turn that may go went and the prompt is still longer than the budget (the caller decides
    whether that is a refusal)."""

    prompt: ChatPrompt
    dropped_messages: int = 0
    dropped_tokens: int = 0  # the full prompt's length minus this one's
    fits: bool = True


def _message_text(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):  # text and image_features parts, as render_chat_prompt takes them
        parts = [
            render_image(p["image_features"]) if p.get("type") == "image_features" else p.get("text", "")
            for p in content
        ]
        content = "\n".join(parts)
    texts = [content] if isinstance(content, str) else []
    for call in m.get("tool_calls") or []:
        fn = call.get("function") or {}
        texts += [str(fn.get("name", "")), str(fn.get("arguments", ""))]
    return "\n".join(texts)


def _groups(messages: Messages) -> list[list[int]]:
    """The turns' message positions, in conversation order (see the module docstring)."""
    groups: list[list[int]] = []
    call_turn: dict[str, int] = {}  # tool call id -> the turn that made the call
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system":
            continue
        if role == "user" or not groups:
            groups.append([])
        origin = call_turn.get(m["tool_call_id"], -1) if role == "tool" and "tool_call_id" in m else -1
        if 0 <= origin < len(groups) - 1:  # answers a call of an earlier turn: those turns become one
            groups[origin:] = [[j for g in groups[origin:] for j in g]]
            call_turn = {cid: min(t, origin) for cid, t in call_turn.items()}
        groups[-1].append(i)
        for call in m.get("tool_calls") or []:
            if isinstance(call.get("id"), str):
                call_turn[call["id"]] = len(groups) - 1
    return groups


def conversation_turns(messages: Messages, count_tokens: CountTokens, context: int) -> list[Turn]:
    """The conversation's turns in order, each with its age, estimated length and score."""
    groups = _groups(messages)
    share = max(1, context // 8)
    turns = []
    for position, group in enumerate(groups):
        age = len(groups) - 1 - position
        tokens = sum(count_tokens(_message_text(messages[i])) + MESSAGE_OVERHEAD for i in group)
        score = DECAY**age * min(1.0, share / max(1, tokens))
        turns.append(Turn(tuple(group), age, tokens, score))
    return turns


def drop_order(turns: list[Turn]) -> list[Turn]:
    """The turns that may go, the first to go first: by score (ties: the earlier turn), then the
    recent ones but the latest, oldest first. `turns` in conversation order."""
    scored = [t for t in turns if t.age >= KEEP_RECENT_TURNS]
    recent = [t for t in turns if 0 < t.age < KEEP_RECENT_TURNS]
    # sorted() is stable and `turns` is in conversation order: equal scores keep the earlier first
    return sorted(scored, key=lambda t: t.score) + recent


def _enough(order: list[Turn], start: int, excess: int) -> int:
    """How many turns of `order` to drop, `start` of them already dropped, to free an estimated
    `excess` tokens: at least one more (start < len(order)), at most all."""
    k, freed = start, 0
    while k < len(order) and (k == start or freed < excess):
        freed += order[k].tokens
        k += 1
    return k


def fit_history(
    messages: Messages, render: Render, count_tokens: CountTokens, context: int, budget: int
) -> FittedChat:
    """The prompt of `messages` with the fewest turns dropped, in drop_order, to be at most `budget`
    tokens long; unchanged when it already is. `render`: messages -> prompt (the chat template,
    tools and tokenizer of the request); `context`: the model's, for the scores."""
    full = render(messages)
    if len(full.token_ids) <= budget:
        return FittedChat(full)
    order = drop_order(conversation_turns(messages, count_tokens, context))
    prompts: dict[int, ChatPrompt] = {0: full}

    def prompt(k: int) -> ChatPrompt:  # the first k turns of `order` dropped
        if k not in prompts:
            gone = {i for t in order[:k] for i in t.messages}
            prompts[k] = render([m for i, m in enumerate(messages) if i not in gone])
        return prompts[k]

    def excess(k: int) -> int:
        return len(prompt(k).token_ids) - budget

    if not order:
        return FittedChat(full, fits=False)
    known_long, k = 0, _enough(order, 0, excess(0))
    while excess(k) > 0:
        if k == len(order):
            break
        known_long, k = k, _enough(order, k, excess(k))
    # the estimates may overshoot by a turn or two: step back while one turn fewer still fits
    while k - 1 > known_long and excess(k - 1) <= 0:
        k -= 1
    return FittedChat(
        prompt(k),
        dropped_messages=sum(len(t.messages) for t in order[:k]),
        dropped_tokens=len(full.token_ids) - len(prompt(k).token_ids),
        fits=excess(k) <= 0,
    )
