"""2K retrieval cases through the API, as a client would run them, with the dense engine and with a
sparse one whose budget is half the context: the classic passkey (near the start, where the
sinks hold it) and a RULER-style needle at a quarter depth, outside the sinks and the window, so
the key-bound block selection has to find it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from cloud.bench.longctx_data import CaseSpec, Encoder, Task, is_correct, make_case
from cloud.engine.config import SparseConfig
from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import LoadedModel
from cloud.serving.in_process import InProcessBackend

from .conftest import ENGINE, GATEWAY, MODEL, Served, run_in_thread

SPARSE = SparseConfig(budget=1024)  # sinks 64, window 256


@pytest.fixture(scope="module", params=["dense", "sparse"])
def engine(request: pytest.FixtureRequest, loaded_model: LoadedModel) -> Iterator[Served]:
    config = replace(ENGINE, kv_cache_memory_gib=0.2, max_num_batched_tokens=512, enable_prefix_caching=False)
    if request.param == "sparse":
        config = replace(config, attention="sparse", sparse=SPARSE)
    backend = InProcessBackend(AsyncEngine(EngineCore(config, loaded_model)))
    running = run_in_thread(backend, GATEWAY)
    yield Served(running.url, backend, running.server)
    running.stop()
    backend.shutdown()


@pytest.mark.parametrize(("task", "depth"), [("passkey", 0), ("needle", 25)])
def test_a_2k_key_comes_back_through_the_completions_api(engine: Served, task: Task, depth: int) -> None:
    core = engine.backend.engine.core
    case = make_case(CaseSpec(task, 2048, depth), Encoder(core.encode_chat, core.tokenizer), 12, seed=0)
    ids = list(case.prompt_ids)
    assert len(ids) > SPARSE.budget  # the sparse engine attends to half of the context
    if task == "needle":
        where = next(
            i for i in range(len(ids)) if core.tokenizer.decode(ids[i : i + 4]).startswith(case.key[:3])
        )
        assert SPARSE.sinks < where < len(ids) - SPARSE.window
    reply = engine.client().completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert is_correct(case, reply.choices[0].text), (case.key, reply.choices[0].text)
