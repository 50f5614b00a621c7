"""Property-based fuzzing of every operation in the OpenAPI document the gateway serves (schemathesis):
valid and invalid bodies alike, no request is ever answered with a 5xx.

The real engine runs behind a real server on loopback, so the strict decoding, the planning checks and
the engine's own validation are what is fuzzed. Generation is kept tiny (a 256-token context, and
max_tokens / n clamped before sending) because the point is the validation paths, not long text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from gateway.config import GatewayConfig

from .conftest import ENGINE, MODEL, run_in_thread

FUZZ_ENGINE = replace(ENGINE, kv_cache_memory_gib=0.05, max_model_len=256, max_num_seqs=8)
FUZZ_GATEWAY = GatewayConfig(port=0, max_body_bytes=2**16)

EXAMPLES = 15  # per operation and mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# Upper bounds put on generated bodies so each request generates at most a few tokens; values at or
# below them (negative ones included) go through unchanged, so the validation of each stays fuzzed.
BOUNDS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}


def bound_generation(body: Any) -> Any:
    if isinstance(body, dict):
        for key, limit in BOUNDS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[key] = limit
        if isinstance(body.get("model"), str):
            body["model"] = MODEL  # an unknown model is refused before anything else is checked
        if "prompt" in body and "max_tokens" not in body:
            body["max_tokens"] = BOUNDS["max_tokens"]  # completions default to 16
        if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = BOUNDS["max_tokens"]  # chat defaults to the rest of the context
        if "input" in body and "max_output_tokens" not in body:
            body["max_output_tokens"] = BOUNDS["max_output_tokens"]  # responses: as chat
    return body


@pytest.fixture(scope="module")
def fuzz_url(loaded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    backend = InProcessBackend(AsyncEngine(EngineCore(FUZZ_ENGINE, loaded_model)))
    running = run_in_thread(backend, replace(FUZZ_GATEWAY, data_dir=tmp_path_factory.mktemp("fuzz-data")))
    yield running.url
    running.stop()
    backend.shutdown()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_url: str) -> schemathesis.BaseSchema:
    """The document as the running gateway serves it (not rebuilt here), so what is fuzzed is what
    clients read."""
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/schema/openapi.json", timeout=10)
    schema.config.update(base_url=fuzz_url)

    def map_body(context: schemathesis.HookContext, body: Any) -> Any:
        return bound_generation(body)

    schema.hook(map_body)
    return schema


def fuzz(schema: schemathesis.BaseSchema, operation: schemathesis.APIOperation, mode: GenerationMode) -> None:
    session = requests.Session()

    # derandomize: the same examples every run, so CI is reproducible
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode, hooks=schema.hooks))
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(session=session, timeout=30, checks=CHECKS)

    try:
        check()
    finally:
        session.close()


# schemathesis' own `schema.parametrize` needs the document at import time, and its pytest-fixture form
# (`schemathesis.pytest.from_fixture`) breaks on pytest 9; so each operation is fuzzed with `given` here
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_operation_answers_a_server_error(
    fuzz_schema: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    operations = []
    for result in fuzz_schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # the served document itself is broken
        operations.append(result.ok())
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/tokenize"}
    for operation in operations:
        # a body is what can be made invalid: a string path parameter accepts every string
        if mode is GenerationMode.POSITIVE or operation.body:
            fuzz(fuzz_schema, operation, mode)
