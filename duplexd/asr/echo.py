"""Echo cancellation: a session's microphone, less the reply audio it hears from the loudspeaker.

The server holds the far end exactly: the reply audio it sent, placed in time by where the client says it
is playing (its `playback` reports, or real time for clients that send none). WebRTC's AEC3 (through
`pywebrtc-audio`) estimates what remains unknown itself: the network, the client's buffers, the room.

    reply frame sent           -> FarEnd.sent(pcm)                 (event loop)
    reply stopped, not played  -> FarEnd.skip(position)
    microphone chunks arrive   -> far = FarEnd.take(played, n)     (event loop: the reference for them,
                                                                    on the microphone's own timeline)
                               -> EchoCanceller.process(mic, far)  (the VAD worker's thread)

`EchoCanceller` works in 10 ms blocks and returns as many samples as it is given, so its output is the
microphone delayed by exactly one block (`DELAY_SAMPLES`). Chosen over LiveKit's `AudioProcessingModule`
(the same AEC3 behind an FFI) by measurement: docs/benchmarks.md, "Echo cancellation".
"""

from __future__ import annotations

from collections import deque

import numpy as np
import soxr

from duplexd.asr.vad import VAD_CHUNK_SAMPLES, VAD_SAMPLE_RATE
from duplexd.errors import EngineError

BLOCK_SAMPLES = VAD_SAMPLE_RATE // 100  # AEC3 takes 10 ms at a time
DELAY_SAMPLES = BLOCK_SAMPLES
_RESAMPLE_MARGIN = 480  # output samples read either side of a reference's span (the resampler's reach)
ECHO_GATE_DB = 15.0  # a chunk the canceller took this much out of, while the reply played, is echo only
_FAR_ACTIVE = 1e-5  # mean square of a playing loudspeaker's chunk (-50 dBFS): quieter is not playing
_FAR_MEMORY_CHUNKS = 16  # the reply's echo still arrives this many chunks (0.5 s) after it played
_LEAD_MS = 60.0  # the reference goes this much ahead of where the client says it plays (never behind its echo)
# Is there an echo at all? The microphone's loudness, block by block, follows the far end's some delay later
# when the loudspeaker is heard; not with headphones, or a client that cancels its own echo (a browser,
# LiveKit), where AEC3 would only take the user out while the reply plays.
_ENV_BLOCKS = 300  # 3 s of 10 ms blocks looked at
_ENV_LAGS = 60  # delays tried: up to 0.6 s
_ENV_MIN_ACTIVE = 50  # far-end blocks playing in the window before deciding
_ENV_EVERY = 10  # blocks between decisions (0.1 s)
_ECHO_HEARD, _ECHO_GONE = 0.4, 0.25  # envelope correlation: hysteresis (0.35 heard the user alone)


