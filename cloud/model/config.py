"""Hyper-parameters of a Llama-family model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "gemma3"
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
    # Gemma 3: each layer's sliding window (None: a global layer attending to everything), the RoPE
    # base of the windowed layers (rope_theta and rope_scaling are the global layers'), and the
    # attention's query scale as query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    layer_windows: tuple[int | None, ...] = ()
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

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

        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be positive, got {self.layer_windows}")

    def attention_window(self, layer: int) -> int | None:
        """How many most recent positions (the query's own included) the layer sees; None: all."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
