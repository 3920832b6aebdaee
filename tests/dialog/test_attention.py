"""Decode attention by length bucket: a session attends over its own used rows (rounded up), gets bitwise the
same numbers whatever other sessions share the call, and the same attention as over its whole slot."""

from __future__ import annotations

import math

import pytest
import torch

from duplexd.dialog.attention import BUCKET_ROWS, DecodeBatch, bucket_rows
from duplexd.dialog.kv_window import KvPool, RopeTable, WindowConfig, WindowState

WINDOW = WindowConfig(sink_tokens=4, window_tokens=508)  # capacity 512: four buckets
HEADS, KV_HEADS, DIM = 4, 2, 16
ROPE = RopeTable(head_dim=DIM, theta=10000.0, cached=4096)


def test_a_pool_computes_in_the_dtype_given_for_the_rows_attended() -> None:
    by_rows = KvPool(
        layers=1, kv_heads=1, head_dim=8, window=WINDOW, slots=1, dtype=torch.bfloat16,
        compute_dtype={512: torch.bfloat16, 128: torch.float32},
    )  # fmt: skip
    assert [by_rows.compute_dtype(n) for n in (1, 128, 129, 512, 2048)] == [torch.float32] * 2 + [torch.bfloat16] * 3
    one = KvPool(layers=1, kv_heads=1, head_dim=8, window=WINDOW, slots=1, dtype=torch.bfloat16)
    assert one.compute_dtype(1) == one.compute_dtype(4096) == torch.bfloat16


def test_a_bucket_is_the_used_rows_rounded_up_within_the_slot() -> None:
    capacity = WINDOW.capacity
    assert bucket_rows(0, capacity) == BUCKET_ROWS
    assert bucket_rows(1, capacity) == BUCKET_ROWS
    assert bucket_rows(BUCKET_ROWS, capacity) == BUCKET_ROWS
    assert bucket_rows(BUCKET_ROWS + 1, capacity) == 2 * BUCKET_ROWS
    assert bucket_rows(capacity, capacity) == capacity
    assert bucket_rows(capacity - 1, 300) == 300  # (never past the slot)


def _pool_with(
    lengths: list[int], dtype: torch.dtype, compute: torch.dtype | None = None, attention_tile: int | None = None
) -> tuple[KvPool, list[WindowState]]:
    """A pool whose slot i holds `lengths[i]` tokens of random keys and values."""
    gen = torch.Generator().manual_seed(1)
    pool = KvPool(
        layers=1, kv_heads=KV_HEADS, head_dim=DIM, window=WINDOW, slots=len(lengths), dtype=dtype,
        compute_dtype=compute, attention_tile=attention_tile,
    )  # fmt: skip
    states = []
    for slot, n in enumerate(lengths):
        state = WindowState(WINDOW)
        for _ in range(n):
            plan = state.plan(1, ROPE, HEADS // KV_HEADS)
            pool.k[0, slot, :, plan.rows] = torch.randn(KV_HEADS, 1, DIM, generator=gen).to(dtype)
            pool.v[0, slot, :, plan.rows] = torch.randn(KV_HEADS, 1, DIM, generator=gen).to(dtype)
            state.commit(plan)
        states.append(state)
    return pool, states


# (stored dtype, compute dtype): float32; bfloat16; bfloat16 stored and computed in float32 (`tuning`); and
# by length: float32 for buckets up to 256 rows, bfloat16 beyond
DTYPE_PAIRS = [
    (torch.float32, None),
    (torch.bfloat16, None),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, {256: torch.float32, 2048: torch.bfloat16}),
]