class EchoCanceller:
    """One session's AEC3 state. Not thread-safe: only the VAD worker calls `process`, one batch at a
    time."""

    def __init__(self, *, replace_audio: bool = False) -> None:
        """`replace_audio`: `process` returns the cancelled audio while the microphone hears the loudspeaker
        (`turn.echo_cancellation = "cancel"`); else the audio as heard, and the canceller only says which
        chunks were echo and nothing else (`"gate"`)."""
        self.replace_audio = replace_audio
        try:
            from pywebrtc_audio import AudioProcessor
        except ImportError as exc:  # (a core dependency: only a broken install lacks it)
            raise EngineError(f"echo cancellation needs the pywebrtc-audio package ({exc})") from None
        self._apm = AudioProcessor(VAD_SAMPLE_RATE, echo_cancellation=True, high_pass_filter=True)
        self._mic = np.zeros(0, np.float32)  # less than a block, waiting for the rest of it
        self._far = np.zeros(0, np.float32)
        self._out = np.zeros(DELAY_SAMPLES, np.float32)  # blocks done and not returned yet (< 2 blocks)
        self._heard = np.zeros(DELAY_SAMPLES, np.float32)  # the same, as heard / as cancelled
        self._cancelled = np.zeros(DELAY_SAMPLES, np.float32)
        self.heard = self.cancelled = np.zeros(0, np.float32)  # the last `process`'s span, for `echo_only`
        self.levels = np.zeros((0, 2))  # the last `echo_only`'s chunks: energy as heard, as left (NaN: no echo)
        self._blocks = 0
        self._far_env: deque[float] = deque(maxlen=_ENV_BLOCKS)  # log energy per block
        self._mic_env: deque[float] = deque(maxlen=_ENV_BLOCKS)
        self.echo_heard = False  # the microphone hears the loudspeaker (else the audio passes as heard)
        self._far_levels: deque[float] = deque([0.0] * _FAR_MEMORY_CHUNKS, maxlen=_FAR_MEMORY_CHUNKS)

    def process(self, mic: np.ndarray, far: np.ndarray) -> np.ndarray:
        """`mic` one block later (the same length; `far`: the loudspeaker's audio over the same span), less
        its echo of `far` with `replace_audio` while the microphone hears the loudspeaker. AEC3 runs on
        every block either way (`cancelled`), so it has converged when an echo appears."""
        if len(far) != len(mic):
            raise ValueError(f"far end has {len(far)} samples for {len(mic)} of microphone")
        mic_all = np.concatenate([self._mic, mic.astype(np.float32, copy=False)])
        far_all = np.concatenate([self._far, far.astype(np.float32, copy=False)])
        whole = len(mic_all) - len(mic_all) % BLOCK_SAMPLES
        blocks, heard_blocks, cancelled_blocks = [self._out], [self._heard], [self._cancelled]
        for i in range(0, whole, BLOCK_SAMPLES):
            heard, played = mic_all[i : i + BLOCK_SAMPLES], far_all[i : i + BLOCK_SAMPLES]
            cancelled = self._apm.process(heard, played)
            self._far_env.append(_log_energy(played))
            self._mic_env.append(_log_energy(heard))
            self._blocks += 1
            if self._blocks % _ENV_EVERY == 0:
                self._update_echo_heard()
            blocks.append(cancelled if self.echo_heard and self.replace_audio else heard)
            heard_blocks.append(heard)
            cancelled_blocks.append(cancelled)
        self._mic, self._far = mic_all[whole:], far_all[whole:]
        n = len(mic)
        out, heard_all, cancelled_all = (np.concatenate(b) for b in (blocks, heard_blocks, cancelled_blocks))
        self._out, self._heard, self._cancelled = out[n:], heard_all[n:], cancelled_all[n:]
        self.heard, self.cancelled = heard_all[:n], cancelled_all[:n]
        return out[:n]

    def _update_echo_heard(self) -> None:
        """Whether the microphone's loudness follows the far end's (the best delay's correlation over the
        last `_ENV_BLOCKS` blocks the loudspeaker played in), with hysteresis; unchanged while it is quiet."""
        far, mic = np.array(self._far_env), np.array(self._mic_env)
        if len(far) < _ENV_LAGS + _ENV_MIN_ACTIVE + 1:
            return
        # Block-to-block changes, syllable by syllable (a level that merely differs for a while, the user
        # talking through a quieter stretch of the reply, is no echo); the microphone's newest `width` of
        # them against the far end's `lag` blocks earlier, every lag at once.
        d_far, d_mic = np.diff(far), np.diff(mic)
        width = len(d_mic) - (_ENV_LAGS - 1)
        m = d_mic[_ENV_LAGS - 1 :]
        windows = np.lib.stride_tricks.sliding_window_view(d_far, width)[::-1]  # row `lag`: shifted by it
        playing = far > _FAR_ACTIVE_DB
        both = playing[1:] & playing[:-1]  # (a change between two blocks that both played)
        mask = np.lib.stride_tricks.sliding_window_view(both, width)[::-1].astype(np.float64)
        n = mask.sum(axis=1)
        ok = n >= _ENV_MIN_ACTIVE
        n = np.maximum(n, 1)
        f_mean = (windows * mask).sum(axis=1) / n
        m_mean = (m * mask).sum(axis=1) / n
        f_c, m_c = (windows - f_mean[:, None]) * mask, (m - m_mean[:, None]) * mask
        denom = np.sqrt((f_c**2).sum(axis=1) * (m_c**2).sum(axis=1))
        corr = np.where(ok & (denom > 0), (f_c * m_c).sum(axis=1) / np.maximum(denom, 1e-12), -1.0)
        best = float(corr.max())
        if best < -0.5:
            return  # (not enough playing yet to tell)
        self.echo_heard = best >= (_ECHO_GONE if self.echo_heard else _ECHO_HEARD)

    def echo_only(self, far: np.ndarray) -> np.ndarray:
        """For each chunk of the last `process` (`far`: its far end, one chunk per row), True
        where the loudspeaker was playing and the canceller took `ECHO_GATE_DB` or more out of it: the
        microphone heard the reply and nothing else. VAD takes such a chunk as silence (what is left of an
        echo is no one talking). The user talking over the reply is not cancelled: their chunks keep most
        of their energy. Before the canceller has converged (the first reply's first second or so) it
        takes little out, and this says False: the text check behind it still knows the reply's words.

        Each chunk's energy as heard and as left by the canceller goes to `levels` (NaN where there was no
        echo to cancel: the loudspeaker silent, or not heard): how much of a word heard over the reply was
        its echo (`EchoLevels`)."""
        mic, out = self.heard.reshape(far.shape), self.cancelled.reshape(far.shape)
        flags = np.zeros(len(mic), bool)
        self.levels = np.full((len(mic), 2), np.nan)
        for i in range(len(mic)):
            self._far_levels.append(float(np.mean(np.square(far[i], dtype=np.float64))))
            heard = float(np.mean(np.square(mic[i], dtype=np.float64)))
            left = float(np.mean(np.square(out[i], dtype=np.float64)))
            playing = max(self._far_levels) > _FAR_ACTIVE
            flags[i] = self.echo_heard and playing and heard > 0 and left < heard * 10 ** (-ECHO_GATE_DB / 10)
            if self.echo_heard and playing:
                self.levels[i] = heard, left
        return flags


