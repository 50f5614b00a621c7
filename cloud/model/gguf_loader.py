"""Read a Llama-family GGUF file: hyper-parameters, tokenizer data and dequantized weights.

llama.cpp's converter stores Q and K rows of `llama` models permuted for its interleaved RoPE;
we undo that permutation so every loader yields Hugging Face (rotate-half) layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.cpu.gguf_matmul import QTYPES, GGUFWeight
from shared.errors import ModelLoadError

from .config import ModelConfig
from .weights import LayerWeights, ModelWeights

SUPPORTED_ARCHS = ("llama", "qwen2")
# Tensor types we dequantize; anything else is refused with its name.
_SUPPORTED_QTYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
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


@dataclass(frozen=True, slots=True)
class GGUFTokenizerData:
    model: str  # "gpt2" (byte-level BPE)
    pre: str  # pre-tokenizer name, e.g. "smollm", "qwen2", "llama-bpe"
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None


def _open(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError ... on damage
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


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
    try:
        return ModelConfig(
            arch=arch,
            num_layers=int(need("block_count")),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
            vocab_size=vocab,
            max_position=int(need("context_length")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in names,
            attn_bias="blk.0.attn_q.bias" in names,
            rope_scaling=_read_rope_scaling(reader, arch),
            rope_freq_factors=_read_freq_factors(reader),
        )
    except ValueError as exc:
        raise ModelLoadError(f"inconsistent GGUF hyper-parameters: {exc}") from exc


def read_tokenizer_data(reader: Any) -> GGUFTokenizerData:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {model!r}; only byte-level BPE ('gpt2') is supported"
        )
    return GGUFTokenizerData(
        model=model,
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type", [])],
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizerData:
    """Read only the tokenizer metadata of a GGUF file (no tensor is dequantized)."""
    return read_tokenizer_data(_open(Path(path)))


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
    try:
        arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:
        raise ModelLoadError(f"tensor {tensor.name} cannot be decoded: {exc}") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists ne0 (the row length) first
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
    reader = _open(Path(path))
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
