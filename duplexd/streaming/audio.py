"""PCM decoding and streaming resampling to the models' 16 kHz (soxr, stateful across frames)."""

from __future__ import annotations

import numpy as np
import soxr

TARGET_RATE = 16_000


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()


class StreamResampler:
    """Resamples one stream frame by frame; the filter state carries over, so frame edges leave no seams."""

    def __init__(self, in_rate: int, out_rate: int = TARGET_RATE) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")

    def push(self, samples: np.ndarray) -> np.ndarray:
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples)

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