class EchoLevels:
    """How much of what the microphone heard, chunk by chunk, was the reply's echo: each VAD chunk's energy
    as heard and as the canceller left it, on the stream's timeline (the recognizer's word times), for the
    last `max_s`. Bounded; event loop only (the VAD worker hands each batch's levels back with its
    probabilities).

    A word heard over the reply that the canceller took most of out (`attenuation_db`) was its echo, whatever
    Whisper made of it ("This is" of a garbled "I'm a voice assistant"); a user talking over the reply keeps
    most of their energy (-1.4 dB median chunk through a room, docs/benchmarks.md)."""

    def __init__(self, chunk_s: float = VAD_CHUNK_SAMPLES / VAD_SAMPLE_RATE, max_s: float = 60.0) -> None:
        self._chunk_s = chunk_s
        self._levels = np.full((max(1, int(max_s / chunk_s)), 2), np.nan)
        self._end = 0  # chunks recorded (the next chunk's index)

    def extend(self, levels: np.ndarray | None, n: int) -> None:
        """The next `n` chunks' levels (None: no canceller ran on them)."""
        size = len(self._levels)
        rows = np.full((n, 2), np.nan) if levels is None else levels[-size:]
        at = np.arange(self._end + n - len(rows), self._end + n) % size
        self._levels[at] = rows
        self._end += n

    def attenuation_db(self, start_s: float, end_s: float) -> float | None:
        """How many dB the canceller took out of the audio over [start_s, end_s), its chunks' energy summed;
        None where fewer than half of those chunks had an echo to cancel (or they are no longer kept)."""
        size = len(self._levels)
        lo = max(int(start_s / self._chunk_s), self._end - size, 0)
        hi = min(max(int(np.ceil(end_s / self._chunk_s)), lo + 1), self._end)
        if hi <= lo:
            return None
        rows = self._levels[np.arange(lo, hi) % size]
        known = rows[~np.isnan(rows[:, 0])]
        if 2 * len(known) < len(rows):
            return None
        heard, left = known.sum(axis=0)
        return float(10 * np.log10((heard + 1e-12) / (left + 1e-12)))


