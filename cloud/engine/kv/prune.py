"""Pruning a long prompt's KV to a per-request budget by the attention it gets (SnapKV, arXiv
2404.14469), with the sinks and the prompt's last tokens always kept (`--kv-prune-budget`): the
tensor side. Which prompts, how many tokens and which blocks: prune_plan.py.

When a request whose prompt is longer than the budget has computed its whole prompt (densely, and
sampled its first token from that), the queries of the prompt's last OBSERVATION_WINDOW positions
score every earlier key, per layer and KV head: softmax attention summed over the window and over
the head's query group, max-pooled over POOL_KERNEL neighbours so that a kept token keeps its
neighbourhood. Kept per layer and head: the first SINK_TOKENS tokens, the window itself, and the
best-scored tokens between them, in position order. Every head keeps the same count (its choice
differs), so the kept keys fill whole blocks.

Invariants:
- The kept keys and values are copied into FRESH blocks; the prompt's blocks are never rewritten:
  they may be shared with other requests, are registered in the prefix cache, and stay there as a
  cached prefix once the request releases them.
- A pruned request's blocks no longer match its tokens' hash chain: none of them is ever registered
  in the prefix cache. A recompute after preemption prefills the prompt again (its last
  OBSERVATION_WINDOW tokens always computed, never taken from the cache, since their queries are
  needed), prunes again and then computes its outputs over the pruned cache, as they were first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.prune_plan import OBSERVATION_WINDOW, POOL_KERNEL, SINK_TOKENS, PruneOrder


def observation_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """How much attention the window's queries give each prompt key, per KV head.
    q: [W, heads, d], the prompt's last W positions (RoPE applied); k: [kv_heads, P, d] the prompt's
    keys as cached -> fp32 [kv_heads, P]: softmax over keys (causal: query i of the window sees keys
    up to position P - W + i), summed over the window and the KV head's query group."""
    w, h, d = q.shape
    kvh, p, _ = k.shape
    g = h // kvh
    qg = q.float().view(w, kvh, g, d).permute(1, 2, 0, 3)  # [kvh, g, W, d]: head kvh*g + j
    logits = torch.matmul(qg, k.float().transpose(1, 2)[:, None]) * scale  # [kvh, g, W, P]
    qpos = torch.arange(p - w, p, device=q.device)[:, None]
    later = torch.arange(p, device=q.device)[None, :] > qpos  # [W, P]
    probs = logits.masked_fill(later, -torch.inf).softmax(-1)
    return probs.sum((1, 2))


def select_kept(scores: torch.Tensor, num_kept: int) -> torch.Tensor:
    """scores: [kv_heads, P] (observation_scores) -> [kv_heads, num_kept] positions, ascending: the
    sinks, the window, and between them the best by max-pooled score (ties: the earlier position)."""
    kvh, p = scores.shape
    sinks, window = SINK_TOKENS, OBSERVATION_WINDOW
    between = num_kept - sinks - window
    if between < 0 or num_kept > p:
        raise ValueError(f"cannot keep {num_kept} of {p} tokens with {sinks} sinks and a {window} window")
    pooled = F.max_pool1d(scores[:, None, : p - window], POOL_KERNEL, 1, POOL_KERNEL // 2)[:, 0]
    order = pooled[:, sinks:].sort(dim=1, descending=True, stable=True).indices  # [kvh, P - W - sinks]
    picked = order[:, :between] + sinks
    fixed = torch.cat([torch.arange(sinks), torch.arange(p - window, p)]).to(scores.device)
    kept = torch.cat([fixed.expand(kvh, -1), picked], dim=1)
    return kept.sort(dim=1).values


def compact(
    cache: KVCache,
    order: PruneOrder,
    observed: Sequence[torch.Tensor],
    scale: float,
) -> None:
    """Carry out a PruneOrder on every layer. observed: per layer, [W, heads, d] the window's queries.
    The kept token j of a head goes to slot j of the fresh blocks (block j // bs, offset j % bs)."""
    bs = cache.block_size
    p, kept = order.num_prompt_tokens, order.num_kept
    device = cache.device
    old = torch.tensor(order.old_blocks, dtype=torch.long, device=device)
    new = torch.tensor(order.new_blocks, dtype=torch.long, device=device)
    j = torch.arange(kept, device=device)
    slots = new[j // bs] * bs + j % bs  # [K]
    for layer, q in enumerate(observed):
        k_all, v_all = cache.gather(layer, old)  # [kv_heads, blocks * bs, d]
        k_all, v_all = k_all[:, :p], v_all[:, :p]
        index = select_kept(observation_scores(q, k_all, scale), kept)  # [kv_heads, K]
        at = index[..., None].expand(-1, -1, k_all.shape[-1])
        k_kept, v_kept = k_all.gather(1, at), v_all.gather(1, at)  # [kv_heads, K, d]
        cache.write(layer, k_kept.transpose(0, 1), v_kept.transpose(0, 1), slots)
