"""The event-loop lag monitor: a timer's lateness, kept for /metrics and /healthz; a real server shows a
blocking call on its loop."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from duplexd.transport.looplag import LoopLag


def test_the_summary_is_the_worst_ever_and_the_recent_p99_and_worst_in_milliseconds() -> None:
    observed: list[float] = []
    lag = LoopLag(observed.append, recent=100)
    for _ in range(99):
        lag.sample(0.001)
    lag.sample(0.5)  # one stall
    summary = lag.summary()
    assert summary == {"max_ms": 500.0, "recent_p99_ms": 500.0, "recent_max_ms": 500.0, "samples": 100}
    for _ in range(100):  # the stall leaves the recent window; the worst since start stays
        lag.sample(-0.001)  # (a timer cannot be early: clamped)
    assert lag.summary() == {"max_ms": 500.0, "recent_p99_ms": 0.0, "recent_max_ms": 0.0, "samples": 100}
    assert len(observed) == 200 and min(observed) == 0.0


async def test_a_blocked_loop_shows_in_healthz_and_metrics(make_server) -> None:
    srv = await make_server()

    def get(path: str) -> str:
        with urllib.request.urlopen(f"{srv.http}{path}", timeout=5) as r:
            return r.read().decode()

    await asyncio.sleep(0.2)
    time.sleep(0.3)  # noqa: ASYNC251 (on purpose: what a tokenizer or a KV copy on the loop would do)
    await asyncio.sleep(0.2)
    health = json.loads(await asyncio.to_thread(get, "/healthz"))
    loop = health["event_loop"]
    assert set(health["threads"]) == {"dialog", "asr", "tts", "vad", "openmp"}
    assert health["threads"]["asr"] >= 1 and health["threads"]["vad"] == 1
    assert loop["max_ms"] >= 250 and loop["recent_max_ms"] >= 250 and loop["samples"] >= 2
    metrics = await asyncio.to_thread(get, "/metrics")
    assert 'duplexd_event_loop_lag_seconds_bucket{le="0.5"}' in metrics
    count = next(line for line in metrics.splitlines() if line.startswith("duplexd_event_loop_lag_seconds_count"))
    assert float(count.split()[-1]) >= 2
