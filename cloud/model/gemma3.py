"""The Gemma 3 forward over a paged KV cache, beside llama.py's with the same seams.

What differs from Llama (as transformers' modeling_gemma3 and llama.cpp's gemma3 graph compute it):
- the embedding is scaled by sqrt(hidden), the factor rounded to the run dtype first;
- queries and keys get a per-head RMSNorm before RoPE;
- the attention output and the MLP output are each RMSNormed before they join the residual
  (four norms per layer: pre/post attention, pre/post feed-forward);
- the MLP is GeGLU: GELU (tanh approximation) of the gate, times up;
- local layers attend to a sliding window with RoPE base 10000; every sixth layer is global with the
  file's base and any RoPE scaling (transformers scales only the global layers' frequencies);
- scores are scaled by query_pre_attn_scalar ** -0.5, which need not be head_dim ** -0.5;
- the output head is tied to the embedding.
Gemma's norms multiply by (1 + w); the GGUF converter stored 1 + w, so they are plain RMSNorms here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .linear import Linear, WeightPlan
from .llama import StepAttention, fp32_rms_norm
from .rope import RotaryEmbedding
from .weights import ModelWeights

_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's local-layer base, where a config does not name its own


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear  # fused q, k, v: [q_size + 2 * kv_size, hidden]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    o: Linear
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Linear  # fused gate and up: [2 * intermediate, hidden]
    down: Linear
    post_ffn_norm: torch.Tensor


def local_rope_config(c: ModelConfig) -> ModelConfig:
    """The local layers' RoPE: their own base, no scaling, no frequency factors."""
    return replace(
        c, rope_theta=c.rope_local_theta or _LOCAL_ROPE_THETA, rope_scaling={}, rope_freq_factors=()
    )


class Gemma3Model:
    def __init__(
        self,
        weights: ModelWeights,
        *,
        dtype: torch.dtype = torch.float32,
        plan: WeightPlan | None = None,
        max_positions: int | None = None,
        device: torch.device | str = "cpu",
        fused_kernels: bool | None = None,  # accepted for LlamaModel's signature; Gemma runs unfused
    ) -> None:
        c = weights.config
        self.config = c
        self.dtype = dtype
        self.device = dev = torch.device(device)
        plan = plan or WeightPlan.single("float32")
        self.plan = plan

        def norm(t: torch.Tensor | None, name: str, i: int) -> torch.Tensor:
            if t is None:
                raise ValueError(f"Gemma 3 layer {i} lacks its {name}")
            return t.float().to(dev)

        self.layers: list[_Layer] = []
        for i, lw in enumerate(weights.layers):
            self.layers.append(
                _Layer(
                    attn_norm=lw.attn_norm.float().to(dev),
                    qkv=Linear(torch.cat([lw.wq, lw.wk, lw.wv]), None, dtype, plan, dev),
                    q_norm=norm(lw.q_norm, "q_norm", i),
                    k_norm=norm(lw.k_norm, "k_norm", i),
                    o=Linear(lw.wo, None, dtype, plan, dev, lw.blocks.get("wo")),
                    post_attn_norm=norm(lw.post_attn_norm, "post_attn_norm", i),
                    ffn_norm=lw.ffn_norm.float().to(dev),
                    gate_up=Linear(torch.cat([lw.w_gate, lw.w_up]), None, dtype, plan, dev),
                    down=Linear(lw.w_down, None, dtype, plan, dev, lw.blocks.get("w_down")),
                    post_ffn_norm=norm(lw.post_ffn_norm, "post_ffn_norm", i),
                )
            )
        self.final_norm = weights.final_norm.float().to(dev)
        self.lm_head = Linear(weights.lm_head, None, dtype, plan, dev, weights.lm_head_blocks)
        self.embed = weights.embed.to(device=dev, dtype=dtype)
        # transformers multiplies by the scale cast to the embedding's dtype (sqrt(640) in bf16 is 25.25)
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=dtype, device=dev)
        # the backends scale scores by head_dim ** -0.5; a different query_pre_attn_scalar is folded
        # into the queries (1.0 for the 270M, whose scalar is its head_dim)
        qpas = c.query_pre_attn_scalar or c.head_dim
        self.q_scale = (c.head_dim / qpas) ** 0.5
        positions = max_positions or c.max_position
        self.rope = RotaryEmbedding(c, positions, dtype, dev)  # the global layers'
        self.rope_local = RotaryEmbedding(local_rope_config(c), positions, dtype, dev)

    def resize_rope(self, max_positions: int) -> None:
        """Rebuild the RoPE tables for another longest context (dynamic NTK depends on it)."""
        if max_positions != self.rope.max_positions:
            self.rope = RotaryEmbedding(self.config, max_positions, self.dtype, self.device)
            self.rope_local = RotaryEmbedding(
                local_rope_config(self.config), max_positions, self.dtype, self.device
            )

    def attention_window(self, layer: int) -> int | None:
        """How many most recent positions (the query's own included) the layer attends to; None: all."""
        return self.config.attention_window(layer)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return fp32_rms_norm(x, weight, self.config.rms_eps, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens] int64
        positions: torch.Tensor,  # [tokens] int64
        attention: StepAttention,
        logits_rows: torch.Tensor,  # [sampled] rows of the step whose next-token logits are wanted
        max_position: int | None = None,  # the largest of positions, when the caller knows it
        head: bool = True,  # False: the final-normed hidden states of logits_rows (embeddings)
    ) -> torch.Tensor:
        """Run one step; returns fp32 logits [sampled, vocab], or fp32 hidden states [sampled, hidden]
        when head is False."""
        c = self.config
        n = input_ids.shape[0]
        h = self.embed[input_ids] * self.embed_scale  # [tokens, hidden], the residual stream
        tables = {
            True: self.rope_local.tables(positions, max_position),
            False: self.rope.tables(positions, max_position),
        }
        inter = c.intermediate_size
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.attn_norm)
            qkv = layer.qkv(x)
            q = self._norm(qkv[:, : c.q_size].view(n, c.num_heads, c.head_dim), layer.q_norm)
            k = self._norm(
                qkv[:, c.q_size : c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim), layer.k_norm
            )
            v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
            cos, sin = tables[self.attention_window(i) is not None]
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
            if self.q_scale != 1.0:
                q = q * self.q_scale
            o = attention(i, q, k.contiguous(), v.contiguous())  # [tokens, heads, head_dim]
            h = h + self._norm(layer.o(o.reshape(n, c.q_size)), layer.post_attn_norm)
            gu = layer.gate_up(self._norm(h, layer.ffn_norm))
            y = layer.down(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:])
            h = h + self._norm(y, layer.post_ffn_norm)
        last = self._norm(h[logits_rows], self.final_norm)
        return self.lm_head(last).float() if head else last.float()
