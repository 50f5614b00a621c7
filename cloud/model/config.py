"""Hyper-parameters of a Llama-family model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int  # the context the model was trained for
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    attn_bias: bool = False  # qwen2 has q/k/v biases
    # transformers' rope_parameters names ("type" or "rope_type", "factor", ...); validated and turned
    # into frequencies by rope.py, which is also where a user's override goes (with_rope_scaling)
    rope_scaling: dict[str, float | str] = field(default_factory=dict)
    # llama.cpp's rope_freqs tensor, [head_dim // 2] divisors of the frequencies: how GGUF files carry
    # Llama 3.x's llama3 scaling (the converter bakes it in and writes no rope.scaling.* keys)
    rope_freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"{len(self.rope_freq_factors)} RoPE frequency factors for head_dim {self.head_dim} "
                f"(expected {self.head_dim // 2})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
