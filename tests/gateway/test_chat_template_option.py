"""`--chat-template FILE` (as vLLM's): a template of the operator's renders every chat prompt, on the
engine and on a routing gateway alike (which must key the same prompt blocks as its workers)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend
from ctxfuse.cli import build_parser
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.serve import build_fleet_server
from gateway.config import GatewayConfig
from shared.errors import ModelLoadError
from shared.protocol import ChatCompletionRequest, ChatMessage

from .conftest import ENGINE, run_in_thread

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Name a colour."}]
RENDERED = "[USER] Name a colour.\n[ASSISTANT]"


def test_the_engine_renders_chats_with_the_operators_template(loaded_model: LoadedModel) -> None:
    backend = InProcessBackend(AsyncEngine(EngineCore(replace(ENGINE, chat_template=TEMPLATE), loaded_model)))
    running = run_in_thread(backend, GatewayConfig(port=0))
    try:
        r = httpx.post(f"{running.url}/tokenize", json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 200
        assert r.json()["tokens"] == backend.tokenizer.encode(RENDERED, add_special=False)
        # the model's own template would have rendered something else
        assert loaded_model.chat_template.render(MESSAGES) != RENDERED
    finally:
        running.stop()
        backend.shutdown()


def test_a_template_that_does_not_compile_stops_the_start_naming_the_option(
    loaded_model: LoadedModel,
) -> None:
    with pytest.raises(ModelLoadError, match="--chat-template does not compile"):
        EngineCore(replace(ENGINE, chat_template="{% for m in messages %}"), loaded_model)


def test_an_unreadable_or_empty_template_file_is_refused_at_parse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    for path, why in ((tmp_path / "missing.jinja", "cannot be read"), (empty, "is empty")):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "--chat-template", str(path)])
        assert exit_.value.code == 2
        assert why in capsys.readouterr().err


def test_the_router_keys_prompts_with_the_same_template(gguf_path: Path, tmp_path: Path) -> None:
    fleet_config = FleetConfig(backends=(BackendSpec(name="w", url="http://127.0.0.1:9", kind="ctxfuse"),))
    _, fleet = build_fleet_server(
        fleet_config,
        GatewayConfig(port=0, data_dir=tmp_path),
        gguf_path,
        random.Random(0),
        chat_template=TEMPLATE,
    )
    req = ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="Name a colour.")])
    keys, _ = fleet.request_keys(req, True)
    assert keys.token_ids == fleet.keys.tokenizer.encode(RENDERED, add_special=False)


THINKING = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[NO THINKING]{% endif %}[ASSISTANT]"
)


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_its_own(
    loaded_model: LoadedModel,
) -> None:
    backend = InProcessBackend(AsyncEngine(EngineCore(replace(ENGINE, chat_template=THINKING), loaded_model)))
    running = run_in_thread(backend, GatewayConfig(port=0))
    body = {"model": ENGINE.served_model_name, "messages": MESSAGES, "max_tokens": 1}
    try:
        counts = {}
        for kwargs in (None, {"enable_thinking": False}):
            r = httpx.post(
                f"{running.url}/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs}
            )
            assert r.status_code == 200
            counts[kwargs is None] = r.json()["usage"]["prompt_tokens"]
        plain = "[USER] Name a colour.\n[ASSISTANT]"
        quiet = "[USER] Name a colour.\n[NO THINKING][ASSISTANT]"
        assert counts == {
            True: len(backend.tokenizer.encode(plain, add_special=False)),
            False: len(backend.tokenizer.encode(quiet, add_special=False)),
        }
        r = httpx.post(
            f"{running.url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        running.stop()
        backend.shutdown()
