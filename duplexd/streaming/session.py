"""One client's stream: frames in, events out. Pure: the shell runs the VAD and ASR engines on workers
and hands their results back; `now` (seconds, any monotonic clock) is always passed in.

    frame -> accept_frame() -> VAD chunks -> [VAD worker] -> apply_vad() -> events (+ frame.ack)
    wants_pass() -> prepare_pass() -> [ASR worker] -> apply_pass() -> transcript events

Finalize at the pause: after `turn.pause_ms` of silence the open utterance ends where the audio heard so
far ends (its next pass is the final one), well before VAD's own end of speech (`vad.min_silence_ms`).
Silence adds no words, so that text is the final text; speech that resumes opens the next utterance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from duplexd.asr.echo import EchoCanceller, EchoLevels
from duplexd.asr.engine import Transcription
from duplexd.asr.streaming import PassRequest, StreamingTranscriber
from duplexd.asr.vad import VAD_CHUNK_SAMPLES, VAD_SAMPLE_RATE, VadHysteresis, VadStream
from duplexd.config import AsrConfig, TransportConfig, TurnConfig, VadConfig
from duplexd.errors import ErrorCode, ProtocolError
from duplexd.events import Event, FrameAcked, SpeechStarted, SpeechStopped
from duplexd.streaming.audio import StreamResampler, pcm16_to_float


@dataclass(frozen=True, slots=True)
class _Pending:
    seq: int
    arrived: float
    audio_ms: float


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """What a session core reads of the server's configuration (the server builds it once): the VAD and
    recognizer sections, the turn's pause and the frame-ack interval."""

    vad: VadConfig = field(default_factory=VadConfig)
    asr: AsrConfig = field(default_factory=AsrConfig)
    pause_ms: int = TurnConfig().pause_ms
    ack_interval_ms: int = TransportConfig().ack_interval_ms
    keep_audio_s: float = 0.0  # the last this much audio is kept for the acoustic end-of-turn model (0: none)


