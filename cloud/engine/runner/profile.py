"""The profile run on a GPU (vLLM's): one forward of the largest step the engine will schedule, on
dummy tokens and with no KV cache, to measure the activation peak the KV budget must leave room for.

The step is one prefill of `max_num_batched_tokens` tokens (attention over the step's own keys,
causally, the shape of the largest chunk) with the logits of `max_num_seqs` rows, as the biggest
mixed step would ask for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cloud.engine.kv.memory import GPUMemory
from cloud.model.causal_lm import CausalLM


class _SelfAttention:
    """Causal attention over the step's own keys: the profile step is a single fresh prefill."""

    def __init__(self, group: int, scale: float) -> None:
        self.group = group
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [n, heads, d]; k, v: [n, kv_heads, d]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)


def profile_run(model: CausalLM, num_tokens: int, num_rows: int) -> GPUMemory:
    """Run the largest step on the model's GPU and return what the KV planner needs."""
    device = model.device
    c = model.config
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    rows = torch.arange(num_tokens - min(num_rows, num_tokens), num_tokens, device=device)
    attention = _SelfAttention(c.num_heads // c.num_kv_heads, c.head_dim**-0.5)
    logits = model.forward(ids, positions, attention, rows, max_position=num_tokens - 1)
    # the sampler's work on those rows: a softmax and a sort of the vocabulary
    torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del ids, positions, rows, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GPUMemory(free=free, total=total, activation_peak=peak)
