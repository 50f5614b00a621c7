"""CUDA-graph replay of decode steps, with the device mocked: the graphs' static buffers, padding to
the captured size and the spare block are exercised on this CPU by replaying an eager run of the
same captured step (the Triton attention kernels run under the interpreter). The GPU check runs
real graphs (ctxfuse bench gpu-check)."""

from __future__ import annotations

import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.cache import KVCache
from cloud.engine.runner.cuda_graphs import CudaGraphs
from shared.engine_types import SamplingParams


class _EagerReplay:
    """Stands in for a captured graph: replaying runs the captured step's forward again."""

    def __init__(self, graphs: _CpuGraphs, b: int) -> None:
        self.graphs, self.b = graphs, b

    def replay(self) -> None:
        self.graphs.outputs[self.b] = self.graphs._forward(self.b)
        self.graphs.replays.append(self.b)


class _CpuGraphs(CudaGraphs):
    def capture(self) -> None:
        self.replays: list[int] = []
        for b in self.sizes:
            self.graphs[b] = _EagerReplay(self, b)  # type: ignore[assignment]


def _core(loaded_model, graphs: bool) -> EngineCore:  # type: ignore[no-untyped-def]
    # the eager reference runs the PyTorch attention (the interpreter's Triton kernels, proven equal
    # to it in test_attention_kernels.py, would only double the run's cost)
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        weight_quant="none",
        kv_cache_memory_gib=0.05,
        max_model_len=256,
        max_num_seqs=4,
        attention_kernels="triton" if graphs else "torch",
    )
    core = EngineCore(config, loaded_model)
    if graphs:
        assert isinstance(core.cache, KVCache)
        # a spare block past the pool, as the engine sets aside on a GPU
        core.cache = KVCache(
            core.model_config.num_layers,
            core.kv_plan.num_blocks + 1,
            core.kv_plan.block_size,
            core.model_config.num_kv_heads,
            core.model_config.head_dim,
            torch.float32,
        )
        core.runner.cache = core.cache
        spare = core.kv_plan.num_blocks * core.kv_plan.block_size
        g = _CpuGraphs(core.model, core.cache, core.runner.attention, 4, core.runner.batch.max_blocks, spare)
        g.capture()
        core.runner.graphs = g
    return core


def _generate(core: EngineCore) -> dict[str, list[int]]:
    prompts = ["The capital of France is", "Two plus two is", "Water boils at"]
    for i, text in enumerate(prompts):
        core.add_request(f"r{i}", core.tokenizer.encode(text), SamplingParams(max_tokens=3, temperature=0.0))
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    return tokens


def test_decode_steps_replayed_from_padded_graphs_give_the_eager_tokens(loaded_model) -> None:  # type: ignore[no-untyped-def]
    eager = _generate(_core(loaded_model, graphs=False))
    core = _core(loaded_model, graphs=True)
    assert _generate(core) == eager
    graphs = core.runner.graphs
    assert isinstance(graphs, _CpuGraphs)
    # three requests decode together: the size-4 graph replays with one padding row
    assert graphs.replays and set(graphs.replays) == {4}
    spare_block = core.kv_plan.num_blocks
    assert torch.count_nonzero(core.cache.k[0].view(core.cache.num_kv_heads, -1, 16, 64)[:, spare_block]) > 0