def _log_energy(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.square(x, dtype=np.float64)) + 1e-10))


_FAR_ACTIVE_DB = 10 * np.log10(_FAR_ACTIVE)


class FarEnd:
    """The reference for one session's echo canceller: the output stream (reply audio as sent, int16 at
    `out_rate`), read at the microphone's timeline and resampled to 16 kHz. Event loop only.

    Microphone sample `m` (16 kHz, counted over the chunks `take` was asked for) hears output-stream
    sample `m * out_rate / 16000 + offset`. The offset is set where the client says it is playing when
    the microphone audio arrives, and kept while that estimate stays within `tolerance_ms` of it: the
    reference runs on one steady timeline, as the loudspeaker does, not jittering with each playback report
    (AEC3 adapts to one delay; a delay that moves every chunk undoes its filter). A stopped reply, an
    underrun or a drifting clock move the estimate further: the offset is set again.

    Bounded: at most `max_s` of sent audio is kept (what is sent runs at most the playout's lead ahead
    of the playback; older audio than that has been heard already)."""

    def __init__(self, out_rate: int, *, max_s: float = 2.0, tolerance_ms: float = 40.0) -> None:
        self._rate = out_rate
        self._max = int(max_s * out_rate)
        self._tolerance = tolerance_ms * out_rate / 1000
        self._audio = np.zeros(0, np.float32)  # output-stream samples [_start, _start + len) as sent
        self._start = 0
        self._mic = 0  # microphone samples referenced so far
        self._offset: float | None = None
        self.anchors = 0  # times the offset was set (for tests and metrics)

    def sent(self, pcm: bytes) -> None:
        """The next frame of the output stream went out."""
        frame = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        self._audio = np.concatenate([self._audio, frame])
        if len(self._audio) > self._max:
            self._start += len(self._audio) - self._max
            self._audio = self._audio[-self._max :]

    def skip(self, position: int) -> None:
        """The client jumps to `position` of the output stream (a stopped reply it discards): set the
        offset again at the next `take`."""
        self._offset = None

    def silence(self, n: int) -> np.ndarray:
        """The reference for the next `n` microphone samples while the client's playback is paused: nothing.
        The offset is set again when it plays on."""
        self._mic += n
        self._offset = None
        return np.zeros(n, np.float32)

    def take(self, played: int, n: int) -> np.ndarray:
        """The reference for the next `n` microphone samples, arriving now that the client has played the
        output stream up to `played`."""
        ratio = self._rate / VAD_SAMPLE_RATE
        self._mic += n
        now_offset = played - self._mic * ratio  # (the newest microphone sample hears the newest played one)
        if self._offset is None or abs(now_offset - self._offset) > self._tolerance:
            self._offset = now_offset
            self.anchors += 1
        lo = int(round((self._mic - n) * ratio + self._offset + _LEAD_MS * self._rate / 1000))
        hi = lo + int(round(n * ratio))
        margin = _RESAMPLE_MARGIN
        window = self._read(lo - margin, hi + margin)
        out = soxr.resample(window, self._rate, VAD_SAMPLE_RATE)
        skip = int(round(margin / ratio))
        ref = out[skip : skip + n]
        if len(ref) < n:
            ref = np.pad(ref, (0, n - len(ref)))
        self._forget_before(lo - margin)
        return ref.astype(np.float32, copy=False)

    def _read(self, lo: int, hi: int) -> np.ndarray:
        """Output-stream samples [lo, hi); silence where nothing was sent (or kept)."""
        out = np.zeros(hi - lo, np.float32)
        a, b = max(lo, self._start), min(hi, self._start + len(self._audio))
        if a < b:
            out[a - lo : b - lo] = self._audio[a - self._start : b - self._start]
        return out

    def _forget_before(self, position: int) -> None:
        if position > self._start:
            cut = min(position - self._start, len(self._audio))
            self._audio, self._start = self._audio[cut:], self._start + cut
