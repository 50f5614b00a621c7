"""The Llama-family forward (llama, qwen2) over a paged KV cache.

One call runs a whole engine step: every scheduled request's new tokens, flattened into one
[tokens, hidden] batch, so projections and MLPs are single matmuls; only attention looks at
request boundaries, through the `StepAttention` the engine hands it for the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels.cpu import norm_rope as cpu_norm_rope
from kernels.cpu.gguf_matmul import GGUFWeight, gguf_dequantize

from .linear import Linear, WeightPlan
from .rope import RotaryEmbedding
from .weights import ModelWeights


def fp32_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm in fp32 whatever the run dtype, the weight applied before the cast back (Gemma 3's
    reference order; Llama's casts first, the same arithmetic in an fp32 run); spelled out because
    F.rms_norm dispatches through several ops on a CPU and costs more per call."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * weight).to(dtype)


class StepAttention(Protocol):
    """Attention for one step, as the engine binds it to its KV cache and the step's metadata. The
    model only knows this seam (the model never imports the engine): each layer hands over its fresh
    keys and values, which the engine stores in the cache, and gets the attention output back."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d] (this step's) -> [tokens, heads, d]."""
        ...


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear  # fused q, k, v: [q_size + 2 * kv_size, hidden]
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear  # fused gate and up: [2 * intermediate, hidden]
    down: Linear


def _fused(blocks: dict[str, GGUFWeight], *names: str) -> GGUFWeight | None:
    """The named projections' blocks stacked into one weight, when all have blocks of one format."""
    parts = [blocks.get(n) for n in names]
    if any(p is None for p in parts):
        return None
    ws = [p for p in parts if p is not None]
    if len({(w.qtype, w.in_features) for w in ws}) != 1:
        return None
    return GGUFWeight.cat(ws)


