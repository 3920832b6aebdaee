"""Attention over the KV pool for one packed engine step (the kernels of `DialogEngine.step`).

A step's rows are one-token rows (decode, and one-token prefill chunks) and longer prefill chunks. The
one-token rows go through one batched call per length bucket (`DecodeBatch`: each over its sessions' used
rows, rounded up to `BUCKET_ROWS`); each longer chunk attends on its own (`attend_one`). Either way a row is
computed the same whatever else is in the step: per-(session, KV head) matmuls, unused rows masked, the
sinks always scored with their own rotation (see `kv_window` for the positions). That is what makes the
engine batch-invariant (see `model.py`).
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
    order). One-token rows, and each token of a chunk that evicts nothing its own tokens still see
    (`one_token_plans`), go in one batched call (`DecodeBatch`): a token's numbers are then the same
    whether it came alone or in a chunk of any size, which is what keeps a reply independent of how its
    prompt arrived (speculative drafts lossless). A chunk that overwrites rows its earlier tokens still see
    (a full window) attends on its own (`attend_one`)."""
    scale = 1.0 / math.sqrt(head_dim)
    sinks = pool.window.sink_tokens
    singles: list[tuple[int, Plan, Segment]] = []
    chunks: list[tuple[int, Plan, Segment]] = []
    for slot, plan, seg in rows:
        parts = [plan] if seg.length == 1 else one_token_plans(plan)
        if parts is None:
            chunks.append((slot, plan, seg))
        else:
            singles.extend((slot, part, Segment(seg.start + i, 1)) for i, part in enumerate(parts))
    batch = DecodeBatch.build(pool, [slot for slot, _, _ in singles], [plan for _, plan, _ in singles])
    device = pool.k.device
    single_rows = torch.tensor([seg.start for _, _, seg in singles], dtype=torch.long).to(device)
    chunks = [(slot, plan.to(device), seg) for slot, plan, seg in chunks]
    all_single = not chunks

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if all_single:  # (then `singles` is every row, in packing order)
            return batch.attend(pool, layer, q, k, v, scale, sinks)
        out = torch.empty_like(q)
        if singles:
            out[single_rows] = batch.attend(pool, layer, q[single_rows], k[single_rows], v[single_rows], scale, sinks)
        for slot, plan, seg in chunks:
            span = slice(seg.start, seg.start + seg.length)
            k_cache, v_cache = pool.k[layer, slot], pool.v[layer, slot]
            cd = pool.compute_dtype(plan.used + seg.length)
            out[span] = attend_one(k_cache, v_cache, q[span], k[span], v[span], plan, scale, sinks, cd)
        return out

    return attend


def one_token_plans(plan: Plan) -> list[Plan] | None:
    """A chunk's tokens as the plans each would have had alone, one after another (the cache as the chunk
    found it plus the chunk's earlier tokens), or None when that is not the same attention: a token of the
    chunk overwrites a row that an earlier token of it still sees, or the sinks need their own rotation."""
    n = len(plan.positions)
    group = plan.mask.shape[0] // n
    rows = plan.rows.tolist()
    used, mask = plan.used, plan.mask[:n]  # (the first of `group` copies: one query row per token)
    if plan.rot_sink is not None:
        return None
    for j, row in enumerate(rows):
        if row < used and j and bool((mask[:j, row] == 0).any()):
            return None
    parts = []
    row_used = used
    for i in range(n):
        own = torch.full((row_used + 1,), float("-inf"))
        own[:used] = mask[i, :used]
        own[plan.rows[:i]] = mask[i, used : used + i]  # (the chunk's earlier tokens, where they went)
        own[row_used] = mask[i, used + i]
        parts.append(
            Plan(
                positions=plan.positions[i : i + 1],
                rows=plan.rows[i : i + 1],
                used=row_used,
                mask=own[None, :].repeat(group, 1),
                rot_abs=plan.rot_abs[i : i + 1],
                rot_sink=None,
            )
        )
        row_used = max(row_used, rows[i] + 1)
    return parts


BUCKET_ROWS = 128  # a one-token row attends over its slot's used rows rounded up to a multiple of this