@pytest.mark.parametrize(("dtype", "compute"), DTYPE_PAIRS)
def test_a_row_is_the_same_alone_and_beside_sessions_of_other_lengths(dtype: torch.dtype, compute) -> None:
    lengths = [20, 300, 700, 130]  # buckets 128, 384, 512 (the window is full), 256
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(len(lengths), KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(len(lengths), KV_HEADS, DIM, generator=gen).to(dtype)
    scale = 1 / math.sqrt(DIM)

    pool, states = _pool_with(lengths, dtype, compute)
    plans = [s.plan(1, ROPE, HEADS // KV_HEADS) for s in states]
    together = DecodeBatch.build(pool, list(range(len(lengths))), plans).attend(pool, 0, q, k, v, scale, 4)
    assert {b.length for b in DecodeBatch.build(pool, [0, 1, 2, 3], plans).buckets} == {128, 384, 512, 256}

    for i in range(len(lengths)):
        pool, states = _pool_with(lengths, dtype, compute)
        plan = states[i].plan(1, ROPE, HEADS // KV_HEADS)
        alone = DecodeBatch.build(pool, [i], [plan]).attend(pool, 0, q[i : i + 1], k[i : i + 1], v[i : i + 1], scale, 4)
        assert torch.equal(alone[0], together[i]), f"session {i} ({lengths[i]} tokens) depends on the others"


@pytest.mark.parametrize(("dtype", "compute"), DTYPE_PAIRS)
def test_sessions_in_padded_tiles_get_the_numbers_they_get_in_one_call(dtype: torch.dtype, compute) -> None:
    """On a GPU decode attention takes a fixed number of sessions a call (`KvPool.attention_tile`, 16 there:
    cuBLAS picks its kernel by the batch count): the tiles, and the copies that pad the last, change no
    row's numbers and no key written to the cache."""
    lengths = [20, 30, 40, 50, 60, 300]  # five share the 128-row bucket (a tile of 4, one padded), one alone
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(len(lengths), KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(len(lengths), KV_HEADS, DIM, generator=gen).to(dtype)
    outs, pools = {}, {}
    for tile in (0, 4):
        pool, states = _pool_with(lengths, dtype, compute, attention_tile=tile)
        plans = [s.plan(1, ROPE, HEADS // KV_HEADS) for s in states]
        batch = DecodeBatch.build(pool, list(range(len(lengths))), plans)
        sizes = sorted((b.length, len(b.index), b.padded) for b in batch.buckets)
        if tile:
            assert sizes == [(128, 4, False), (128, 4, True), (384, 4, True)], sizes
        else:
            assert sizes == [(128, 5, False), (384, 1, False)], sizes
        outs[tile], pools[tile] = batch.attend(pool, 0, q, k, v, 1 / math.sqrt(DIM), 4), pool
    assert torch.equal(outs[0], outs[4])
    assert torch.equal(pools[0].k, pools[4].k) and torch.equal(pools[0].v, pools[4].v)
    assert KvPool(layers=1, kv_heads=1, head_dim=8, window=WINDOW, slots=1, dtype=torch.float32).attention_tile == 0


def test_a_bucket_attends_as_the_whole_slot_would() -> None:
    """Rows past a session's bucket are unused: cutting them off changes nothing but the cost."""
    pool, states = _pool_with([40], torch.float32)
    plan = states[0].plan(1, ROPE, HEADS // KV_HEADS)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    scale = 1 / math.sqrt(DIM)
    bucketed = DecodeBatch.build(pool, [0], [plan]).attend(pool, 0, q, k, v, scale, 4)

    # The reference: plain softmax attention over the used rows and the new key, sinks by their rotation.
    from duplexd.dialog.model import apply_rope

    pool, states = _pool_with([40], torch.float32)
    used = plan.used
    q_abs = apply_rope(q, plan.rot_abs).view(KV_HEADS, HEADS // KV_HEADS, DIM)
    q_sink = apply_rope(q, plan.rot_sink if plan.rot_sink is not None else plan.rot_abs).view(KV_HEADS, -1, DIM)
    keys = torch.cat([pool.k[0, 0, :, :used], apply_rope(k, plan.rot_abs).transpose(0, 1)], dim=1)
    values = torch.cat([pool.v[0, 0, :, :used], v.transpose(0, 1)], dim=1)
    scores = q_abs @ keys.transpose(-1, -2)
    scores[..., :4] = q_sink @ keys[:, :4].transpose(-1, -2)
    scores = scores * scale + plan.mask[0]
    expected = (torch.softmax(scores, -1) @ values).reshape(1, HEADS, DIM)
    torch.testing.assert_close(bucketed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dtype", "compute"), DTYPE_PAIRS)
@pytest.mark.parametrize("dims", [(HEADS, KV_HEADS, DIM), (9, 3, 64)])  # (the second: SmolLM2-135M's)
def test_sessions_in_scattered_slots_get_the_numbers_they_get_alone(dtype: torch.dtype, compute, dims) -> None:
    """Sessions of one bucket in slots that are not consecutive are gathered (a copy of the rows they attend)
    instead of viewed in place: a row's numbers are still bitwise those it gets alone."""
    heads, kv_heads, dim = dims
    window = WindowConfig(sink_tokens=4, window_tokens=2044)
    rope = RopeTable(head_dim=dim, theta=10000.0, cached=4096)
    gen = torch.Generator().manual_seed(5)
    pool = KvPool(layers=1, kv_heads=kv_heads, head_dim=dim, window=window, slots=6, dtype=dtype, compute_dtype=compute)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen).to(dtype))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen).to(dtype))
    slots, lengths = [5, 1, 3], [300, 290, 310]  # one bucket (384 rows), slots neither consecutive nor sorted
    states = []
    for n in lengths:
        state = WindowState(window)
        state.commit(state.plan(n, rope, heads // kv_heads))
        states.append(state)
    q = torch.randn(len(slots), heads, dim, generator=gen).to(dtype)
    k = torch.randn(len(slots), kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), kv_heads, dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(dim)
    plans = [s.plan(1, rope, heads // kv_heads) for s in states]
    batch = DecodeBatch.build(pool, slots, plans)
    assert len(batch.buckets) == 1 and batch.buckets[0].span is None  # (the gather)
    saved = pool.k.clone(), pool.v.clone()
    together = batch.attend(pool, 0, q, k, v, scale, 4)
    for i, slot in enumerate(slots):
        pool.k.copy_(saved[0])
        pool.v.copy_(saved[1])
        alone_batch = DecodeBatch.build(pool, [slot], [plans[i]])
        assert alone_batch.buckets[0].span is not None  # (a view in place)
        alone = alone_batch.attend(pool, 0, q[i : i + 1], k[i : i + 1], v[i : i + 1], scale, 4)
        assert torch.equal(alone[0], together[i]), f"slot {slot}: gathered differs from in place"


def test_bfloat16_attention_computed_in_float32_stores_the_same_keys_and_is_closer_to_float32() -> None:
    """Computing in float32 changes only the arithmetic: the cache gets bitwise the keys and values the
    bfloat16 path stores, and the output is nearer the all-float32 one."""
    lengths = [20, 300, 700]  # (the last has evicted tokens: its sinks get their own rotation)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(len(lengths), h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    scale, outs, pools = 1 / math.sqrt(DIM), {}, {}
    for name, dtype, compute in [
        ("fp32", torch.float32, None),
        ("bf16", torch.bfloat16, None),
        ("bf16+fp32", torch.bfloat16, torch.float32),
    ]:
        pool, states = _pool_with(lengths, dtype, compute)
        if dtype == torch.float32:  # (the same cache contents as the bfloat16 pools hold)
            pool.k.copy_(pool.k.bfloat16().float())
            pool.v.copy_(pool.v.bfloat16().float())
        plans = [s.plan(1, ROPE, HEADS // KV_HEADS) for s in states]
        batch = DecodeBatch.build(pool, list(range(len(lengths))), plans)
        x = [t.to(dtype) for t in (q.bfloat16(), k.bfloat16(), v.bfloat16())]
        out = batch.attend(pool, 0, *x, scale, 4)
        assert out.dtype == dtype  # (returned in the rows' dtype, whatever it computed in)
        outs[name], pools[name] = out.float(), pool
    assert torch.equal(pools["bf16"].k, pools["bf16+fp32"].k) and torch.equal(pools["bf16"].v, pools["bf16+fp32"].v)
    error = {name: float((outs[name] - outs["fp32"]).abs().max()) for name in ("bf16", "bf16+fp32")}
    assert error["bf16+fp32"] < error["bf16"], error


def test_a_chunk_is_its_tokens_one_after_another_unless_it_overwrites_what_they_see() -> None:
    from duplexd.dialog.attention import one_token_plans

    state = WindowState(WINDOW)
    state.commit(state.plan(10, ROPE, 2))
    chunk = state.plan(3, ROPE, 2)
    parts = one_token_plans(chunk)
    assert parts is not None and [p.used for p in parts] == [10, 11, 12]
    for i, part in enumerate(parts):  # each token alone: the old rows, the chunk's earlier tokens, itself
        alone = state.plan(1, ROPE, 2)
        assert torch.equal(part.mask, alone.mask) and torch.equal(part.rot_abs, alone.rot_abs), i
        assert torch.equal(part.rows, alone.rows) and part.used == alone.used
        state.commit(alone)
    full = WindowState(WINDOW)
    while full.n < WINDOW.capacity + 5:  # (past the window: new tokens overwrite rows still seen)
        full.commit(full.plan(min(WINDOW.window_tokens, WINDOW.capacity + 5 - full.n), ROPE, 2))
    assert one_token_plans(full.plan(3, ROPE, 2)) is None
