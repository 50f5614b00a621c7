"""The canonical in-memory weights of a Llama-family model, whatever file they came from.

Every loader (GGUF, Hugging Face directory) produces this: fp32 tensors in Hugging Face layout
(Q and K rows in rotate-half order), so the forward has exactly one convention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.cpu.gguf_matmul import GGUFWeight
from shared.errors import ModelLoadError

from .config import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [q_size, hidden]
    wk: torch.Tensor  # [kv_size, hidden]
    wv: torch.Tensor  # [kv_size, hidden]
    wo: torch.Tensor  # [hidden, q_size]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [intermediate, hidden]
    w_up: torch.Tensor  # [intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    # Gemma 3's extra RMSNorms: per-head over Q and K ([head_dim]), and after attention and after the
    # MLP, before each joins the residual ([hidden]); None for the Llama family
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    # the file's own quantized blocks of the projections ("wq", "wk", ... as above, same row order),
    # for kernels that read them (--weight-quant gguf); empty for unquantized files
    blocks: dict[str, GGUFWeight] = field(default_factory=dict)


@dataclass(slots=True)
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied
    lm_head_blocks: GGUFWeight | None = None  # the file's blocks of the LM head, when quantized

    def check_shapes(self) -> None:
        """Raise ModelLoadError naming the first tensor whose shape disagrees with the config."""
        c = self.config
        expect = {
            "embed": (self.embed, (c.vocab_size, c.hidden_size)),
            "final_norm": (self.final_norm, (c.hidden_size,)),
            "lm_head": (self.lm_head, (c.vocab_size, c.hidden_size)),
        }
        for i, lw in enumerate(self.layers):
            expect |= {
                f"layer {i} wq": (lw.wq, (c.q_size, c.hidden_size)),
                f"layer {i} wk": (lw.wk, (c.kv_size, c.hidden_size)),
                f"layer {i} wv": (lw.wv, (c.kv_size, c.hidden_size)),
                f"layer {i} wo": (lw.wo, (c.hidden_size, c.q_size)),
                f"layer {i} w_gate": (lw.w_gate, (c.intermediate_size, c.hidden_size)),
                f"layer {i} w_up": (lw.w_up, (c.intermediate_size, c.hidden_size)),
                f"layer {i} w_down": (lw.w_down, (c.hidden_size, c.intermediate_size)),
            }
            for name, t, n in (
                ("q_norm", lw.q_norm, c.head_dim),
                ("k_norm", lw.k_norm, c.head_dim),
                ("post_attn_norm", lw.post_attn_norm, c.hidden_size),
                ("post_ffn_norm", lw.post_ffn_norm, c.hidden_size),
            ):
                if t is not None:
                    expect[f"layer {i} {name}"] = (t, (n,))
        if len(self.layers) != c.num_layers:
            raise ModelLoadError(f"model has {len(self.layers)} layers, its config says {c.num_layers}")
        for name, (t, shape) in expect.items():
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
