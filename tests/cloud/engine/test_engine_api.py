"""The engine as its callers use it: submit, stream, abort, n > 1, stop strings, seeds, logprobs,
and refusals of bad input before any work. Real model, real forward; no transformers needed."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.serving.async_engine import AsyncEngine
from cloud.model.loading import load_model
from shared.engine_types import SamplingParams
from shared.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError, QueueFullError

CONFIG = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_model_len=1024)


@pytest.fixture()
def core(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(CONFIG, loaded_model)


def ids_for(core: EngineCore, text: str) -> list[int]:
    return core.encode_chat([{"role": "user", "content": text}])


def drain(core: EngineCore) -> dict[tuple[str, int], list]:  # type: ignore[type-arg]
    outs: dict[tuple[str, int], list] = {}  # type: ignore[type-arg]
    while core.has_work():
        for o in core.step():
            outs.setdefault((o.request_id, o.index), []).append(o)
    return outs


def text_of(outs: list) -> str:  # type: ignore[type-arg]
    return "".join(o.text for o in outs)


def test_streamed_deltas_concatenate_to_the_greedy_text(core: EngineCore) -> None:
    ids = ids_for(core, "Name three colours.")
    core.add_request("a", ids, SamplingParams(max_tokens=40, temperature=0.0))
    outs = drain(core)[("a", 0)]
    tokens = [t for o in outs for t in o.token_ids]
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length")
    assert text_of(outs) == core.tokenizer.decode(tokens)
    assert outs[-1].num_prompt_tokens == len(ids) and outs[-1].num_output_tokens == len(tokens)


def test_max_tokens_ends_with_length(core: EngineCore) -> None:
    core.add_request(
        "a", ids_for(core, "Count to one hundred."), SamplingParams(max_tokens=5, temperature=0.0)
    )
    outs = drain(core)[("a", 0)]
    assert sum(len(o.token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"


def test_stop_string_cuts_the_text_and_is_not_returned(core: EngineCore) -> None:
    ids = ids_for(core, "Count from 1 to 10, separated by commas.")
    core.add_request("free", ids, SamplingParams(max_tokens=40, temperature=0.0))
    full = text_of(drain(core)[("free", 0)])
    assert "5" in full
    core.add_request("stopped", ids, SamplingParams(max_tokens=40, temperature=0.0, stop=["5"]))
    outs = drain(core)[("stopped", 0)]
    assert outs[-1].finish_reason == "stop"
    assert text_of(outs) == full[: full.index("5")]


def test_abort_frees_blocks_at_once(core: EngineCore) -> None:
    free = core.pool.num_free
    core.add_request(
        "a", ids_for(core, "Write a long story."), SamplingParams(max_tokens=200, temperature=0.0)
    )
    core.step()
    core.step()
    assert core.pool.num_free < free
    outs = core.abort("a")
    assert [o.finish_reason for o in outs] == ["abort"]
    assert core.pool.num_free == free and not core.has_work()


def test_n_choices_share_prompt_blocks(core: EngineCore) -> None:
    ids = ids_for(core, "Tell me a joke about " + "cats and dogs " * 10)
    core.add_request("n", ids, SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7))
    core.step()  # the first choice computes the prompt; the others wait to reuse it
    core.step()
    first, *others = (core.scheduler.requests[f"n#{i}"] for i in range(3))
    full = len(ids) // CONFIG.kv_block_size
    for other in others:
        assert other.block_ids[:full] == first.block_ids[:full]
        assert other.num_cached_tokens == full * CONFIG.kv_block_size
    assert all(core.pool.blocks[b].ref_count == 3 for b in first.block_ids[:full])
    outs = drain(core)
    assert {k[1] for k in outs} == {0, 1, 2} and core.pool.num_free == core.pool.num_blocks


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(core: EngineCore) -> None:
    ids = ids_for(core, "Write a poem about the sea.")
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    core.add_request("alone", ids, params)
    alone = [t for o in drain(core)[("alone", 0)] for t in o.token_ids]
    core.add_request("x", ids_for(core, "Hello there"), SamplingParams(max_tokens=30, temperature=1.0))
    core.add_request("with", ids, params)
    core.add_request("y", ids_for(core, "Explain gravity."), SamplingParams(max_tokens=10, temperature=0.7))
    together = [t for o in drain(core)[("with", 0)] for t in o.token_ids]
    assert together == alone
    core.add_request("other-seed", ids, replace(params, seed=99))
    assert [t for o in drain(core)[("other-seed", 0)] for t in o.token_ids] != alone


def test_logprobs_report_the_chosen_token_and_the_top_k(core: EngineCore) -> None:
    core.add_request(
        "lp", ids_for(core, "Say hi."), SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    )
    outs = drain(core)[("lp", 0)]
    for o in outs:
        (res,) = o.logprobs
        assert len(res.top_logprobs) == 3
        top_id, top_lp = res.top_logprobs[0]
        assert top_id == o.token_ids[0] and res.logprob == pytest.approx(top_lp)
        assert [lp for _, lp in res.top_logprobs] == sorted((lp for _, lp in res.top_logprobs), reverse=True)
        assert res.logprob is not None and res.logprob <= 0


@pytest.mark.parametrize(
    ("params", "error", "param"),
    [
        (SamplingParams(max_tokens=0), InvalidRequestError, "max_tokens"),
        (SamplingParams(temperature=-1), InvalidRequestError, "temperature"),
        (SamplingParams(top_p=0), InvalidRequestError, "top_p"),
        (SamplingParams(logit_bias={10**9: 1.0}), InvalidRequestError, "logit_bias"),
        (SamplingParams(max_tokens=5000), ContextLengthExceededError, "max_tokens"),
    ],
)
def test_bad_requests_are_refused_before_any_work(core: EngineCore, params, error, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error) as info:
        core.add_request("bad", ids_for(core, "hi"), params)
    assert info.value.param == param
    assert not core.has_work() and core.pool.num_free == core.pool.num_blocks


def test_prompt_longer_than_the_context_is_refused(core: EngineCore) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        core.add_request("long", [100] * 2000, SamplingParams(max_tokens=1))
    assert info.value.code == "context_length_exceeded" and "1024" in info.value.message
    assert not core.has_work()


def test_full_waiting_queue_refuses_new_requests(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(replace(CONFIG, max_waiting=2), loaded_model)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    core.add_request("b", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        core.add_request("c", [1, 2, 3], SamplingParams(max_tokens=1))


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(
    core: EngineCore, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    real = core.runner.execute

    def broken(out):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(core.runner, "execute", broken)
    core.add_request("victim", ids_for(core, "hi"), SamplingParams(max_tokens=4, temperature=0.0))
    outs = core.step()
    assert [o.finish_reason for o in outs] == ["error"] and "simulated device fault" in (outs[0].error or "")
    assert core.pool.num_free == core.pool.num_blocks
    monkeypatch.setattr(core.runner, "execute", real)
    core.add_request("next", ids_for(core, "hi"), SamplingParams(max_tokens=4, temperature=0.0))
    assert drain(core)[("next", 0)][-1].finish_reason in ("stop", "length")


def test_missing_and_corrupt_model_files_are_named(tmp_path, gguf_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope.gguf")
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"corrupt\.gguf"):
        load_model(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_path.read_bytes()[:5_000_000])
    with pytest.raises(ModelLoadError):
        load_model(truncated)


def test_async_engine_streams_and_a_consumer_that_leaves_aborts(loaded_model) -> None:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(EngineCore(CONFIG, loaded_model))
    ids = engine.core.encode_chat([{"role": "user", "content": "Write a long essay about rivers."}])
    total = engine.core.pool.num_free

    async def main() -> None:
        got = []
        async for o in engine.generate(ids, SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)):
            got.append(o)
            if len(got) == 3:
                break  # the client went away
        for _ in range(100):
            if engine.stats().num_running == 0 and engine.core.pool.num_free == total:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the abandoned request kept its blocks")

    try:
        asyncio.run(main())
        with pytest.raises(ContextLengthExceededError):
            asyncio.run(_consume(engine, [5] * 1100))
    finally:
        engine.shutdown()


async def _consume(engine: AsyncEngine, ids: list[int]) -> None:
    async for _ in engine.generate(ids, SamplingParams(max_tokens=1)):
        pass


def test_queue_time_is_the_wait_before_first_admission(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(replace(CONFIG, max_num_seqs=1), loaded_model)
    core.add_request("first", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    core.add_request("second", [1, 2, 4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    outs = drain(core)
    first, second = outs[("first", 0)][0].queue_time_s, outs[("second", 0)][0].queue_time_s
    assert first is not None and second is not None
    assert second > first  # the second waited while the first generated all its tokens
