"""Legacy completions, tokenize and detokenize against the real gateway."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import MODEL, Served


def test_completion_with_echo_starts_with_the_prompt(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert plain.object == "text_completion" and plain.choices[0].text
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage is not None and echoed.usage.completion_tokens == 5


def test_completion_list_of_prompts_numbers_choices_prompt_major(client: openai.OpenAI) -> None:
    prompts = ["Hello, my name is", "The sky is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0).choices[0].text
        for p in prompts
    ]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]


def test_streamed_list_of_prompts_matches_the_whole_response(client: openai.OpenAI) -> None:
    prompts = ["Hello, my name is", "The sky is"]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]


def test_completion_stream_concatenates_and_ends_with_usage(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            echo=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == prompt + whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_completion_logprobs_line_up_with_the_text(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs if t is not None)


def test_echo_with_logprobs_scores_the_prompt_too(client: openai.OpenAI, served: Served) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    lp, tail = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and tail is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    n_prompt = len(served.backend.tokenizer.encode(prompt))
    assert len(lp.tokens) == n_prompt + len(tail.tokens or [])
    assert "".join(lp.tokens) == echoed.choices[0].text
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.tokens[n_prompt:] == tail.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(tail.token_logprobs, abs=1e-4)
    assert lp.text_offset[n_prompt] == len(prompt)


def test_token_id_prompt_is_accepted(client: openai.OpenAI, served: Served) -> None:
    ids = served.backend.tokenizer.encode("The sky is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_tokenize_and_detokenize_round_trip(served: Served) -> None:
    text = "Hello, world! Ünïcödé 🙂"
    r = httpx.post(f"{served.url}/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    back = httpx.post(f"{served.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == text


def test_tokenize_messages_matches_the_chat_prompt_size(served: Served, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = httpx.post(f"{served.url}/tokenize", json={"messages": messages})
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and r.json()["count"] == chat.usage.prompt_tokens


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_health_and_ready_answer_ok(served: Served, path: str) -> None:
    r = httpx.get(f"{served.url}{path}")
    assert r.status_code == 200 and r.json()["status"] in ("ok", "ready")


def test_metrics_expose_the_prometheus_names(served: Served, client: openai.OpenAI) -> None:
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
    ).close()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    text = httpx.get(f"{served.url}/metrics").text
    for name in (
        "ctxfuse_requests_running",
        "ctxfuse_requests_waiting",
        "ctxfuse_kv_cache_usage_ratio",
        "ctxfuse_kv_cache_bytes_per_token",
        "ctxfuse_prefix_cache_queries_total",
        "ctxfuse_prefix_cache_hits_total",
        "ctxfuse_prompt_tokens_total",
        "ctxfuse_generation_tokens_total",
        "ctxfuse_time_to_first_token_seconds_bucket",
        "ctxfuse_inter_token_latency_seconds_bucket",
        "ctxfuse_request_queue_seconds_bucket",
        'ctxfuse_http_requests_total{route="/v1/chat/completions",status="200"}',
    ):
        assert name in text, name


def test_openapi_document_lists_the_routes(served: Served) -> None:
    doc = httpx.get(f"{served.url}/schema/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(doc["paths"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/ChatCompletionRequest"
    request = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(request["required"])
