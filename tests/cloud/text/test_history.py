"""Which old turns a conversation too long for the context drops: whole turns, lowest time-decay score
first (older, and outsized, turns first), never a system message or the latest turn, a tool call never
apart from its results; the fewest that make the prompt fit, checked by rendering."""

from __future__ import annotations

from typing import Any

import pytest

from cloud.model.chat_template import CHATML_TEMPLATE, ChatTemplate
from cloud.model.tokenizer import Tokenizer
from cloud.text.history import conversation_turns, drop_order, fit_history
from cloud.text.prompt import render_chat_prompt
from gateway.bench.fake_engine import byte_level_tokenizer
from shared.engine_types import ChatPrompt

Messages = list[dict[str, Any]]
TEMPLATE = ChatTemplate(CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return byte_level_tokenizer()  # one token per byte: lengths are plain to read


def _count(tok: Tokenizer) -> Any:
    return lambda text: len(tok.encode(text))


def _render(tok: Tokenizer) -> Any:
    def render(messages: Messages) -> ChatPrompt:
        return render_chat_prompt(TEMPLATE, tok, messages)

    return render


def _chat(turns: int, filler: str = "") -> Messages:
    out: Messages = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        out.append({"role": "user", "content": f"question {i}{filler}"})
        out.append({"role": "assistant", "content": f"answer {i}{filler}"})
    return out[:-1]  # ends on the latest question


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": "{}"}}


def _text(tok: Tokenizer, prompt: ChatPrompt) -> str:
    return tok.decode(prompt.token_ids)


def test_the_oldest_turns_go_first_and_the_system_prompt_and_latest_turn_stay(tok: Tokenizer) -> None:
    messages = _chat(6, filler=" " + "x" * 40)
    render = _render(tok)
    two_gone = render([messages[0], *messages[5:]])  # turns 0 and 1 dropped
    fitted = fit_history(messages, render, _count(tok), context=4096, budget=len(two_gone.token_ids))
    assert fitted.fits
    assert fitted.prompt == two_gone  # the fewest turns: not a third one
    assert fitted.dropped_messages == 4
    full = render(messages)
    assert fitted.dropped_tokens == len(full.token_ids) - len(two_gone.token_ids)
    text = _text(tok, fitted.prompt)
    assert "Be brief." in text and "question 5" in text
    assert "question 0" not in text and "answer 1" not in text and "question 2" in text


def test_a_conversation_that_fits_is_rendered_unchanged(tok: Tokenizer) -> None:
    messages = _chat(3)
    full = _render(tok)(messages)
    fitted = fit_history(messages, _render(tok), _count(tok), context=4096, budget=len(full.token_ids))
    assert (fitted.prompt, fitted.dropped_messages, fitted.dropped_tokens, fitted.fits) == (full, 0, 0, True)


def test_a_tool_call_and_its_results_are_one_turn_with_the_question(tok: Tokenizer) -> None:
    messages: Messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Look two things up."},  # 1
        {"role": "assistant", "content": None, "tool_calls": [_call("a"), _call("b")]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "And now?"},  # 6
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Last."},  # 8
    ]
    turns = conversation_turns(messages, _count(tok), context=4096)
    assert [t.messages for t in turns] == [(1, 2, 3, 4, 5), (6, 7), (8,)]
    assert [t.age for t in turns] == [2, 1, 0]


def test_a_late_tool_result_binds_the_turns_back_to_its_call(tok: Tokenizer) -> None:
    # the result of turn 1's call arrives after the next question: dropping turn 1 alone would orphan it
    messages: Messages = [
        {"role": "user", "content": "q0"},  # 0
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "q1"},  # 2
        {"role": "assistant", "content": None, "tool_calls": [_call("late")]},
        {"role": "user", "content": "q2"},  # 4
        {"role": "tool", "tool_call_id": "late", "content": "result"},
        {"role": "user", "content": "q3"},  # 6
    ]
    turns = conversation_turns(messages, _count(tok), context=4096)
    assert [t.messages for t in turns] == [(0, 1), (2, 3, 4, 5), (6,)]


def test_messages_before_the_first_question_are_a_turn_and_system_messages_none(tok: Tokenizer) -> None:
    messages: Messages = [
        {"role": "assistant", "content": "Hello, how can I help?"},  # 0
        {"role": "user", "content": "q1"},  # 1
        {"role": "system", "content": "Mind the tone."},  # 2: in no turn, never dropped
        {"role": "assistant", "content": "a1"},  # 3
        {"role": "user", "content": "q2"},  # 4
    ]
    turns = conversation_turns(messages, _count(tok), context=4096)
    assert [t.messages for t in turns] == [(0,), (1, 3), (4,)]


def test_an_outsized_turn_goes_before_shorter_older_ones(tok: Tokenizer) -> None:
    short, long = "s" * 20, "L" * 800
    messages: Messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": short},  # turn 0, age 4
        {"role": "user", "content": short},  # turn 1, age 3
        {"role": "user", "content": long},  # turn 2, age 2: 8x an eighth of a 800-token context
        {"role": "user", "content": short},  # turn 3, age 1: recent, goes last
        {"role": "user", "content": short},  # turn 4, latest: never
    ]
    turns = conversation_turns(messages, _count(tok), context=800)
    # scores: 0.5^4 = 0.0625, 0.5^3 = 0.125, 0.5^2 * 100/804 ≈ 0.031
    assert [t.messages for t in drop_order(turns)] == [(3,), (1,), (2,), (4,)]
    assert turns[2].score == pytest.approx(0.25 * 100 / 804)


def test_equal_scores_drop_the_earlier_turn_first(tok: Tokenizer) -> None:
    messages: Messages = [
        {"role": "user", "content": "b"},  # age 4: 0.5^4
        {"role": "user", "content": "a" * 200},  # age 3, 204 tokens, twice an eighth: 0.5^3 * 0.5
        {"role": "user", "content": "c"},
        {"role": "user", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    turns = conversation_turns(messages, _count(tok), context=204 * 4)
    assert turns[0].score == turns[1].score == 0.5**4
    assert [t.messages for t in drop_order(turns)] == [(0,), (1,), (2,), (3,)]


def test_when_even_the_latest_turn_does_not_fit_everything_else_went_and_it_says_so(
    tok: Tokenizer,
) -> None:
    messages = _chat(3, filler=" " + "y" * 30)
    render = _render(tok)
    fitted = fit_history(messages, render, _count(tok), context=4096, budget=10)
    assert not fitted.fits
    assert fitted.prompt == render([messages[0], messages[-1]])
    assert fitted.dropped_messages == len(messages) - 2
