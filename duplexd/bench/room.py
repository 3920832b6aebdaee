"""A loudspeaker in a room, for the echo scenarios: what the microphone hears of the reply being played.

Not the reply mixed back linearly (any echo canceller removes that trivially), but: mild loudspeaker
clipping (tanh, towards -3.5 dBFS), a room impulse response by the image method (`pyroomacoustics`,
shoebox rooms with RT60 0.2-0.6 s), and a playback delay of 50-200 ms that drifts as it plays (the sound
card's clock against the network's; the player repeats or drops a sample to follow it). Streaming and
deterministic for a seed; 16 kHz float in, 16 kHz float out.

`erle_db` measures an echo canceller on such paths: echo return loss enhancement, the echo's energy over
what is left of it, after the canceller's first second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RATE = 16_000
CLIP_DRIVE = 1.5  # tanh(drive * x) / drive: unchanged when quiet, flattening towards 1 / drive (-3.5 dBFS)
DRIFT_MS = 10.0  # the delay wanders this much either way ...
DRIFT_PERIOD_S = 120.0  # ... over this long (at most 0.5 ms/s: a few times a sound card's clock skew)


def room_impulse_response(rt60_s: float, seed: int) -> np.ndarray:
    """A shoebox room's impulse response from a loudspeaker to a microphone 0.3-0.6 m from it, with unit
    energy (the echo's level is set by the path's gain)."""
    import pyroomacoustics as pra

    rng = np.random.default_rng(seed)
    room_dim = [4.0 + 2.0 * rng.random(), 3.0 + 2.0 * rng.random(), 2.7]
    absorption, max_order = pra.inverse_sabine(rt60_s, room_dim)
    room = pra.ShoeBox(room_dim, fs=RATE, materials=pra.Material(absorption), max_order=max_order)
    source = [1.0 + rng.random(), 1.0 + rng.random(), 1.2]
    angle = 2 * math.pi * rng.random()
    distance = 0.3 + 0.3 * rng.random()
    room.add_source(source)
    room.add_microphone([source[0] + distance * math.cos(angle), source[1] + distance * math.sin(angle), 1.1])
    room.compute_rir()
    h = np.asarray(room.rir[0][0], np.float64)
    return (h / np.sqrt(np.sum(h**2))).astype(np.float32)


@dataclass(frozen=True, slots=True)
class RoomSpec:
    rt60_s: float
    delay_ms: float  # the playback delay around which it drifts
    gain: float  # the echo's level against the reply's (0.5: -6 dB)
    seed: int
    drift_ms: float = DRIFT_MS

    @property
    def name(self) -> str:
        return f"rt60 {self.rt60_s:.1f} s, {20 * math.log10(self.gain):+.0f} dB, delay {self.delay_ms:.0f} ms"


def rooms(n: int, gain: float, seed: int = 0) -> list[RoomSpec]:
    """`n` echo paths at `gain`: RT60 and delay spread over 0.2-0.6 s and 50-200 ms."""
    rng = np.random.default_rng(seed)
    return [
        RoomSpec(round(0.2 + 0.4 * (i + rng.random()) / n, 2), round(50 + 150 * rng.random()), gain, seed * 1000 + i)
        for i in range(n)
    ]


class EchoPath:
    """The microphone's share of what the loudspeaker plays, one call per stretch of audio played."""

    def __init__(self, spec: RoomSpec) -> None:
        self.spec = spec
        self._h = room_impulse_response(spec.rt60_s, spec.seed)
        self._tail = np.zeros(len(self._h) - 1, np.float64)  # the room's response still ringing
        self._room = np.zeros(0, np.float64)  # room output not yet read by the delayed microphone
        self._room_start = 0  # sample index (of the room's output) of `_room[0]`
        self._t = 0  # samples returned so far

    def _delay(self, t: np.ndarray) -> np.ndarray:
        drift = self.spec.drift_ms * np.sin(2 * np.pi * t / (DRIFT_PERIOD_S * RATE))
        return (self.spec.delay_ms + drift) * RATE / 1000

    def __call__(self, played: np.ndarray) -> np.ndarray:
        """The echo in the next `len(played)` microphone samples, given the loudspeaker played `played`
        over them."""
        n = len(played)
        x = np.tanh(CLIP_DRIVE * played.astype(np.float64)) / CLIP_DRIVE
        y = np.convolve(x, self._h)  # (n + len(h) - 1 samples: overlap-add)
        y[: len(self._tail)] += self._tail
        self._tail = y[n:].copy()
        self._room = np.concatenate([self._room, y[:n]])
        t = np.arange(self._t, self._t + n, dtype=np.float64)
        # Whole samples: a player keeps up with a drifting clock by repeating or dropping a sample now and
        # then (a fractional delay that slides would filter the echo differently every few ms instead).
        at = np.rint(t - self._delay(t)).astype(np.int64) - self._room_start  # where each microphone sample reads
        room = np.concatenate([self._room, [0.0]])  # (index -1: before the first sample, silence)
        out = room[np.where((at >= 0) & (at < len(self._room)), at, -1)]
        self._t += n
        keep = max(0, int(at[-1]) - 2) if n else 0
        self._room, self._room_start = self._room[keep:], self._room_start + keep
        return (self.spec.gain * out).astype(np.float32)


def erle_db(far: np.ndarray, spec: RoomSpec, chunk: int = 512) -> float:
    """The echo canceller's ERLE on `far` (16 kHz float, the reply) played through `spec`: echo energy over
    residual energy, after its first second, with no near-end speech."""
    from duplexd.asr.echo import DELAY_SAMPLES, EchoCanceller

    path, canceller = EchoPath(spec), EchoCanceller(replace_audio=True)
    echo = np.concatenate([path(far[i : i + chunk]) for i in range(0, len(far), chunk)])
    residual = []
    for i in range(0, len(far), chunk):
        canceller.process(echo[i : i + chunk], far[i : i + chunk])
        residual.append(canceller.cancelled)  # (AEC3's output, whether or not the echo was detected yet)
    left = np.concatenate(residual)[DELAY_SAMPLES:]
    start = RATE
    e, r = echo[start : len(left)], left[start:]
    return float(10 * np.log10(np.sum(e.astype(np.float64) ** 2) / max(1e-12, np.sum(r.astype(np.float64) ** 2))))
