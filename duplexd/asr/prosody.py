"""How an utterance stopped: the acoustic side of the end of a turn. Pure numpy, deterministic.

A speaker who has finished lets the pitch fall to the bottom of their range and the voice fade; one who
pauses mid-sentence stops on a level or rising pitch, at full strength. Whisper punctuates both as
sentences often enough ("The birch canoe slid on the." and a pause), so the LLM's P(end of turn) on the
text cannot tell them apart; the audio before the pause can.

    features = end_features(audio_16k, end)   # the ~1.5 s of speech before `end` (a sample index)
    p = finished_probability(features)        # 0..1: sounds like the end of what they had to say

Pitch is autocorrelation-based (40 ms frames every 10 ms, 70-400 Hz, voiced where the normalized peak is
0.45 or more): about 2 ms for 1.5 s of audio on one core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RATE = 16_000
_FRAME = 640  # 40 ms
_HOP = 160  # 10 ms
_FMIN, _FMAX = 70.0, 400.0
_VOICED = 0.45  # normalized autocorrelation peak
CONTEXT_S = 1.5  # audio before the end that is looked at
_TAIL_S = 0.3  # the stretch whose pitch and level are "how it ended"


@dataclass(frozen=True, slots=True)
class EndFeatures:
    """The end of the speech before a pause, relative to the speaker's own range in the context."""

    final_pitch_st: float  # median pitch of the last voiced 100 ms, in semitones from the context's median
    pitch_slope_st_s: float  # pitch slope over the last `_TAIL_S` of voiced frames (semitones per second)
    final_level_db: float  # level of the last voiced 100 ms against the context's voiced median
    voiced_frames: int  # voiced frames in the context (few: not enough to judge)


def pitch_track(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 10 ms frame: pitch in Hz (NaN where unvoiced) and level in dB (float audio at 16 kHz)."""
    n = 1 + (len(x) - _FRAME) // _HOP if len(x) >= _FRAME else 0
    if n <= 0:
        return np.zeros(0), np.zeros(0)
    idx = np.arange(_FRAME)[None, :] + _HOP * np.arange(n)[:, None]
    frames = x[idx].astype(np.float64)
    frames -= frames.mean(axis=1, keepdims=True)
    level = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-10)
    spec = np.fft.rfft(frames * np.hanning(_FRAME), n=2 * _FRAME, axis=1)
    ac = np.fft.irfft(np.abs(spec) ** 2, axis=1)[:, :_FRAME]
    ac /= np.maximum(ac[:, :1], 1e-12)
    lo, hi = int(RATE / _FMAX), int(RATE / _FMIN)
    lag = lo + np.argmax(ac[:, lo:hi], axis=1)
    peak = ac[np.arange(n), lag]
    # Parabolic interpolation around the peak for a finer lag.
    left, right = ac[np.arange(n), lag - 1], ac[np.arange(n), np.minimum(lag + 1, _FRAME - 1)]
    denom = left - 2 * peak + right
    shift = np.where(np.abs(denom) > 1e-9, 0.5 * (left - right) / denom, 0.0)
    f0 = RATE / (lag + np.clip(shift, -0.5, 0.5))
    loud = level > np.max(level) - 35  # (not the room's hiss)
    return np.where((peak >= _VOICED) & loud, f0, np.nan), level


def end_features(audio: np.ndarray, end: int) -> EndFeatures | None:
    """The features of the speech ending at sample `end` of `audio` (float, 16 kHz); None if it has too
    little voiced speech to judge."""
    start = max(0, end - int(CONTEXT_S * RATE))
    f0, level = pitch_track(audio[start:end])
    voiced = np.flatnonzero(~np.isnan(f0))
    if len(voiced) < 10:
        return None
    st = 12 * np.log2(f0[voiced] / np.median(f0[voiced]))
    lv = level[voiced]
    last = voiced >= voiced[-1] - 10  # the last voiced 100 ms
    tail = voiced >= voiced[-1] - int(_TAIL_S * 100)
    slope = 0.0
    if tail.sum() >= 5:
        t = voiced[tail] / 100.0
        slope = float(np.polyfit(t, st[tail], 1)[0])
    return EndFeatures(
        final_pitch_st=float(np.median(st[last])),
        pitch_slope_st_s=slope,
        final_level_db=float(np.median(lv[last]) - np.median(lv)),
        voiced_frames=len(voiced),
    )


# Logistic weights: fitted offline on the speech set (`duplexd bench prosody`: true ends of the
# single-speaker clips against the quietest points mid-sentence), see docs/benchmarks.md.
_WEIGHTS = {"bias": 0.0, "final_pitch_st": -0.5, "pitch_slope_st_s": -0.1, "final_level_db": -0.1}


def finished_probability(f: EndFeatures | None) -> float | None:
    """How much the end sounds like the end of a turn (0..1); None without features."""
    if f is None:
        return None
    w = _WEIGHTS
    z = (
        w["bias"]
        + w["final_pitch_st"] * f.final_pitch_st
        + w["pitch_slope_st_s"] * f.pitch_slope_st_s
        + w["final_level_db"] * f.final_level_db
    )
    return 1 / (1 + math.exp(-max(-30.0, min(30.0, z))))
