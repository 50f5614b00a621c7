"""Read a Llama-family or Gemma 3 GGUF file: hyper-parameters, tokenizer data and dequantized weights.

llama.cpp's converter stores Q and K rows of `llama` models permuted for its interleaved RoPE;
we undo that permutation so every loader yields Hugging Face (rotate-half) layout. It stores Gemma's
RMSNorm weights as 1 + w (Gemma scales by 1 + w), so they serve as plain RMSNorm weights here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.cpu.gguf_matmul import QTYPES, GGUFWeight
from shared.errors import ModelLoadError

from .config import ModelConfig
from .gguf_vocab import GGUFTokenizerData, _field, open_gguf, read_tokenizer_data
from .kquants import KQUANTS
from .kquants import dequantize as dequantize_kquant
from .weights import LayerWeights, ModelWeights

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
# Tensor types we dequantize (the K-quants, 5-bit types and Q8_0 in torch, kquants.py; these with the
# gguf package's numpy decoders); anything else is refused with its name.
_SUPPORTED_QTYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", *KQUANTS}
# Gemma 3's layout, as llama.cpp's gemma3 graph and transformers' Gemma3TextConfig both have it: every
# sixth layer (5, 11, 17, ...) is global, the others attend to a sliding window with RoPE base 10000
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
# the projections whose quantized blocks are kept for the GGUF weight kernels: LayerWeights name -> tensor
_PROJECTIONS = {
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}


# llama.cpp's {arch}.rope.scaling.* keys -> the transformers rope_parameters name they were converted from
_GGUF_ROPE_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def _read_rope_scaling(reader: Any, arch: str) -> dict[str, float | str]:
    stype = _field(reader, f"{arch}.rope.scaling.type")
    if not stype or stype == "none":
        return {}
    scaling: dict[str, float | str] = {"type": str(stype), "factor": 1.0}  # llama.cpp's default factor
    for key, name in _GGUF_ROPE_KEYS.items():
        value = _field(reader, f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[name] = int(value) if name == "original_max_position_embeddings" else float(value)
    log_mul = _field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_mul:
        # the converter stores DeepSeek's 0.1 * mscale_all_dim; those checkpoints have mscale equal to
        # it, so YaRN's factor on cos / sin cancels to 1 (llama.cpp moves it into the softmax scale)
        scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
    return scaling


def _read_freq_factors(reader: Any) -> tuple[float, ...]:
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return () if tensor is None else tuple(_dequantize(tensor).flatten().tolist())


def read_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    names = {t.name for t in reader.tensors}
    # Gemma's heads are wider than hidden / heads (256 vs 160 for the 270M): the file says so
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        window = int(need("attention.sliding_window"))
        layers = int(need("block_count"))
        gemma = {
            "layer_windows": tuple(
                None if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else window for i in range(layers)
            ),
            "rope_local_theta": _GEMMA3_LOCAL_ROPE_THETA,
        }
    try:
        return ModelConfig(
            arch=arch,
            num_layers=int(need("block_count")),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(_field(reader, f"{arch}.rope.dimension_count", head_dim)),
            vocab_size=vocab,
            max_position=int(need("context_length")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in names,
            attn_bias="blk.0.attn_q.bias" in names,
            rope_scaling=_read_rope_scaling(reader, arch),
            rope_freq_factors=_read_freq_factors(reader),
            **gemma,
        )
    except ValueError as exc:
        raise ModelLoadError(f"inconsistent GGUF hyper-parameters: {exc}") from exc


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _dequantize(tensor: Any) -> torch.Tensor:
    import gguf

    qname = tensor.tensor_type.name
    if qname not in _SUPPORTED_QTYPES:
        raise ModelLoadError(f"tensor {tensor.name} has unsupported type {qname}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists ne0 (the row length) first
    if qname in KQUANTS:
        try:
            raw = torch.frombuffer(
                bytearray(np.asarray(tensor.data, dtype=np.uint8).tobytes()), dtype=torch.uint8
            )
            return dequantize_kquant(raw, qname, int(np.prod(shape))).reshape(shape)
        except ValueError as exc:
            raise ModelLoadError(f"tensor {tensor.name} cannot be decoded: {exc}") from exc
    try:
        arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ModelLoadError(f"tensor {tensor.name} cannot be decoded: {exc}") from exc
    if arr.size != int(np.prod(shape)):
        raise ModelLoadError(f"tensor {tensor.name} holds {arr.size} values, its shape says {shape}")
    # copy: F32 tensors come back as read-only views of the memory-mapped file
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))


def _blocks(tensor: Any, permute_heads: int = 0) -> GGUFWeight | None:
    """The tensor's own quantized blocks, for kernels that read them (None for float tensors); Q and
    K rows are un-permuted as the dequantized ones are (rows are whole blocks)."""
    qname = tensor.tensor_type.name
    if qname not in QTYPES:
        return None
    w = GGUFWeight.from_numpy(tensor.data, qname, int(tensor.shape[0]))
    if permute_heads:
        order = _unpermute(torch.arange(w.out_features).unsqueeze(1), permute_heads).squeeze(1)
        w = w.rows(order)
    return w


def load_gguf(path: str | Path) -> tuple[ModelWeights, GGUFTokenizerData]:
    """Load weights (dequantized to fp32, HF layout) and tokenizer data from a GGUF file."""
    return read_gguf(open_gguf(Path(path)))


def read_gguf(reader: Any) -> tuple[ModelWeights, GGUFTokenizerData]:
    """load_gguf over an open reader (opening parses every metadata field: seconds for a
    262K-token vocabulary, so a caller that also reads raw tensors opens once)."""
    config = read_config(reader)
    tok = read_tokenizer_data(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"GGUF file lacks tensor {name}")
        return _dequantize(t)

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in tensors else None

    def blocks(prefix: str, heads: dict[str, int]) -> dict[str, GGUFWeight]:
        out = {}
        for key, name in _PROJECTIONS.items():
            b = _blocks(tensors[prefix + name], heads.get(key, 0))
            if b is not None:
                out[key] = b
        return out

    permute = config.arch == "llama"
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        wq, wk = get(p + "attn_q.weight"), get(p + "attn_k.weight")
        if permute:
            wq, wk = _unpermute(wq, config.num_heads), _unpermute(wk, config.num_kv_heads)
        layers.append(
            LayerWeights(
                attn_norm=get(p + "attn_norm.weight"),
                wq=wq,
                wk=wk,
                wv=get(p + "attn_v.weight"),
                wo=get(p + "attn_output.weight"),
                ffn_norm=get(p + "ffn_norm.weight"),
                w_gate=get(p + "ffn_gate.weight"),
                w_up=get(p + "ffn_up.weight"),
                w_down=get(p + "ffn_down.weight"),
                bq=opt(p + "attn_q.bias"),
                bk=opt(p + "attn_k.bias"),
                bv=opt(p + "attn_v.bias"),
                q_norm=opt(p + "attn_q_norm.weight"),
                k_norm=opt(p + "attn_k_norm.weight"),
                post_attn_norm=opt(p + "post_attention_norm.weight"),
                post_ffn_norm=opt(p + "post_ffw_norm.weight"),
                blocks=blocks(p, {"wq": config.num_heads, "wk": config.num_kv_heads} if permute else {}),
            )
        )
    embed = get("token_embd.weight")
    head_name = "token_embd.weight" if config.tie_embeddings else "output.weight"
    lm_head = embed if config.tie_embeddings else get(head_name)
    head_blocks = _blocks(tensors[head_name])
    weights = ModelWeights(config, embed, layers, get("output_norm.weight"), lm_head, head_blocks)
    weights.check_shapes()
    return weights, tok
