"""A Hugging Face model directory (config.json, *.safetensors, tokenizer.json) loads into the same
engine as the GGUF: written here from transformers' own copy of the default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.model.loading import load_model
from shared.engine_types import SamplingParams
from shared.errors import ModelLoadError


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf_model, gguf_path: Path) -> Path:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_model
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("smollm2-hf")
    hf_model.config.save_pretrained(d)
    save_model(hf_model, str(d / "model.safetensors"))
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(d)
    return d


def greedy(core: EngineCore, ids: list[int]) -> list[int]:
    core.add_request("g", ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while core.has_work():
        for o in core.step():
            out.extend(o.token_ids)
    return out


def test_hf_directory_matches_the_gguf(hf_dir: Path, loaded_model) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.1, max_model_len=512)
    from_hf = load_model(hf_dir)
    assert from_hf.weights.config.num_kv_heads == 3 and from_hf.weights.config.tie_embeddings
    for a, b in [
        (from_hf.weights.layers[3].wq, loaded_model.weights.layers[3].wq),
        (from_hf.weights.embed, loaded_model.weights.embed),
    ]:
        assert torch.equal(a, b)
    hf_core, gguf_core = EngineCore(config, from_hf), EngineCore(config, loaded_model)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = gguf_core.encode_chat(messages)
    assert hf_core.encode_chat(messages) == ids
    assert greedy(hf_core, ids) == greedy(gguf_core, ids)


def test_directory_without_weights_is_refused(tmp_path: Path, hf_dir: Path) -> None:
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)
