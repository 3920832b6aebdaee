"""The recordings a client says: the speech set's clips (outside the repository, listed in its manifest),
each as 16 kHz PCM16 mono, and where its speech ends.

`duplexd loadtest` says them; the benchmarks and the tests compose their conversations from them
(`bench.scenarios`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import soundfile as sf
import soxr

if TYPE_CHECKING:
    from duplexd.asr.vad import SileroVad

DATA_ENV = "DUPLEXD_TEST_DATA"
RATE = 16_000


def data_dir() -> Path:
    """The shared data folder: $DUPLEXD_TEST_DATA, else ../shared/data beside the checkout."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    beside_checkout = Path(__file__).resolve().parents[3] / "shared" / "data"
    return beside_checkout if beside_checkout.is_dir() else Path.cwd().parent / "shared" / "data"


@dataclass(frozen=True, slots=True)
class Clip:
    path: Path
    duration_s: float
    text: str | None
    speakers: int | None


def load_clips(root: Path | None = None) -> list[Clip]:
    """Clips listed in speech/manifest.jsonl; raises FileNotFoundError when the set is absent."""
    speech = (root or data_dir()) / "speech"
    manifest = speech / "manifest.jsonl"
    clips = []
    with open(manifest, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                spk = row.get("speakers")
                clips.append(
                    Clip(
                        speech / row["file"],
                        float(row["duration_s"]),
                        row.get("text"),
                        spk if isinstance(spk, int) else None,
                    )
                )
    return clips


def load(path: Path) -> np.ndarray:
    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    if rate != RATE:
        mono = soxr.resample(mono, rate, RATE)
    return (np.clip(mono, -1, 1) * 32767).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * RATE), np.int16)


@functools.cache
def _vad() -> SileroVad:
    """One Silero VAD for the process (its ONNX session; each call brings its own `VadStream`): a pause
    composed for `bench voice` asks for it several times."""
    from duplexd.asr.vad import SileroVad

    return SileroVad()


def _voiced_chunks(audio: np.ndarray, threshold: float) -> np.ndarray:
    """Indices of the 32 ms chunks of `audio` that Silero VAD calls speech."""
    from duplexd.asr.vad import VAD_CHUNK_SAMPLES, VadStream

    x = audio.astype(np.float32) / 32768.0
    k = len(x) // VAD_CHUNK_SAMPLES
    (probs,) = _vad().probabilities([VadStream()], [x[: k * VAD_CHUNK_SAMPLES].reshape(k, -1)])
    return np.flatnonzero(probs >= threshold)


def speech_end_s(audio: np.ndarray, threshold: float = 0.5) -> float:
    """Where the speech in `audio` ends: the end of the last 32 ms chunk Silero VAD calls speech."""
    from duplexd.asr.vad import VAD_CHUNK_SAMPLES

    voiced = _voiced_chunks(audio, threshold)
    return float((voiced[-1] + 1) * VAD_CHUNK_SAMPLES / RATE) if len(voiced) else 0.0


def speech_start_s(audio: np.ndarray, threshold: float = 0.5) -> float:
    """Where the speech in `audio` begins: the start of the first 32 ms chunk Silero VAD calls speech."""
    from duplexd.asr.vad import VAD_CHUNK_SAMPLES

    voiced = _voiced_chunks(audio, threshold)
    return float(voiced[0] * VAD_CHUNK_SAMPLES / RATE) if len(voiced) else 0.0


def silence_around(audio: np.ndarray, at: int, threshold: float = 0.5) -> tuple[float, float]:
    """Seconds of silence (no 32 ms chunk Silero VAD calls speech) in `audio` right before and right after
    sample `at`: (0, 0) where `at` falls in speech."""
    from duplexd.asr.vad import VAD_CHUNK_SAMPLES

    voiced = _voiced_chunks(audio, threshold)
    starts = voiced * VAD_CHUNK_SAMPLES
    ends = starts + VAD_CHUNK_SAMPLES
    if len(voiced) and np.any((starts <= at) & (at < ends)):
        return 0.0, 0.0
    before = ends[ends <= at]
    after = starts[starts > at]
    return (
        float(at - before.max()) / RATE if len(before) else at / RATE,
        float(after.min() - at) / RATE if len(after) else (len(audio) - at) / RATE,
    )
