"""Chat completions through the official `openai` client against the real gateway on loopback."""

from __future__ import annotations

import openai
from openai.types.chat import ChatCompletionMessageParam

from .conftest import MODEL, Served

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def test_non_streaming_chat_completion_has_text_finish_and_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_deltas_concatenate_to_the_greedy_text(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_include_usage_sends_a_final_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert 0 < last.usage.completion_tokens <= 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_two_returns_two_choices_streamed_and_whole(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage is not None and 2 <= r.usage.completion_tokens <= 12
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, n=2, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1] != ""  # greedy: both choices agree


def test_stop_string_ends_the_answer_before_it(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Count from 1 to 10, separated by commas."}
    ]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    full = free.choices[0].message.content or ""
    assert "4" in full
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stop=["4"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index("4")]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a short poem about the sea."}
    ]

    def sample(seed: int) -> str | None:
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=1.0, top_p=0.95, seed=seed
        )
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_logprobs_cover_each_token_with_top_alternatives(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.bytes == list(t.token.encode())
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5


def test_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    long = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": long + " Which fact is first?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert again.usage.prompt_tokens > 300
    # every full block of the prompt but the last (its final token is always recomputed)
    assert details.cached_tokens >= again.usage.prompt_tokens - 32


def test_sampling_extensions_and_penalties_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        ],
        max_completion_tokens=4,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"42": -100},
        user="tester",
        seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage is not None and r.usage.completion_tokens <= 4


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_n_choices_finishing_in_the_same_step_all_arrive(served: Served) -> None:
    client = served.client(timeout=6)
    # max_tokens=1: choices 1..7 reuse choice 0's prompt blocks and all finish in one step
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, n=8, temperature=1.0)
    assert sorted(c.index for c in r.choices) == list(range(8))