def bucket_rows(used: int, capacity: int) -> int:
    """The cache rows a session with `used` rows attends over: its own length rounded up, so sessions of
    similar length share one call and a short conversation does not pay for the whole window."""
    return min(capacity, max(BUCKET_ROWS, -(-used // BUCKET_ROWS) * BUCKET_ROWS))


@dataclass(frozen=True, slots=True)
class _Bucket:
    """The one-token rows whose sessions attend over the same number of cache rows."""

    index: Tensor  # their positions in the batch
    slots: Tensor
    span: slice | None  # the slots as a slice when they are consecutive (a view instead of a gather)
    length: int  # cache rows attended, the new key's among them (the rest of the slot is unused)
    mask: Tensor  # [b, 1, 1, length]
    sinks_rotated: bool  # its sessions' sinks are scored with their own rotation (they have evicted tokens)
    padded: bool = False  # `index` repeats its last row up to the pool's attention tile (`KvPool.attention_tile`)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One-token rows of several sessions, attended in one batched call per length bucket.

    A row's bucket is its slot's first `bucket_rows` rows that hold its keys (the new key's row included:
    it is written to the pool before the bucket attends) and whether its session has evicted tokens
    (only then do its sinks need a rotation of their own): both depend on its own session only, so its
    shapes, and its numbers, are the same whatever else is in the step. Unused rows are masked, and the
    matmuls are per (session, KV head).
    """

    slots: Tensor
    rows: Tensor  # cache row each new key goes to
    rot_abs: Tensor  # [B, D/2]
    rot_sink: Tensor  # [B, D/2]
    buckets: tuple[_Bucket, ...]

    @classmethod
    def build(cls, pool: KvPool, slots: list[int], plans: list[Plan]) -> DecodeBatch:
        capacity = pool.window.capacity
        device = pool.k.device
        by_length: dict[tuple[int, bool], list[int]] = {}
        rows = [int(plan.rows[0]) for plan in plans]
        for i, plan in enumerate(plans):
            length = bucket_rows(max(plan.used, rows[i] + 1), capacity)  # (the new key's row is attended too)
            by_length.setdefault((length, plan.rot_sink is not None), []).append(i)
        buckets = []
        tile = pool.attention_tile
        groups = [
            (length, sinks_rotated, members[start : start + tile] if tile else members)
            for (length, sinks_rotated), members in sorted(by_length.items())
            for start in (range(0, len(members), tile) if tile else (0,))
        ]
        for length, sinks_rotated, part in groups:
            # (a tile's rows padded with copies of its last: the same shape every call; a copy's result is
            # that row's own, written twice)
            members = part + [part[-1]] * (tile - len(part)) if tile else part
            mask = torch.full((len(members), length), float("-inf"))
            for j, i in enumerate(members):
                plan = plans[i]
                mask[j, : plan.used] = plan.mask[0, : plan.used]
                mask[j, rows[i]] = plan.mask[0, plan.used]  # (over the evicted token it replaces, if any)
            ids = [slots[i] for i in members]
            consecutive = ids == list(range(ids[0], ids[0] + len(ids)))
            buckets.append(
                _Bucket(
                    index=torch.tensor(members, dtype=torch.long).to(device),
                    slots=torch.tensor(ids, dtype=torch.long).to(device),
                    span=slice(ids[0], ids[0] + len(ids)) if consecutive else None,
                    length=length,
                    mask=mask[:, None, None, :].to(device),
                    sinks_rotated=sinks_rotated,
                    padded=len(members) > len(part),
                )
            )
        return cls(
            slots=torch.tensor(slots, dtype=torch.long).to(device),
            rows=(torch.cat([p.rows for p in plans]) if plans else torch.empty(0, dtype=torch.long)).to(device),
            rot_abs=(torch.cat([p.rot_abs for p in plans]) if plans else torch.empty(0)).to(device),
            rot_sink=(
                torch.cat([p.rot_abs if p.rot_sink is None else p.rot_sink for p in plans]) if plans else torch.empty(0)
            ).to(device),
            buckets=tuple(buckets),
        )

    def attend(self, pool: KvPool, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: int) -> Tensor:
        """`q[B, H, D]`, `k`/`v[B, Hkv, D]` (pre-RoPE) -> `[B, H, D]`; the new keys/values go into the pool
        first, then each bucket attends over its rows (the new one among them) in one matmul for the scores
        and one for the values. Each bucket's arithmetic runs in `pool.compute_dtype(its rows)` (cache rows
        cast to it)."""
        b, heads, dim = q.shape
        kv_heads, group = k.shape[1], heads // k.shape[1]
        rotated = apply_rope(torch.cat([q, k], dim=1), self.rot_abs, torch.float32)  # (one call: one rotation)
        q_abs = rotated[:, :heads].view(b, kv_heads, group, dim)
        pool.k[layer, self.slots, :, self.rows] = rotated[:, heads:].to(pool.k.dtype)
        pool.v[layer, self.slots, :, self.rows] = v.to(pool.v.dtype)
        rotate_sinks = sinks and any(bucket.sinks_rotated for bucket in self.buckets)
        q_sink = apply_rope(q, self.rot_sink, torch.float32).view(b, kv_heads, group, dim) if rotate_sinks else None
        whole_batch = len(self.buckets) == 1 and not self.buckets[0].padded
        out = None if whole_batch else q_abs.new_empty(b, kv_heads, group, dim)
        for bucket in self.buckets:
            whole = out is None
            cd = pool.compute_dtype(bucket.length)
            if bucket.span is not None:
                k_cache = pool.k[layer, bucket.span, :, : bucket.length]
                v_cache = pool.v[layer, bucket.span, :, : bucket.length]
            else:
                # (only the rows attended are gathered, not the whole slot)
                k_cache = pool.k[layer, :, :, : bucket.length].index_select(0, bucket.slots)
                v_cache = pool.v[layer, :, :, : bucket.length].index_select(0, bucket.slots)
            k_cache, v_cache = k_cache.to(cd), v_cache.to(cd)
            qa = (q_abs if whole else q_abs[bucket.index]).to(cd)
            scores = qa @ k_cache.transpose(-1, -2)
            if q_sink is not None and bucket.sinks_rotated:
                qs = (q_sink if whole else q_sink[bucket.index]).to(cd)
                scores[..., :sinks] = qs @ k_cache[:, :, :sinks].transpose(-1, -2)
            part = attention_weights(scores, scale, bucket.mask, cd) @ v_cache
            if whole:
                out = part
            else:
                assert out is not None
                out[bucket.index] = part.to(out.dtype)
        assert out is not None
        return out.reshape(b, heads, dim).to(q.dtype)


def attention_weights(scores: Tensor, scale: float, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Softmax of `scores * scale + mask` in float32, cast to `dtype`.

    exp() of scores more than ~87 below the row's max underflows to subnormals, which x86 handles ~100x
    slower (measured: a 1 s decode step instead of 40 ms; attention sinks make such gaps common). Raising
    them to max - 80 before masking changes each weight by < 2e-35: nothing, in float32. The max is over
    the visible columns only: masked ones (unused rows, whatever they hold) must not move a row's numbers.
    """
    scores = scores.float() * scale
    top = (scores + mask).amax(-1, keepdim=True)
    scores = torch.maximum(scores, top - 80.0) + mask
    return torch.softmax(scores, dim=-1).to(dtype)


def attend_one(
    k_cache: Tensor,
    v_cache: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
    scale: float,
    sinks: int,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """One session's attention for its `n` new tokens, then their keys/values go into the cache.

    `k_cache`, `v_cache`: `[Hkv, S+W, D]` views of the pool; `q[n, H, D]`, `k`/`v[n, Hkv, D]` pre-RoPE. The
    arithmetic runs in `compute_dtype` (default: the cache's).
    """
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    cd = k_cache.dtype if compute_dtype is None else compute_dtype

    def by_kv_head(x: Tensor) -> Tensor:  # [n, H, D] -> [Hkv, group * n, D]
        return x.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)

    q_abs = by_kv_head(apply_rope(q, plan.rot_abs, cd))
    k = apply_rope(k, plan.rot_abs).transpose(0, 1)  # [Hkv, n, D], as the cache will hold it
    v = v.transpose(0, 1)
    used = plan.used
    old_k = k_cache[:, :used].to(cd)
    scores_old = q_abs @ old_k.transpose(1, 2)
    if plan.rot_sink is not None and used:
        s = min(sinks, used)
        q_sink = by_kv_head(apply_rope(q, plan.rot_sink, cd))
        scores_old[:, :, :s] = q_sink @ old_k[:, :s].transpose(1, 2)
    k_new, v_new = k.to(cd), v.to(cd)
    probs = attention_weights(torch.cat([scores_old, q_abs @ k_new.transpose(1, 2)], dim=-1), scale, plan.mask, cd)
    out = probs[:, :, :used] @ v_cache[:, :used].to(cd) + probs[:, :, used:] @ v_new
    k_cache[:, plan.rows] = k
    v_cache[:, plan.rows] = v
    return out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim).to(q.dtype)