class LlamaModel:
    def __init__(
        self,
        weights: ModelWeights,
        *,
        dtype: torch.dtype = torch.float32,
        plan: WeightPlan | None = None,
        max_positions: int | None = None,
        device: torch.device | str = "cpu",
        fused_kernels: bool | None = None,
    ) -> None:
        c = weights.config
        self.config = c
        self.dtype = dtype
        self.device = dev = torch.device(device)
        # fused residual + RMSNorm, in-place RoPE (and on a CPU SiLU * up): Triton's on a GPU
        # (kernels/triton/norm_rope.py), C++ on a CPU for fp32 (kernels/cpu/norm_rope.py); each
        # replaces several ops per layer, whose dispatch dominated a CPU decode step's own work
        if fused_kernels is None:
            fused_kernels = dev.type == "cuda" or (dtype == torch.float32 and cpu_norm_rope.available())
        self.fused = fused_kernels
        plan = plan or WeightPlan.single("float32")
        self.plan = plan
        self.layers: list[_Layer] = []
        for lw in weights.layers:
            bias = None
            if lw.bq is not None and lw.bk is not None and lw.bv is not None:
                bias = torch.cat([lw.bq, lw.bk, lw.bv])
            b = lw.blocks
            self.layers.append(
                _Layer(
                    attn_norm=lw.attn_norm.float().to(dev),
                    qkv=Linear(
                        torch.cat([lw.wq, lw.wk, lw.wv]), bias, dtype, plan, dev, _fused(b, "wq", "wk", "wv")
                    ),
                    o=Linear(lw.wo, None, dtype, plan, dev, b.get("wo")),
                    ffn_norm=lw.ffn_norm.float().to(dev),
                    gate_up=Linear(
                        torch.cat([lw.w_gate, lw.w_up]), None, dtype, plan, dev, _fused(b, "w_gate", "w_up")
                    ),
                    down=Linear(lw.w_down, None, dtype, plan, dev, b.get("w_down")),
                )
            )
        self.final_norm = weights.final_norm.float().to(dev)
        self.lm_head = Linear(weights.lm_head, None, dtype, plan, dev, weights.lm_head_blocks)
        # a tied head that runs on the file's blocks serves the embedding lookup too: the rows a step
        # needs are dequantized from them (the float table's exact values), and the float table
        # (113 MiB for the default model) is not kept
        self.embed_blocks = None
        self.embed = torch.empty(0)
        tied = weights.lm_head is weights.embed and weights.lm_head_blocks is not None
        if tied and self.lm_head.large.kind == "gguf" and dtype == torch.float32:
            self.embed_blocks = weights.lm_head_blocks
        else:
            self.embed = weights.embed.to(device=dev, dtype=dtype)
        self.rope = RotaryEmbedding(c, max_positions or c.max_position, dtype, dev)

    def resize_rope(self, max_positions: int) -> None:
        """Rebuild the RoPE tables for another longest context (dynamic NTK depends on it)."""
        if max_positions != self.rope.max_positions:
            self.rope = RotaryEmbedding(self.config, max_positions, self.dtype, self.device)

    def attention_window(self, layer: int) -> int | None:
        """How many most recent positions (the query's own included) the layer attends to; None: all.
        Every Llama-family layer is global; Gemma 3's local layers answer their sliding window."""
        return None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_blocks is not None:
            return gguf_dequantize(self.embed_blocks.rows(input_ids))
        return self.embed[input_ids]

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
        if self.fused:
            return self._forward_fused(input_ids, positions, attention, logits_rows, max_position, head)
        c = self.config
        n = input_ids.shape[0]
        h = self._embed(input_ids)  # [tokens, hidden]
        cos, sin = self.rope.tables(positions, max_position)
        heads_qk = c.num_heads + c.num_kv_heads
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.attn_norm)
            qkv = layer.qkv(x)
            qk = self.rope.apply(qkv[:, : c.q_size + c.kv_size].view(n, heads_qk, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
            o = attention(i, q, k, v)  # [tokens, heads, head_dim]
            h = h + layer.o(o.reshape(n, c.q_size))
            x = self._norm(h, layer.ffn_norm)
            gu = layer.gate_up(x)
            h = h + layer.down(F.silu(gu[:, : c.intermediate_size]) * gu[:, c.intermediate_size :])
        last = self._norm(h[logits_rows], self.final_norm)
        return self.lm_head(last).float() if head else last.float()

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        logits_rows: torch.Tensor,
        max_position: int | None,
        head: bool = True,
    ) -> torch.Tensor:
        """forward() with each residual add folded into the next RMSNorm and RoPE applied in place:
        the same arithmetic (fp32 norms, the residual rounded to the run dtype) in fewer passes."""
        if self.device.type == "cpu":
            from kernels.cpu.norm_rope import fused_add_rms_norm, rms_norm, rope_apply_, silu_mul
        else:
            from kernels.triton.norm_rope import fused_add_rms_norm, rms_norm, rope_apply_

            def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
                return F.silu(gate_up[:, : c.intermediate_size]) * gate_up[:, c.intermediate_size :]

        c = self.config
        n = input_ids.shape[0]
        eps = c.rms_eps
        h = self._embed(input_ids)  # [tokens, hidden], the residual stream
        cos, sin = self.rope.tables(positions, max_position)
        if cos.dim() == 3:  # [T, 1, d] -> [T, d]
            cos, sin = cos[:, 0], sin[:, 0]
        heads_qk = c.num_heads + c.num_kv_heads
        x = rms_norm(h, self.layers[0].attn_norm, eps) if self.layers else h
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            qk = rope_apply_(qkv[:, : c.q_size + c.kv_size].view(n, heads_qk, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
            o = attention(i, q, k, v)  # [tokens, heads, head_dim]
            x, h = fused_add_rms_norm(layer.o(o.reshape(n, c.q_size)), h, layer.ffn_norm, eps)
            down = layer.down(silu_mul(layer.gate_up(x)))
            if i + 1 < len(self.layers):
                x, h = fused_add_rms_norm(down, h, self.layers[i + 1].attn_norm, eps)
            else:
                h = h + down
        last = rms_norm(h[logits_rows], self.final_norm, eps)
        return self.lm_head(last).float() if head else last.float()
