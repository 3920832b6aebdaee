"""Online admission control: an AIMD controller over measured lag signals (pure; the shell feeds it).

Per-session state is bounded (a KV slot, a bounded audio ring, bounded queues), so the server's lag grows
monotonically with the number of sessions, and lag is a usable load signal: every control period the
controller raises its session limit by `increase` while the p99 of every lag signal stays under its target
and cuts it to `beta` times the sessions that overloaded it as soon as one is over (additive increase,
multiplicative decrease, as TCP). A limit already below the active sessions is not cut again: admitted
sessions are never dropped, so the overload lasts until enough of them leave, and cutting on every period
meanwhile would drive the limit to the floor. It
discovers the schedulable concurrency N* online, and follows it when capacity changes. The KV pool's size
is a hard ceiling whatever the signals say.

Two things keep a noisy machine from throttling the server for good. A cut needs the overload to persist
for `confirm_periods` periods in a row (one spike, a compile or another process, is not an overload). And a
limit that is not in use says nothing about capacity, so it cannot rise by AIMD: instead, while every signal
is under target (or there is nobody to measure), it climbs back toward `initial` at a steady rate, the whole
way from the floor in `recover_s` seconds. Time is passed in (`now`), never read here.

    controller.update({"frame_lag_ms": 35.0, "asr_lag_s": 0.8}, active=5, now=t)   # every period
    controller.admit(active=5)                                                     # at each handshake

The limit only gates new sessions: admitted sessions are never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AimdConfig:
    targets: Mapping[str, float]
    """p99 target of each lag signal (e.g. `frame_lag_ms` 200, `asr_lag_s` 2.0)."""
    initial: float = 4.0
    increase: float = 1.0
    """Sessions added to the limit per period while every signal is under target and the limit is in use."""
    beta: float = 0.7
    """The limit is multiplied by this when a signal is over target."""
    floor: float = 1.0
    """The limit never falls below this (one session always gets in, to keep measuring)."""
    settle_periods: int = 1
    """Periods with every signal under target before each increase: a new session's load shows only once
    it speaks and is answered (seconds), and lag signals such as the reply's come in bursts, so one quiet
    period says little."""
    confirm_periods: int = 1
    """Periods in a row with a signal over target before a cut (1: cut at once)."""
    recover_s: float = 30.0
    """While the limit is not in use and no signal is over target, it climbs back toward `initial` at
    (initial - floor) / recover_s sessions a second."""

    def __post_init__(self) -> None:
        if not self.targets or any(t <= 0 for t in self.targets.values()):
            raise ValueError(f"AIMD needs positive lag targets, got {dict(self.targets)}")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"AIMD beta must be in (0, 1), got {self.beta}")
        if self.increase <= 0 or self.floor < 1 or self.initial < self.floor or self.settle_periods < 1:
            raise ValueError("AIMD needs increase > 0, 1 <= floor <= initial and settle_periods >= 1")
        if self.confirm_periods < 1 or self.recover_s <= 0:
            raise ValueError(
                f"AIMD needs confirm_periods >= 1 and recover_s > 0, got {self.confirm_periods}, {self.recover_s}"
            )


@dataclass(frozen=True, slots=True)
class Decision:
    limit: float
    over: tuple[str, ...]  # signals over their target this period (empty: none)
    changed: str  # "increase", "decrease", "recover" (toward `initial`, unused), or "hold"


class Aimd:
    def __init__(self, config: AimdConfig, capacity: int) -> None:
        self.config = config
        self.capacity = capacity
        self.limit = min(config.initial, float(capacity))
        self._quiet = 0  # consecutive periods with every signal under target, since the last change
        self._over = 0  # consecutive periods with a signal over target
        self._last: float | None = None  # `now` of the previous update

    def set_capacity(self, capacity: int) -> None:
        """The hard ceiling changed (e.g. KV slots taken by other work); the limit follows it down."""
        self.capacity = capacity
        self.limit = max(self.config.floor, min(self.limit, float(capacity)))

    @property
    def sessions(self) -> int:
        """How many sessions may be active now."""
        return max(1, min(self.capacity, math.floor(self.limit + 1e-9)))

    def admit(self, active: int) -> bool:
        return active < self.sessions

    def update(self, p99: Mapping[str, float | None], active: int, now: float) -> Decision:
        """One control period: `p99` of each lag signal over the period (None: no samples), `active`
        sessions now, `now` in seconds (any monotonic clock). AIMD increases only while the limit is in use;
        a limit not in use recovers toward `initial` with time instead."""
        c = self.config
        elapsed = 0.0 if self._last is None else max(0.0, now - self._last)
        self._last = now
        over = tuple(name for name, target in c.targets.items() if (v := p99.get(name)) is not None and v > target)
        if over:
            self._quiet = 0
            self._over += 1
            if self._over < c.confirm_periods:  # not yet: one noisy period is not an overload
                return Decision(self.limit, over, "hold")
            if self.sessions < active:  # already refusing: the overload ends as admitted sessions leave
                return Decision(self.limit, over, "hold")
            self.limit = max(c.floor, c.beta * min(self.limit, float(active)))
            return Decision(self.limit, over, "decrease")
        self._over = 0
        self._quiet += 1
        measured = any(p99.get(name) is not None for name in c.targets)
        in_use = active >= self.sessions
        if measured and in_use and self.limit < self.capacity and self._quiet >= c.settle_periods:
            self.limit = min(float(self.capacity), self.limit + c.increase)
            self._quiet = 0
            return Decision(self.limit, (), "increase")
        target = min(c.initial, float(self.capacity))
        if not in_use and self.limit < target:
            rate = (c.initial - c.floor) / c.recover_s
            self.limit = min(target, self.limit + rate * elapsed)
            return Decision(self.limit, (), "recover")
        return Decision(self.limit, (), "hold")
