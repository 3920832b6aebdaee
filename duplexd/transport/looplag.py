"""How late the event loop runs callbacks: a timer asks to wake every `interval_s`, and how much later than
asked it woke is the lag (whatever ran on the loop meanwhile held it up: a tokenizer, a KV copy, a big JSON).
Kept for `/metrics` (`duplexd_event_loop_lag_seconds`) and `/healthz` (`event_loop`: max and p99 of the last
samples), so work that should be on a thread shows up."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

INTERVAL_S = 0.05
RECENT = 1200  # samples kept for /healthz: the last minute at INTERVAL_S


class LoopLag:
    def __init__(self, observe: Callable[[float], None] | None = None, recent: int = RECENT) -> None:
        self._observe = observe  # (a Prometheus histogram's `observe`)
        self.recent: deque[float] = deque(maxlen=recent)
        self.max_s = 0.0  # since start

    def sample(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.recent.append(lag_s)
        self.max_s = max(self.max_s, lag_s)
        if self._observe is not None:
            self._observe(lag_s)

    def summary(self) -> dict[str, float | int]:
        """Milliseconds: the worst since start, and the p99 and worst of the recent samples."""
        recent = sorted(self.recent)
        p99 = recent[min(len(recent) - 1, int(0.99 * len(recent)))] if recent else 0.0
        return {
            "max_ms": round(1000 * self.max_s, 2),
            "recent_p99_ms": round(1000 * p99, 2),
            "recent_max_ms": round(1000 * (recent[-1] if recent else 0.0), 2),
            "samples": len(recent),
        }

    async def run(self, interval_s: float = INTERVAL_S) -> None:
        while True:
            asked = time.monotonic() + interval_s
            await asyncio.sleep(interval_s)
            self.sample(time.monotonic() - asked)
