"""Attention over the KV pool for one packed engine step (the kernels of `DialogEngine.step`).

A step's rows are one-token rows (decode, and one-token prefill chunks) and longer prefill chunks. All the
one-token rows go through one batched call (`DecodeBatch`) over each slot's full `S + W` rows; each longer
chunk attends on its own (`attend_one`). Either way a row is computed the same whatever else is in the
step: per-(session, KV head) matmuls, unused rows masked, the sinks always scored with their own rotation
(see `kv_window` for the positions). That is what makes the engine batch-invariant (see `model.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from duplexd.dialog.kv_window import KvPool, Plan
from duplexd.dialog.model import AttendFn, Segment, apply_rope

__all__ = ["DecodeBatch", "attend_one", "attention_weights", "step_attention"]


def step_attention(pool: KvPool, head_dim: int, rows: Sequence[tuple[int, Plan, Segment]]) -> AttendFn:
    """Attention for one step whose packed rows are `rows` ((slot, plan, segment) per session, in packing
    order): all one-token rows in one batched call, each longer chunk on its own."""
    scale = 1.0 / math.sqrt(head_dim)
    sinks = pool.window.sink_tokens
    singles = [(slot, plan, seg) for slot, plan, seg in rows if seg.length == 1]
    chunks = [(slot, plan, seg) for slot, plan, seg in rows if seg.length > 1]
    batch = DecodeBatch.build(pool, [slot for slot, _, _ in singles], [plan for _, plan, _ in singles])
    single_rows = torch.tensor([seg.start for _, _, seg in singles], dtype=torch.long)
    all_single = len(singles) == len(rows)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if all_single:
            return batch.attend(pool, layer, q, k, v, scale, sinks)
        out = torch.empty_like(q)
        if singles:
            out[single_rows] = batch.attend(pool, layer, q[single_rows], k[single_rows], v[single_rows], scale, sinks)
        for slot, plan, seg in chunks:
            span = slice(seg.start, seg.start + seg.length)
            k_cache, v_cache = pool.k[layer, slot], pool.v[layer, slot]
            out[span] = attend_one(k_cache, v_cache, q[span], k[span], v[span], plan, scale, sinks)
        return out

    return attend


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One-token rows of several sessions, attended in one batched call over each slot's full `S + W` rows.

    Every such row is computed the same way whatever else is in the batch: the sink columns always with
    the sink rotation, the window over all rows (unused ones masked), and per-(session, KV head) matmuls.
    """

    slots: Tensor
    span: slice | None  # the slots as a slice when they are consecutive (a view instead of a gather)
    rows: Tensor  # cache row each new key goes to
    mask: Tensor  # [B, 1, 1, S + W + 1]
    rot_abs: Tensor  # [B, D/2]
    rot_sink: Tensor  # [B, D/2]

    @classmethod
    def build(cls, pool: KvPool, slots: list[int], plans: list[Plan]) -> DecodeBatch:
        capacity = pool.window.capacity
        mask = torch.full((len(plans), capacity + 1), float("-inf"))
        for i, plan in enumerate(plans):
            mask[i, : plan.used] = plan.mask[0, : plan.used]
            mask[i, capacity] = plan.mask[0, plan.used]
        consecutive = bool(slots) and slots == list(range(slots[0], slots[0] + len(slots)))
        return cls(
            slots=torch.tensor(slots, dtype=torch.long),
            span=slice(slots[0], slots[0] + len(slots)) if consecutive else None,
            rows=torch.cat([p.rows for p in plans]) if plans else torch.empty(0, dtype=torch.long),
            mask=mask[:, None, None, :],
            rot_abs=torch.cat([p.rot_abs for p in plans]) if plans else torch.empty(0),
            rot_sink=torch.cat([p.rot_abs if p.rot_sink is None else p.rot_sink for p in plans])
            if plans
            else torch.empty(0),
        )

    def attend(self, pool: KvPool, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: int) -> Tensor:
        """`q[B, H, D]`, `k`/`v[B, Hkv, D]` (pre-RoPE) -> `[B, H, D]`; the new keys/values go into the pool."""
        b, heads, dim = q.shape
        kv_heads = k.shape[1]
        if self.span is not None:
            k_cache, v_cache = pool.k[layer, self.span], pool.v[layer, self.span]
        else:
            k_cache, v_cache = pool.k[layer].index_select(0, self.slots), pool.v[layer].index_select(0, self.slots)
        q_abs = apply_rope(q, self.rot_abs).view(b, kv_heads, heads // kv_heads, dim)
        k = apply_rope(k, self.rot_abs).unsqueeze(2)  # [B, Hkv, 1, D]
        v = v.unsqueeze(2)
        scores = [q_abs @ k_cache.transpose(-1, -2), q_abs @ k.transpose(-1, -2)]
        if sinks:
            q_sink = apply_rope(q, self.rot_sink).view(b, kv_heads, heads // kv_heads, dim)
            scores[0][..., :sinks] = q_sink @ k_cache[:, :, :sinks].transpose(-1, -2)
        probs = attention_weights(torch.cat(scores, dim=-1), scale, self.mask, v.dtype)
        capacity = k_cache.shape[2]
        out = probs[..., :capacity] @ v_cache + probs[..., capacity:] * v
        pool.k[layer, self.slots, :, self.rows] = k[:, :, 0]
        pool.v[layer, self.slots, :, self.rows] = v[:, :, 0]
        return out.reshape(b, heads, dim)


def attention_weights(scores: Tensor, scale: float, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Softmax of `scores * scale + mask` in float32, cast to `dtype`.

    exp() of scores more than ~87 below the row's max underflows to subnormals, which x86 handles ~100x
    slower (measured: a 1 s decode step instead of 40 ms; attention sinks make such gaps common). Raising
    them to max - 80 before masking changes each weight by < 2e-35: nothing, in float32.
    """
    scores = scores.float() * scale
    scores = torch.maximum(scores, scores.amax(-1, keepdim=True) - 80.0) + mask
    return torch.softmax(scores, dim=-1).to(dtype)


def attend_one(
    k_cache: Tensor, v_cache: Tensor, q: Tensor, k: Tensor, v: Tensor, plan: Plan, scale: float, sinks: int
) -> Tensor:
    """One session's attention for its `n` new tokens, then their keys/values go into the cache.

    `k_cache`, `v_cache`: `[Hkv, S+W, D]` views of the pool; `q[n, H, D]`, `k`/`v[n, Hkv, D]` pre-RoPE.
    """
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads

    def by_kv_head(x: Tensor) -> Tensor:  # [n, H, D] -> [Hkv, group * n, D]
        return x.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)

    q_abs = by_kv_head(apply_rope(q, plan.rot_abs))
    k = apply_rope(k, plan.rot_abs).transpose(0, 1)  # [Hkv, n, D]
    v = v.transpose(0, 1)
    used = plan.used
    old_k = k_cache[:, :used]
    scores_old = q_abs @ old_k.transpose(1, 2)
    if plan.rot_sink is not None and used:
        s = min(sinks, used)
        q_sink = by_kv_head(apply_rope(q, plan.rot_sink))
        scores_old[:, :, :s] = q_sink @ old_k[:, :s].transpose(1, 2)
    probs = attention_weights(torch.cat([scores_old, q_abs @ k.transpose(1, 2)], dim=-1), scale, plan.mask, v.dtype)
    out = probs[:, :, :used] @ v_cache[:, :used] + probs[:, :, used:] @ v
    k_cache[:, plan.rows] = k
    v_cache[:, plan.rows] = v
    return out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)
