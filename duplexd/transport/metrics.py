"""`/metrics` in Prometheus' text format (prometheus-client), one registry per server.

Counters that the workers keep as running totals (ASR passes, LLM steps, TTS pieces) are mirrored by the
control loop every period, so the hot paths carry no metrics code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from duplexd.streaming.timeline import TurnTiming

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LOOP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_LAG_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_PASS_BUCKETS_S = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
_STEP_BUCKETS_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_TURN_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions_active = Gauge("duplexd_sessions_active", "Sessions streaming now", registry=r)
        self.sessions_admitted = Counter("duplexd_sessions_admitted", "Sessions admitted", registry=r)
        self.sessions_refused = Counter("duplexd_sessions_refused", "Sessions refused (full)", registry=r)
        self.admission_limit = Gauge("duplexd_admission_limit", "Sessions the controller admits now", registry=r)
        self.loop_lag = Histogram(
            "duplexd_event_loop_lag_seconds",
            "How much later than asked the event loop ran a timer (work held it up)",
            buckets=_LOOP_BUCKETS_S,
            registry=r,
        )
        self.frame_lag = Histogram(
            "duplexd_frame_lag_seconds",
            "Frame arrival to applied (VAD run, events queued)",
            buckets=_LAG_BUCKETS_S,
            registry=r,
        )
        self.deadline_misses = Counter(
            "duplexd_frame_deadline_misses", "Frames applied after their deadline", registry=r
        )
        self.asr_lag = Gauge("duplexd_asr_lag_seconds", "Worst transcript lag over sessions (last period)", registry=r)
        self.reply_lag = Gauge(
            "duplexd_reply_lag_seconds", "Longest wait for owed reply audio over sessions (last period)", registry=r
        )
        self.underrun = Counter(
            "duplexd_reply_underrun_seconds", "Time users waited for owed reply audio, all sessions", registry=r
        )
        self.asr_pass = Histogram(
            "duplexd_asr_pass_seconds", "Recognizer pass time", buckets=_PASS_BUCKETS_S, registry=r
        )
        self.llm_steps = Counter("duplexd_llm_steps", "Dialog engine steps", registry=r)
        self.llm_step = Histogram(
            "duplexd_llm_step_seconds", "Dialog engine step time", buckets=_STEP_BUCKETS_S, registry=r
        )
        self.llm_batch = Histogram(
            "duplexd_llm_step_sessions", "Sessions batched in one engine step", buckets=_BATCH_BUCKETS, registry=r
        )
        self.vad_batch = Histogram(
            "duplexd_vad_batch_sessions", "Sessions batched in one VAD call", buckets=_BATCH_BUCKETS, registry=r
        )
        self.tts_piece = Histogram(
            "duplexd_tts_piece_seconds", "Synthesis time of one reply piece", buckets=_PASS_BUCKETS_S, registry=r
        )
        self.llm_busy = Counter("duplexd_llm_busy_seconds", "Dialog engine busy time", registry=r)
        self.kv_slots_used = Gauge("duplexd_kv_slots_used", "KV slots in use (conversations, drafts)", registry=r)
        self.kv_slots = Gauge("duplexd_kv_slots", "KV pool slots in all", registry=r)
        self.tts_busy = Counter("duplexd_tts_busy_seconds", "Speech synthesis busy time", registry=r)
        self.speculation_hit_ratio = Gauge(
            "duplexd_speculation_hit_ratio", "Turns that used a draft, of turns with drafts", registry=r
        )
        self.sessions_detached = Gauge(
            "duplexd_sessions_detached", "Sessions whose connection dropped, awaiting a resume", registry=r
        )
        self.resumes = Counter("duplexd_session_resumes", "Sessions continued on a new connection", registry=r)
        self.datagrams_sent = Counter("duplexd_datagrams_sent", "Reply token datagrams sent (UDP)", registry=r)
        self.datagrams_dropped = Counter(
            "duplexd_datagrams_dropped", "Datagrams refused (not ours, bad MAC, replayed)", registry=r
        )
        # A turn's latency as the user hears it, and its parts (observed when the reply's first audio is ready).
        self.voice_to_voice = Histogram(
            "duplexd_voice_to_voice_seconds",
            "End of the user's speech to the reply's first audio",
            buckets=_TURN_BUCKETS_S,
            registry=r,
        )
        self.turn_detection = Histogram(
            "duplexd_turn_detection_seconds",
            "End of the user's speech to the end of the turn (endpointing)",
            buckets=_TURN_BUCKETS_S,
            registry=r,
        )
        self.first_token = Histogram(
            "duplexd_first_token_seconds",
            "End of the turn to the reply's first token",
            buckets=_TURN_BUCKETS_S,
            registry=r,
        )
        self.first_audio = Histogram(
            "duplexd_first_audio_seconds",
            "The reply's first token to its first audio ready to send (speech synthesis)",
            buckets=_TURN_BUCKETS_S,
            registry=r,
        )
        self._mirrored: dict[str, float] = {}

    def turn(self, timing: TurnTiming) -> None:
        """A turn whose reply's first audio is ready: every part is known."""
        self.turn_detection.observe(timing.turn_detection_s)
        for histogram, value in (
            (self.first_token, timing.first_token_s),
            (self.first_audio, timing.first_audio_s),
            (self.voice_to_voice, timing.voice_to_voice_s),
        ):
            if value is not None:
                histogram.observe(value)

    def frame_lags(self, lags_ms: Iterable[float], deadline_ms: float) -> None:
        for lag in lags_ms:
            self.frame_lag.observe(lag / 1000.0)
            if lag > deadline_ms:
                self.deadline_misses.inc()

    @staticmethod
    def drain(histogram: Histogram, samples: deque) -> None:
        """Observe and remove a worker's samples (its thread appends; deque ends are thread-safe)."""
        while samples:
            histogram.observe(samples.popleft())

    def mirror(self, counter: Counter, name: str, total: float) -> None:
        """Advance `counter` to a worker's running `total`."""
        delta = total - self._mirrored.get(name, 0.0)
        if delta > 0:
            counter.inc(delta)
        self._mirrored[name] = max(total, self._mirrored.get(name, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
