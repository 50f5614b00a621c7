"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) for the
Llama family, into the same canonical weights as the GGUF loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shared.errors import ModelLoadError

from .config import ModelConfig
from .weights import LayerWeights, ModelWeights

_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, float | str]]:
    """rope_theta and the scaling dict (every key transformers reads; rope.py validates them)."""
    # transformers >= 5 writes RoPE settings as `rope_parameters` (theta and scaling together)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    # None stands for "the default" in transformers' dicts, so it is left out
    scaling = {
        k: v for k, v in rope.items() if k not in ("rope_theta", "type", "rope_type") and v is not None
    }
    kind = rope.get("rope_type") or rope.get("type") or "default"  # transformers' precedence
    # Phi-3 style: a top-level original_max_position_embeddings wins over the one in the dict
    if kind in ("yarn", "llama3") and raw.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        scaling["partial_rotary_factor"] = partial  # kept so that rope.py refuses it by name
    elif kind in ("default", "none"):
        return theta, {}
    return theta, {"type": kind, **scaling}


def read_hf_config(directory: Path) -> ModelConfig:
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{directory} has no readable config.json: {exc}") from exc
    archs = raw.get("architectures") or []
    arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
    if arch is None and not archs:  # some writers leave architectures out; model_type still tells
        arch = _MODEL_TYPES.get(raw.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(
            f"unsupported architectures {archs} (model_type {raw.get('model_type')!r}); "
            f"supported: {sorted(_ARCHS)}"
        )
    heads = int(raw["num_attention_heads"])
    try:
        theta, scaling = _rope_settings(raw)
        return ModelConfig(
            arch=arch,
            num_layers=int(raw["num_hidden_layers"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            vocab_size=int(raw["vocab_size"]),
            max_position=int(raw.get("max_position_embeddings", 4096)),
            rope_theta=theta,
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attn_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            rope_scaling=scaling,
        )
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"config.json is missing or has a bad {exc}") from exc


def load_hf_dir(directory: str | Path) -> ModelWeights:
    from safetensors.torch import load_file

    d = Path(directory)
    config = read_hf_config(d)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d} holds no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as exc:
            raise ModelLoadError(f"{f.name} cannot be read: {exc}") from exc

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{d} lacks tensor {name}")
        return t.float()

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                attn_norm=get(p + "input_layernorm.weight"),
                wq=get(p + "self_attn.q_proj.weight"),
                wk=get(p + "self_attn.k_proj.weight"),
                wv=get(p + "self_attn.v_proj.weight"),
                wo=get(p + "self_attn.o_proj.weight"),
                ffn_norm=get(p + "post_attention_layernorm.weight"),
                w_gate=get(p + "mlp.gate_proj.weight"),
                w_up=get(p + "mlp.up_proj.weight"),
                w_down=get(p + "mlp.down_proj.weight"),
                bq=opt(p + "self_attn.q_proj.bias"),
                bk=opt(p + "self_attn.k_proj.bias"),
                bv=opt(p + "self_attn.v_proj.bias"),
            )
        )
    # tied checkpoints store the shared matrix under either name (safetensors drops the alias)
    if "model.embed_tokens.weight" not in tensors and config.tie_embeddings:
        embed = get("lm_head.weight")
    else:
        embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_embeddings or "lm_head.weight" not in tensors else get("lm_head.weight")
    weights = ModelWeights(config, embed, layers, get("model.norm.weight"), lm_head)
    weights.check_shapes()
    return weights
