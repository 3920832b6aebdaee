"""The bounded KV window's bookkeeping, against a brute-force model of StreamingLLM's cache.

Reference semantics: a query at token index t sees the sinks (indices < S, causally) and the window
tokens in [lo, t], where lo = max(S, t - W + 1, the oldest token not yet evicted); its cache position is
t for a sink and S + (t - lo) otherwise. Truncation forgets tokens but cannot bring back evicted ones.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexd.dialog.kv_window import KvPool, PoolFull, RopeTable, SlotTable, WindowConfig, WindowState
from duplexd.errors import Overloaded

ROPE = RopeTable(head_dim=8, theta=10000.0, cached=64)


def visible_sets(state: WindowState, n_new: int) -> tuple[list[set[int]], list[int]]:
    """What each of the next `n_new` queries sees (token indices) and the position its query is rotated by
    for the sink rows, per the plan."""
    plan = state.plan(n_new, ROPE)
    keys = torch.cat([state.row_t[: plan.used], plan.positions])
    seen = [{int(keys[j]) for j in range(len(keys)) if plan.mask[i, j] == 0} for i in range(n_new)]
    rot = plan.rot_sink if plan.rot_sink is not None else plan.rot_abs
    positions = [int(torch.nonzero(torch.isclose(ROPE.at(torch.arange(200)), r[None]).all(-1))[0]) for r in rot]
    return seen, positions


class Reference:
    def __init__(self, window: WindowConfig) -> None:
        self.s, self.w = window.sink_tokens, window.window_tokens
        self.n = 0
        self.evicted_below = self.s  # window tokens below this index are gone

    def expect(self, n_new: int) -> tuple[list[set[int]], list[int]]:
        seen, positions = [], []
        evicted = self.evicted_below
        for t in range(self.n, self.n + n_new):
            lo = max(self.s, t - self.w + 1, evicted)
            seen.append({i for i in range(min(self.s, t + 1))} | set(range(lo, t + 1)))
            # Without sinks only relative distances inside the window matter: absolute rotation is exact.
            positions.append(t if t < self.s or self.s == 0 else self.s + t - lo)
        return seen, positions

    def append(self, n_new: int) -> None:
        self.n += n_new
        self.evicted_below = max(self.evicted_below, self.n - self.w)

    def truncate(self, n_keep: int) -> None:
        self.n = n_keep
        self.evicted_below = min(self.evicted_below, max(n_keep, self.s))


@settings(max_examples=150, deadline=None)
@given(
    sinks=st.integers(0, 4),
    window=st.integers(1, 12),
    ops=st.lists(st.tuples(st.sampled_from(["append", "truncate"]), st.integers(1, 12)), min_size=1, max_size=25),
)
def test_plan_matches_streaming_llm_reference(sinks: int, window: int, ops: list[tuple[str, int]]) -> None:
    config = WindowConfig(sink_tokens=sinks, window_tokens=window)
    state, ref = WindowState(config), Reference(config)
    for op, amount in ops:
        if op == "truncate":
            keep = max(0, state.n - amount)
            state.truncate(keep)
            ref.truncate(keep)
            continue
        n_new = min(amount, window)
        if state.n + n_new > 150:
            break
        assert visible_sets(state, n_new) == ref.expect(n_new)
        state.commit(state.plan(n_new, ROPE))
        ref.append(n_new)
        assert state.resident <= config.capacity
        assert state.n == ref.n


def test_resident_is_bounded_over_a_long_run() -> None:
    config = WindowConfig(sink_tokens=4, window_tokens=16)
    state = WindowState(config)
    for i in range(2000):
        state.commit(state.plan(1 + i % 7, ROPE))
        assert state.resident <= config.capacity
    assert state.resident == config.capacity
    kept = sorted(int(t) for t in state.row_t)
    assert kept == [0, 1, 2, 3, *range(state.n - 16, state.n)]


def test_huge_positions_keep_exact_relative_phase() -> None:
    rope = RopeTable(head_dim=64, theta=10000.0, cached=16)
    near = torch.tensor([5, 6])
    far = torch.tensor([10_000_005, 10_000_006])
    ratio_near = rope.at(near)[1] * rope.at(near)[0].conj()
    ratio_far = rope.at(far)[1] * rope.at(far)[0].conj()
    torch.testing.assert_close(ratio_far, ratio_near, atol=1e-6, rtol=0)


def test_window_config_is_validated() -> None:
    with pytest.raises(ValueError, match="sink_tokens"):
        WindowConfig(sink_tokens=-1)
    with pytest.raises(ValueError, match="window_tokens"):
        WindowConfig(window_tokens=0)
    assert WindowConfig(4, 1020).capacity == 1024


def test_chunk_larger_than_window_is_refused() -> None:
    state = WindowState(WindowConfig(sink_tokens=2, window_tokens=8))
    with pytest.raises(ValueError, match="1..8"):
        state.plan(9, ROPE)


def test_pool_refuses_rather_than_evicts() -> None:
    pool = KvPool(layers=2, kv_heads=1, head_dim=4, window=WindowConfig(1, 3), slots=2, dtype=torch.float32)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and pool.free == 0
    with pytest.raises(PoolFull) as info:
        pool.allocate()
    assert isinstance(info.value, Overloaded)
    pool.release(a)
    assert pool.allocate() == a
    with pytest.raises(ValueError):
        pool.release(7)
    assert pool.bytes_per_slot == 2 * 2 * 1 * 4 * 4 * 4


def test_a_slot_table_counts_conversations_and_refuses_over_capacity() -> None:
    """The remote backend's conversations are counted by the same table as the KV pool's slots."""
    table = SlotTable(2, "dialog session")
    assert [table.allocate(), table.allocate()] == [0, 1] and table.free == 0 and table.slots == 2
    with pytest.raises(PoolFull, match="all 2 dialog sessions are in use"):
        table.allocate()
    table.release(1)
    with pytest.raises(ValueError, match="dialog session 1 is not allocated"):
        table.release(1)
    assert table.free == 1 and table.allocate() == 1
    with pytest.raises(ValueError):
        SlotTable(0)


def test_the_lowest_free_slot_goes_first_whatever_order_they_were_freed_in() -> None:
    """So conversations opened together get consecutive slots (read in place by decode attention)."""
    table = SlotTable(6)
    taken = [table.allocate() for _ in range(6)]
    for slot in taken:  # freed first to last: a stack would now hand out 5, 4, 3, ...
        table.release(slot)
    assert [table.allocate() for _ in range(3)] == [0, 1, 2]
    table.release(1)
    assert table.allocate() == 1


def test_pool_copy_copies_only_the_slot() -> None:
    pool = KvPool(layers=1, kv_heads=1, head_dim=2, window=WindowConfig(0, 4), slots=3, dtype=torch.float32)
    pool.k[0, 0] = 1.0
    pool.v[0, 0] = 2.0
    pool.copy(0, 2, rows=3)
    assert pool.k[0, 2, 0, :3].eq(1).all() and pool.k[0, 2, 0, 3].eq(0).all()
    assert pool.v[0, 2, 0, :3].eq(2).all() and pool.k[0, 1].eq(0).all()