class Session:
    def __init__(self, session_id: str, sample_rate: int, config: SessionConfig) -> None:
        self.id = session_id
        self.sample_rate = sample_rate
        self._config = config
        self._base_config = config  # (`tune_vad` changes `_config` from this)
        self._resampler = StreamResampler(sample_rate, VAD_SAMPLE_RATE)
        self.vad_stream = VadStream()
        self.echo: EchoCanceller | None = None  # (set by the shell for a session with reply audio; VAD worker only)
        self.echo_levels: EchoLevels | None = None  # what it took out, per chunk (set with it, before any audio)
        self._hysteresis = VadHysteresis(config.vad)
        self.transcriber = StreamingTranscriber(config.asr)
        self._vad_buf = np.zeros(0, np.float32)
        self._vad_done = 0  # 16 kHz samples evaluated by VAD
        self._last_seq: int | None = None
        self._pending: deque[_Pending] = deque(maxlen=64)
        self._since_ack_ms = 0.0
        self._worst_lag_ms = 0.0
        self.frames = 0
        self._last_voice_s: float | None = None  # end of the last VAD chunk that sounded like speech
        self._paused_at: float | None = None  # the open speech was finalized at a pause ending here (s)
        self._spoke_until: float | None = None  # the last voiced chunk's end when VAD last ended speech
        self._turn_over = False  # the user's turn ended since the last speech onset (`turn_ended`)
        self._voiced_run = 0  # consecutive voiced chunks
        self._resume_chunks = max(1, -(-config.vad.min_speech_ms // 32))
        self.lags_ms: deque[float] = deque(maxlen=4096)  # recent per-frame lags, for metrics
        self._unread_lags: deque[float] = deque(maxlen=4096)  # since the last `drain_lags`
        # The last `keep_audio_s` of 16 kHz audio, a ring (bounded where it is made), and the audio up to the
        # latest pause, for the acoustic end-of-turn model (`take_pause_audio`).
        self._recent = np.zeros(int(config.keep_audio_s * VAD_SAMPLE_RATE), np.float32)
        self._recent_end = 0  # 16 kHz samples ever written to the ring
        self._pause_audio: tuple[float, np.ndarray] | None = None
        self._starved_since: float | None = None  # owed reply audio has been missing since then
        self.underrun_s = 0.0  # total time the user waited for owed reply audio
        self._worst_wait = 0.0  # the longest such wait that ended since the last `drain_reply_lag`

    def tune_vad(self, *, threshold: float | None = None, preroll_ms: int | None = None) -> None:
        """A client's own VAD settings (a Realtime `server_vad`), from the next chunk on: the speech
        probability that starts speech, and the audio the recognizer gets before a speech onset. None: the
        server's configured value."""
        base = self._base_config
        vad = base.vad
        if threshold is not None:
            t = min(0.99, max(0.01, threshold))
            vad = replace(vad, threshold=t, neg_threshold=min(vad.neg_threshold, max(0.01, t - 0.15)))
        asr = base.asr if preroll_ms is None else replace(base.asr, preroll_s=preroll_ms / 1000)
        self._config = replace(base, vad=vad, asr=asr)
        self._hysteresis.retune(vad)
        self.transcriber.retune(asr)

    @property
    def stream_s(self) -> float:
        return self.transcriber.samples / VAD_SAMPLE_RATE

    @property
    def heard_s(self) -> float:
        """Stream time up to which VAD has evaluated the audio."""
        return self._vad_done / VAD_SAMPLE_RATE

    @property
    def silence_ms(self) -> float:
        """Silence since the last voiced VAD chunk (infinite before any speech)."""
        if self._last_voice_s is None:
            return float("inf")
        return 1000.0 * (self._vad_done / VAD_SAMPLE_RATE - self._last_voice_s)

    @property
    def voiced_ms(self) -> float:
        """How long VAD has heard speech without a break, up to `heard_s` (0 in silence)."""
        return 1000.0 * self._voiced_run * VAD_CHUNK_SAMPLES / VAD_SAMPLE_RATE

    @property
    def asr_settled(self) -> bool:
        """No recognizer pass due or running: the transcript reflects all speech heard so far."""
        return not (self.transcriber.wants_pass() or self.transcriber.pass_in_flight)

    def accept_frame(self, seq: int, pcm: bytes, now: float) -> np.ndarray:
        """Take one audio frame; returns the complete VAD chunks it makes ready, shape (k, 512)."""
        if self._last_seq is not None and seq <= self._last_seq:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"frame seq {seq} after {self._last_seq}; frame dropped")
        self._last_seq = seq
        samples = pcm16_to_float(pcm)
        self._pending.append(_Pending(seq, now, 1000.0 * len(samples) / self.sample_rate))
        return self._take_chunks(self._resampler.push(samples))

    def flush_audio(self) -> np.ndarray:
        """At the end of the stream: the resampler's tail, and a last chunk padded with silence."""
        tail = self._resampler.flush()
        pad = (-(len(self._vad_buf) + len(tail))) % VAD_CHUNK_SAMPLES
        return self._take_chunks(np.concatenate([tail, np.zeros(pad, np.float32)]))

    def _take_chunks(self, samples: np.ndarray) -> np.ndarray:
        self._vad_buf = np.concatenate([self._vad_buf, samples])
        k = len(self._vad_buf) // VAD_CHUNK_SAMPLES
        chunks = self._vad_buf[: k * VAD_CHUNK_SAMPLES].reshape(k, VAD_CHUNK_SAMPLES)
        self._vad_buf = self._vad_buf[k * VAD_CHUNK_SAMPLES :]
        return chunks

    def apply_vad(
        self, chunks: np.ndarray, probs: np.ndarray, now: float, echo_levels: np.ndarray | None = None
    ) -> list[Event]:
        """Apply VAD results for the chunks `accept_frame` returned; the frames behind them are now done.
        `echo_levels`: what the echo canceller took out of each chunk (`EchoCanceller.levels`)."""
        events: list[Event] = []
        if self.echo_levels is not None:
            self.echo_levels.extend(echo_levels, len(chunks))
        for chunk, prob in zip(chunks, probs, strict=True):
            events.extend(self.transcriber.append(chunk))
            self._keep(chunk)
            t0 = self._vad_done / VAD_SAMPLE_RATE
            self._vad_done += VAD_CHUNK_SAMPLES
            if prob >= self._config.vad.threshold:
                self._last_voice_s = self._vad_done / VAD_SAMPLE_RATE
                self._voiced_run += 1
            else:
                self._voiced_run = 0
            change = self._hysteresis.push(float(prob), t0)
            if isinstance(change, SpeechStarted):
                self._paused_at = None
                gap_s = None if self._spoke_until is None else change.t_s - self._spoke_until
                continues = gap_s is not None and gap_s <= self._config.asr.continue_gap_s
                self._turn_over = False
                self.transcriber.speech_started(change.t_s, continues=continues)
                events.append(change)
            elif isinstance(change, SpeechStopped):
                if self._paused_at is None:  # (else the utterance already ended at the pause)
                    self.transcriber.speech_stopped(change.t_s, voiced_end_s=self._last_voice_s)
                self._paused_at = None
                self._spoke_until = None if self._turn_over else self._last_voice_s
                events.append(change)
            elif self._paused_at is not None and self._voiced_run >= self._resume_chunks:
                # Speech resumed before VAD's end of speech: the next utterance starts where the last ended.
                self.transcriber.speech_started(self._paused_at, continues=True)
                self._paused_at = None
            self._maybe_pause()
        events.extend(self._ack(now))
        return events

    def turn_ended(self) -> None:
        """The user's turn ended (the endpointer, or the client, said so): speech after it is a turn of its
        own, never a continuation of the utterance before (`asr.continue_gap_s`), so a talk-over that starts
        soon after is not decoded behind the question it follows."""
        self._turn_over = True
        self._spoke_until = None

    def _maybe_pause(self) -> None:
        pause_ms = self._config.pause_ms
        if pause_ms and self._paused_at is None and self._hysteresis.speaking and self.silence_ms >= pause_ms:
            self._paused_at = self.heard_s
            self.transcriber.speech_stopped(self._paused_at, voiced_end_s=self._last_voice_s)
            if len(self._recent) and self._last_voice_s is not None:
                self._pause_audio = (self._last_voice_s, self._recent_audio())

    def _keep(self, chunk: np.ndarray) -> None:
        n = len(self._recent)
        if not n:
            return
        at = self._recent_end % n
        first = min(len(chunk), n - at)
        self._recent[at : at + first] = chunk[:first]
        self._recent[: len(chunk) - first] = chunk[first:]
        self._recent_end += len(chunk)

    def _recent_audio(self) -> np.ndarray:
        """The kept audio, oldest first (a copy)."""
        n = len(self._recent)
        if self._recent_end <= n:
            return self._recent[: self._recent_end].copy()
        at = self._recent_end % n
        return np.concatenate([self._recent[at:], self._recent[:at]])

    def take_pause_audio(self) -> tuple[float, np.ndarray] | None:
        """Once per pause (`pause_ms` of silence after speech): where the speech before it ended (stream
        seconds), and the last `keep_audio_s` of audio up to now (through the pause). None: no new pause,
        or no audio kept."""
        pause, self._pause_audio = self._pause_audio, None
        return pause

    def _ack(self, now: float) -> list[Event]:
        """Every frame whose chunks are now evaluated is done; ack once `ack_interval_ms` of audio is due."""
        last: _Pending | None = None
        while self._pending:
            last = self._pending.popleft()
            lag_ms = 1000.0 * (now - last.arrived)
            self.lags_ms.append(lag_ms)
            self._unread_lags.append(lag_ms)
            self.frames += 1
            self._worst_lag_ms = max(self._worst_lag_ms, lag_ms)
            self._since_ack_ms += last.audio_ms
        if last is None or self._since_ack_ms < self._config.ack_interval_ms:
            return []
        acked = FrameAcked(last.seq, 1000.0 * (now - last.arrived), self._worst_lag_ms)
        self._since_ack_ms = 0.0
        self._worst_lag_ms = 0.0
        return [acked]

    def drain_lags(self) -> list[float]:
        """Frame lags (ms) since the last call (the admission controller's period)."""
        lags = list(self._unread_lags)
        self._unread_lags.clear()
        return lags

    @property
    def asr_lag_s(self) -> float:
        """How far the transcript is behind: the age (in stream time) of the oldest speech no recognizer
        pass has covered yet; 0 while no utterance is open."""
        if not self.transcriber.active:
            return 0.0
        return max(0.0, self.heard_s - self.transcriber.pending_since_s())

    def note_reply_audio(self, starved: bool, now: float) -> None:
        """Whether the user is waiting for owed reply audio now (`Conversation.starved`), from the shell."""
        if starved and self._starved_since is None:
            self._starved_since = now
        elif not starved and self._starved_since is not None:
            wait = now - self._starved_since
            self.underrun_s += wait
            self._worst_wait = max(self._worst_wait, wait)
            self._starved_since = None

    def reply_lag_s(self, now: float) -> float:
        """How far the reply is behind playback: how long the user has been waiting for audio they are owed
        (from the end of their turn to the first audio, then any gap between pieces); 0 when nothing is owed."""
        return 0.0 if self._starved_since is None else now - self._starved_since

    def drain_reply_lag(self, now: float) -> float:
        """The longest wait for owed audio since the last call, ended or still going (the admission
        controller's period): a wait that ended between two samples still counts."""
        worst = max(self._worst_wait, self.reply_lag_s(now))
        self._worst_wait = 0.0
        return worst

    def end_of_stream(self) -> None:
        """No more audio: an open utterance gets its final pass over what was heard."""
        if self._hysteresis.speaking and self._paused_at is None:
            self.transcriber.speech_stopped(self.stream_s)

    # ASR scheduling, delegated to the transcriber.
    def wants_pass(self) -> bool:
        """A pass is due, except in the first moments of a pause: a partial pass started there would stop
        just short of the end of speech, and the final pass would then wait for it and run after it. Held
        until the pause finalizes the utterance (`turn.pause_ms`; without it, until the silence is longer
        than VAD's pad and the pass covers the end of speech: the transcriber's covered rule), there is
        one pass after the user stops instead of up to two."""
        if not self.transcriber.wants_pass():
            return False
        if self.transcriber.final_due:
            return True
        hold_ms = self._config.pause_ms or self._config.vad.speech_pad_ms + 100
        return not 64 <= self.silence_ms < hold_ms

    def pending_since_s(self) -> float:
        return self.transcriber.pending_since_s()

    def next_window_s(self) -> float:
        return self.transcriber.next_window_s()

    def next_preview(self) -> bool:
        return self.transcriber.next_preview()

    def prepare_pass(self) -> PassRequest:
        return self.transcriber.prepare_pass()

    def apply_pass(self, request: PassRequest, result: Transcription) -> list[Event]:
        return self.transcriber.apply_pass(request, result)

    @property
    def pass_in_flight(self) -> bool:
        return self.transcriber.pass_in_flight

    def abort_pass(self, request: PassRequest) -> list[Event]:
        return self.transcriber.abort_pass(request)

    def finish_without_pass(self) -> list[Event]:
        return self.transcriber.finish_final_without_pass()
