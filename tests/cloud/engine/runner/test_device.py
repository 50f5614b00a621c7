"""Device selection, GPU memory planning and CUDA-graph sizing, with the device mocked where this
machine has no GPU (the GPU check, ctxfuse bench gpu-check, runs them for real)."""

from __future__ import annotations

import pytest
import torch

from cloud.engine.attention.choice import use_triton
from cloud.engine.config import EngineConfig
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.memory import GPUMemory, gpu_kv_budget, plan_kv
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from cloud.engine.runner import device as device_mod
from cloud.engine.runner.cuda_graphs import capture_sizes, eligible, padded_size
from cloud.engine.runner.device import default_dtype, resolve_device
from cloud.model.config import ModelConfig
from shared.errors import InvalidRequestError

GiB = 2**30


@pytest.fixture
def gpus(monkeypatch):  # type: ignore[no-untyped-def]
    """Pretend torch sees two CUDA GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_takes_the_first_gpu_when_there_is_one(gpus) -> None:  # type: ignore[no-untyped-def]
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_falls_back_to_the_cpu(no_gpu) -> None:  # type: ignore[no-untyped-def]
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_asking_for_a_gpu_that_is_not_there_is_refused(no_gpu, spec: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="no CUDA GPU"):
        resolve_device(spec)


def test_a_gpu_index_past_the_count_and_nonsense_are_refused(gpus) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="has 2 CUDA GPU"):
        resolve_device("cuda:2")
    with pytest.raises(InvalidRequestError, match="must be auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


def test_the_default_dtype_follows_the_device(gpus) -> None:  # type: ignore[no-untyped-def]
    assert default_dtype(torch.device("cuda", 0)) == "bfloat16"
    assert default_dtype(torch.device("cpu")) == "float32"
    assert EngineConfig(device="auto").run_dtype == "bfloat16"
    assert EngineConfig(device="cpu").run_dtype == "float32"
    assert EngineConfig(device="auto", dtype="float16").run_dtype == "float16"
    assert device_mod.resolve_device is resolve_device


MODEL = ModelConfig(
    arch="llama",
    num_layers=4,
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=1000,
    max_position=4096,
    rope_theta=10000.0,
    rms_eps=1e-5,
    tie_embeddings=True,
)


def test_the_kv_cache_gets_the_share_left_after_weights_and_the_activation_peak() -> None:
    mem = GPUMemory(free=90 * GiB, total=100 * GiB, activation_peak=2 * GiB)
    assert gpu_kv_budget(mem, 0.9) == 90 * GiB - 10 * GiB - 2 * GiB
    config = EngineConfig(device="cpu", dtype="bfloat16", gpu_memory_utilization=0.5)
    plan = plan_kv(config, MODEL, 4096, torch.device("cuda", 0), mem)
    per_block = plan.bytes_per_token * plan.block_size
    assert plan.num_blocks == int((50 - 10 - 2) * GiB // per_block)
    assert "50% of the GPU" in plan.budget_source


def test_a_utilization_that_leaves_nothing_is_refused_with_the_figures() -> None:
    mem = GPUMemory(free=20 * GiB, total=100 * GiB, activation_peak=5 * GiB)  # 80 GiB in use
    config = EngineConfig(device="cpu", gpu_memory_utilization=0.8)
    with pytest.raises(InvalidRequestError, match="leaves no room for the KV cache"):
        plan_kv(config, MODEL, 4096, torch.device("cuda", 0), mem)


def test_an_explicit_kv_budget_needs_no_profile_run() -> None:
    config = EngineConfig(device="cpu", kv_cache_memory_gib=1.0)
    plan = plan_kv(config, MODEL, 4096, torch.device("cuda", 0), None)
    assert plan.budget_source == "--kv-cache-memory"


def test_triton_attention_on_a_cpu_needs_the_interpreter(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cpu = torch.device("cpu")
    assert not use_triton("auto", cpu) and not use_triton("torch", torch.device("cuda", 0))
    assert use_triton("auto", torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidRequestError, match="needs a CUDA GPU"):
        use_triton("triton", cpu)


def test_graphs_are_captured_at_powers_of_two_up_to_max_num_seqs() -> None:
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(48)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 16, 17, 33, 48, 49)] == [1, 4, 8, 16, 32, 48, 48, None]


def test_only_caches_written_without_the_host_take_graphs() -> None:
    cuda = torch.device("cuda", 0)
    dense = KVCache(2, 4, 16, 2, 64, torch.float32)
    summarized = KVCache(2, 4, 16, 2, 64, torch.float32, track_summaries=True)
    quantized = QuantizedKVCache(2, 4, 16, 2, 64, torch.float32, 8, lambda b: True)
    assert eligible(cuda, False, dense, True) is None
    assert eligible(torch.device("cpu"), False, dense, True) == "not a CUDA device"
    assert eligible(cuda, True, dense, True) == "--enforce-eager"
    assert eligible(cuda, False, dense, False) is not None
    assert eligible(cuda, False, summarized, True) is not None
    assert eligible(cuda, False, quantized, True) is not None


def test_int8_weights_are_refused_on_a_gpu_before_any_work(loaded_model, gpus) -> None:  # type: ignore[no-untyped-def]
    from cloud.engine.core import EngineCore

    config = EngineConfig(device="cuda", weight_quant="int8")
    with pytest.raises(InvalidRequestError, match="CPU kernels"):
        EngineCore(config, loaded_model)
