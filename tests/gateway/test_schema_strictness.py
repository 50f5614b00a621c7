"""`response_format.json_schema.strict` reaches the grammar: true or absent is the strict reading (no
property the schema does not list, as xgrammar and vLLM read a schema), an explicit false the schema
read as JSON Schema says (unlisted properties allowed where additionalProperties is absent). Either
way every keyword is enforced."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import xgrammar as xgr

from cloud.serving.in_process import InProcessBackend
from gateway.openai.structured import response_format_structure
from shared.protocol import JsonSchemaSpec, ResponseFormat

from .conftest import MODEL, Served

OPEN = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


def _format(strict: bool | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "probe", "schema": {**OPEN, "description": "strictness probe"}}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def test_strict_false_reads_json_schema_and_strict_or_absent_lists_only(backend: InProcessBackend) -> None:
    # the served engine's own compiler and tokenizer: the grammar a request would get
    compiler = backend.engine.core.grammars
    tok = backend.tokenizer

    def accepts(strict: bool | None, text: str) -> bool:
        rf = ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(schema=OPEN, strict=strict))
        structure = response_format_structure(rf, confidence=False)
        assert structure is not None
        matcher = xgr.GrammarMatcher(compiler.compile(structure.spec))
        tokens = [*tok.encode(text), min(tok.eos_ids)]
        return all(matcher.accept_token(t) for t in tokens) and matcher.is_terminated()

    extra, optional_left_out, bad = '{"a": 1, "z": [true]}', '{"a": 1}', '{"a": 1, "b": 2}'
    assert accepts(False, extra) and accepts(False, optional_left_out)
    assert not accepts(False, bad) and not accepts(False, '{"b": "x"}')  # still enforced
    for strict in (None, True):
        assert not accepts(strict, extra) and accepts(strict, optional_left_out) and not accepts(strict, bad)


def test_the_client_strict_flag_picks_the_grammar(served: Served, client: openai.OpenAI) -> None:
    # two readings are two grammars; absent is true, so it hits the grammar true compiled
    def counter(name: str) -> float:
        text = httpx.get(f"{served.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    compiled = counter("ctxfuse_grammar_compilations_total")
    hits = counter("ctxfuse_grammar_cache_hits_total")
    for strict in (True, False, None):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON please."}],
            response_format=_format(strict),  # type: ignore[arg-type]
            temperature=0,
            max_tokens=24,
        )
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content or ""), dict)
    assert counter("ctxfuse_grammar_compilations_total") == compiled + 2
    assert counter("ctxfuse_grammar_cache_hits_total") == hits + 1


@pytest.mark.parametrize("strict", [True, False])
def test_a_keyword_we_cannot_enforce_is_refused_strict_or_not(client: openai.OpenAI, strict: bool) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "u", "schema": schema, "strict": strict}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON please."}],
            response_format=fmt,  # type: ignore[arg-type]
            max_tokens=8,
        )
    body: Any = err.value.body
    assert body["code"] == "unsupported_schema_feature" and "uniqueItems" in body["message"]
