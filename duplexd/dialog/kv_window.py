"""Bounded per-session KV state: S pinned attention-sink tokens + a ring of the W most recent tokens.

`KvPool` preallocates the keys and values of every session slot once; a session owns one slot of
`S + W` rows per layer for its whole life, so resident KV can never exceed `S + W` tokens and the pool's
size is the number of sessions that fit. `WindowState` is the pure bookkeeping of one slot: which token
lives in which row, and what each new token may attend to.

Positions (StreamingLLM). Positions are assigned inside the cache: sinks at 0..S-1 and the resident
window right after them, so a query never sees a RoPE distance beyond `S + W` however long the session
runs. Keys are stored already rotated by their absolute token index; a query rotated by its own absolute
index then sees every window key at the exact relative distance. Only the sinks need the cache position:
for them the query is rotated a second time, by its cache position `p = S + (t - lo)`, where `lo` is the
oldest window token it sees. While nothing has been evicted, `p == t` and both rotations coincide, so
windowed attention is plain causal attention until the context outgrows the window.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from duplexd.errors import Overloaded


@dataclass(frozen=True, slots=True)
class WindowConfig:
    """`sink_tokens` pinned tokens (the head of the system prompt) + `window_tokens` most recent ones."""

    sink_tokens: int = 4
    window_tokens: int = 2044

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"WindowConfig.sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.window_tokens < 1:
            raise ValueError(f"WindowConfig.window_tokens must be >= 1, got {self.window_tokens}")

    @property
    def capacity(self) -> int:
        """Rows per session and layer: the most tokens a session ever holds."""
        return self.sink_tokens + self.window_tokens


class PoolFull(Overloaded):
    """Every KV slot is taken; the engine refuses new sessions instead of evicting someone's state."""


