"""The server's load loop: every period, the sessions' and workers' samples into the metrics, and the load
signals (p99 frame lag, worst transcript and reply lag) into the admission controller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duplexd.transport.server import Server

log = logging.getLogger(__name__)


class LoadControl:
    def __init__(self, server: Server) -> None:
        self.server = server
        self._asr_passes_seen = 0
        self._period_lags: deque[float] = deque(maxlen=65536)  # frame lags (ms) of this control period
        self._period_reply_lag = 0.0

    def collect(self) -> None:
        """Drain the sessions' and workers' samples into the metrics, and the lags also into this control
        period's buffers (a `/metrics` scrape between two periods must not take the controller's samples)."""
        server = self.server
        m, deadline = server.metrics, server.config.admission.frame_deadline_ms
        lags: list[float] = []
        for session in server.sessions.values():
            lags.extend(session.drain_lags())
        m.frame_lags(lags, deadline)
        self._period_lags.extend(lags)
        asr_lag = max((s.asr_lag_s for s in server.sessions.values()), default=0.0)
        m.asr_lag.set(asr_lag)
        now = time.monotonic()
        reply_lag = max((s.drain_reply_lag(now) for s in server.sessions.values()), default=0.0)
        self._period_reply_lag = max(self._period_reply_lag, reply_lag)
        m.reply_lag.set(reply_lag)
        m.mirror(m.underrun, "underrun", server.underrun_closed_s + sum(s.underrun_s for s in server.sessions.values()))
        m.sessions_active.set(len(server.sessions))
        m.sessions_detached.set(sum(not c.attached for c in server.handles.values()))
        m.mirror(m.resumes, "resumes", server.counters["resumed"])
        if server.datagram is not None:
            m.mirror(m.datagrams_sent, "datagrams_sent", server.datagram.stats.sent)
            m.mirror(m.datagrams_dropped, "datagrams_dropped", server.datagram.stats.dropped)
        m.admission_limit.set(server.admission.sessions)
        stats = server.asr.stats
        new = min(stats.passes - self._asr_passes_seen, len(stats.recent_pass_s))
        for elapsed in list(stats.recent_pass_s)[len(stats.recent_pass_s) - new :]:
            m.asr_pass.observe(elapsed)
        self._asr_passes_seen = stats.passes
        m.drain(m.vad_batch, server.vad.batch_samples)
        if server.dialog is not None:
            engine = server.dialog.engine
            while engine.step_samples:
                seconds, sessions, _ = engine.step_samples.popleft()
                m.llm_step.observe(seconds)
                m.llm_batch.observe(sessions)
            m.mirror(m.llm_steps, "llm_steps", engine.stats["steps"])
            m.mirror(m.llm_busy, "llm_busy", engine.stats["busy_s"])
            m.kv_slots.set(engine.pool.slots)
            m.kv_slots_used.set(engine.pool.slots - engine.pool.free)
            m.speculation_hit_ratio.set(server.dialog.stats.as_dict()["hit_rate"])
        if server.tts is not None:
            m.mirror(m.tts_busy, "tts_busy", server.tts.stats.busy_s)
            m.drain(m.tts_piece, server.tts.stats.samples)

    def signals(self) -> dict[str, float | None]:
        """This control period's load signals (p99 frame lag, worst transcript and reply lag); starts the next."""
        server = self.server
        self.collect()
        lags = sorted(self._period_lags)
        reply_lag, self._period_reply_lag = self._period_reply_lag, 0.0
        self._period_lags.clear()
        return {
            "frame_lag_ms": lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None,
            "asr_lag_s": max((s.asr_lag_s for s in server.sessions.values()), default=0.0) if server.sessions else None,
            "reply_lag_s": reply_lag if server.dialog is not None and server.sessions else None,
        }

    async def run(self) -> None:
        """Every period: the load signals into the metrics and the admission controller."""
        server = self.server
        a = server.config.admission
        while True:
            await asyncio.sleep(a.period_s)
            signals = self.signals()
            if a.enabled:
                was = server.admission.sessions
                decision = server.admission.update(signals, active=len(server.sessions), now=time.monotonic())
                if decision.changed == "recover" and server.admission.sessions > was:
                    log.debug("admission: limit %d (recovering while not in use)", server.admission.sessions)
                if decision.changed == "decrease":
                    log.info(
                        "admission: limit %.1f (over target: %s)",
                        decision.limit,
                        ", ".join(decision.over),
                        extra={
                            "event": "admission.decrease",
                            "limit": decision.limit,
                            "over": list(decision.over),
                            "signals": signals,
                            "sessions": len(server.sessions),
                        },
                    )