class SlotTable:
    """Numbered slots `0..slots-1` (conversations an engine holds at once), the lowest free one first.
    Over capacity `allocate` raises `PoolFull`: a fast refusal, never an eviction. `what` names one slot
    in the messages."""

    def __init__(self, slots: int, what: str = "slot") -> None:
        if slots < 1:
            raise ValueError(f"a slot table needs at least one slot, got {slots}")
        self.slots = slots
        self._what = what
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolFull(f"all {self.slots} {self._what}s are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"{self._what} {slot} is not allocated")
        # (kept highest first, so `allocate` pops the lowest: sessions opened together get consecutive slots,
        # which decode attention reads in place instead of gathering)
        bisect.insort(self._free, slot, key=lambda s: -s)


class KvPool:
    """Keys and values for `slots` sessions: `k`, `v` of shape `[layers, slots, kv_heads, S + W, head_dim]`,
    stored in `dtype`. Attention over them computes in `compute_dtype` (default `dtype`), or, given a mapping
    `{rows: dtype}`, over at most `rows` cache rows in that dtype (the largest key's covers longer spans):
    small matmuls and long ones may each be faster in another dtype (`tuning.attention_ms`)."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        window: WindowConfig,
        slots: int,
        dtype: torch.dtype,
        compute_dtype: torch.dtype | Mapping[int, torch.dtype] | None = None,
        device: torch.device | str = "cpu",
        attention_tile: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"a KV pool needs at least one slot, got {slots}")
        shape = (layers, slots, kv_heads, window.capacity, head_dim)
        self.window = window
        if compute_dtype is None or isinstance(compute_dtype, torch.dtype):
            self._arithmetic: tuple[tuple[int, torch.dtype], ...] = ((0, compute_dtype or dtype),)
        elif compute_dtype:
            self._arithmetic = tuple(sorted(compute_dtype.items()))
        else:
            self._arithmetic = ((0, dtype),)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Decode attention's batched matmuls take this many sessions a call (padded; 0: as many as there
        # are). A CPU computes each batch item alone whatever the batch; cuBLAS picks its kernel by the batch
        # count too, so on a GPU a row's numbers would depend on how many others share its bucket.
        self.attention_tile = (0 if self.k.device.type == "cpu" else 16) if attention_tile is None else attention_tile
        self._table = SlotTable(slots, "KV slot")

    def compute_dtype(self, rows: int) -> torch.dtype:
        """The dtype attention over `rows` cache rows computes in."""
        for up_to, dtype in self._arithmetic:
            if rows <= up_to:
                return dtype
        return self._arithmetic[-1][1]

    @property
    def slots(self) -> int:
        return self._table.slots

    @property
    def free(self) -> int:
        return self._table.free

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def allocate(self) -> int:
        return self._table.allocate()

    def release(self, slot: int) -> None:
        self._table.release(slot)

    def copy(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` rows of every layer from slot `src` to slot `dst` (a fork)."""
        self.k[:, dst, :, :rows] = self.k[:, src, :, :rows]
        self.v[:, dst, :, :rows] = self.v[:, src, :, :rows]


@dataclass(frozen=True, slots=True)
class Plan:
    """How `n` new tokens attend, for one session in one step (the same for every layer).

    `mask[group * n, used + n]` is additive (0 or -inf) over the first `used` cache rows then the new
    tokens, for the `group` query heads of each KV head in turn;
    `rot_abs` rotates new queries and keys by absolute index; `rot_sink` (None while no query has a
    cache position different from its index) rotates queries for the sink rows; `rows` are where the new
    tokens' keys go once the layer has attended.
    """

    positions: Tensor
    rows: Tensor
    used: int
    mask: Tensor
    rot_abs: Tensor
    rot_sink: Tensor | None

    def to(self, device: torch.device) -> Plan:
        """The plan with the tensors attention reads on `device` (itself where they are there already)."""
        if self.mask.device == device:
            return self
        rot_sink = None if self.rot_sink is None else self.rot_sink.to(device)
        rows, mask, rot_abs = self.rows.to(device), self.mask.to(device), self.rot_abs.to(device)
        return Plan(self.positions, rows, self.used, mask, rot_abs, rot_sink)


class WindowState:
    """Which token lives in which row of one slot. Rows `0..S-1` are the sinks; window row of token `t` is
    `S + (t - S) % W`. `ws` is the oldest window token still resident (everything older was evicted)."""

    def __init__(self, window: WindowConfig) -> None:
        self.window = window
        self.n = 0
        self.ws = window.sink_tokens
        self.row_t = torch.full((window.capacity,), -1, dtype=torch.int64)
        self.used = 0  # rows 0..used-1 have ever held a token

    def copy(self) -> WindowState:
        other = WindowState(self.window)
        other.n, other.ws, other.used = self.n, self.ws, self.used
        other.row_t = self.row_t.clone()
        return other

    @property
    def resident(self) -> int:
        return int((self.row_t >= 0).sum())

    def rows_for(self, positions: Tensor) -> Tensor:
        s, w = self.window.sink_tokens, self.window.window_tokens
        return torch.where(positions < s, positions, s + (positions - s) % w)

    def plan(self, n_new: int, rope: RopeTable, group: int = 1) -> Plan:
        """The attention plan for the next `n_new` tokens (`n_new <= W`, so no chunk overwrites itself).

        `group` query heads share each KV head: the mask is laid out for `group * n_new` query rows.
        """
        s, w = self.window.sink_tokens, self.window.window_tokens
        if not 1 <= n_new <= w:
            raise ValueError(f"a chunk must hold 1..{w} tokens, got {n_new}")
        t = torch.arange(self.n, self.n + n_new)
        lo = torch.clamp(t - w + 1, min=max(s, self.ws))
        cache_pos = torch.where(t < s, t, s + t - lo)
        used = self.used
        old = self.row_t[:used]
        sees_old = (old >= 0) & ((old < s) | (old >= lo[:, None]))
        sees_new = (t[None, :] <= t[:, None]) & ((t[None, :] < s) | (t[None, :] >= lo[:, None]))
        visible = torch.cat([sees_old, sees_new], dim=1)
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        evicting = bool((cache_pos != t).any()) and s > 0
        return Plan(
            positions=t,
            rows=self.rows_for(t),
            used=used,
            mask=mask.repeat(group, 1),
            rot_abs=rope.at(t),
            rot_sink=rope.at(cache_pos) if evicting else None,
        )

    def commit(self, plan: Plan) -> None:
        """The plan's tokens are now in their rows (older tokens in those rows are evicted)."""
        self.row_t[plan.rows] = plan.positions
        self.n = int(plan.positions[-1]) + 1
        self.ws = max(self.ws, self.n - self.window.window_tokens)
        self.used = max(self.used, int(plan.rows.max()) + 1)

    def truncate(self, n_keep: int) -> None:
        """Forget every token from index `n_keep` on. Tokens they had evicted stay evicted."""
        if not 0 <= n_keep <= self.n:
            raise ValueError(f"cannot truncate {self.n} tokens to {n_keep}")
        self.row_t[self.row_t >= n_keep] = -1
        self.n = n_keep
        self.ws = min(self.ws, max(n_keep, self.window.sink_tokens))


class RopeTable:
    """Unit complex rotations by position, computed in float64 (exact phases for huge positions), cached
    for the first `cached` positions."""

    def __init__(self, head_dim: int, theta: float, cached: int = 8192) -> None:
        self.head_dim = head_dim
        self.theta = theta
        self._table = self._compute(torch.arange(cached))

    def _compute(self, positions: Tensor) -> Tensor:
        from duplexd.dialog.model import rope_angles

        return rope_angles(positions, self.head_dim, self.theta)

    def at(self, positions: Tensor) -> Tensor:
        if int(positions.max()) < self._table.shape[0]:
            return self._table[positions]
        return self._compute(positions)
