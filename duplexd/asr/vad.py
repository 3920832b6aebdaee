"""Voice activity: the hysteresis policy (pure) and the batched Silero VAD engine."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duplexd.config import VadConfig
from duplexd.errors import EngineError
from duplexd.events import SpeechStarted, SpeechStopped

VAD_SAMPLE_RATE = 16_000
VAD_CHUNK_SAMPLES = 512  # Silero's window at 16 kHz: 32 ms
VAD_CHUNK_S = VAD_CHUNK_SAMPLES / VAD_SAMPLE_RATE
_CONTEXT_SAMPLES = 64
_STATE_SHAPE = (2, 1, 128)


class VadHysteresis:
    """Turns per-chunk speech probabilities into speech start/stop events.

    Speech starts after `min_speech_ms` of chunks at or above `threshold`; it stops after `min_silence_ms`
    of chunks below `neg_threshold` (chunks between the two thresholds neither start nor end a silence).
    Reported times are padded by `speech_pad_ms` so that word onsets and tails are not clipped.
    """

    def __init__(self, config: VadConfig) -> None:
        self._config = config
        self._speaking = False
        self._run_start_s: float | None = None  # first chunk of the current speech (or silence) run
        self._last_stop_s = 0.0

    @property
    def speaking(self) -> bool:
        return self._speaking

    def retune(self, config: VadConfig) -> None:
        """New thresholds (a client's own), from the next chunk on; the current speech state stays."""
        self._config = config

    def push(self, prob: float, chunk_start_s: float) -> SpeechStarted | SpeechStopped | None:
        cfg = self._config
        chunk_end_s = chunk_start_s + VAD_CHUNK_S
        pad_s = cfg.speech_pad_ms / 1000
        if not self._speaking:
            if prob < cfg.threshold:
                self._run_start_s = None
                return None
            if self._run_start_s is None:
                self._run_start_s = chunk_start_s
            if chunk_end_s - self._run_start_s + 1e-9 < cfg.min_speech_ms / 1000:
                return None
            self._speaking = True
            start_s = max(self._run_start_s - pad_s, self._last_stop_s, 0.0)
            self._run_start_s = None
            return SpeechStarted(t_s=start_s)
        if prob >= cfg.threshold:
            self._run_start_s = None
        elif prob < cfg.neg_threshold:
            if self._run_start_s is None:
                self._run_start_s = chunk_start_s
            if chunk_end_s - self._run_start_s + 1e-9 >= cfg.min_silence_ms / 1000:
                self._speaking = False
                stop_s = min(self._run_start_s + pad_s, chunk_end_s)
                self._run_start_s = None
                self._last_stop_s = stop_s
                return SpeechStopped(t_s=stop_s)
        return None


@dataclass(slots=True)
class VadStream:
    """One audio stream's recurrent Silero state (owned by its session, touched only by the VAD worker)."""

    state: np.ndarray = field(default_factory=lambda: np.zeros(_STATE_SHAPE, np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(_CONTEXT_SAMPLES, np.float32))


def default_vad_model() -> Path:
    """The ONNX file inside the `silero-vad` package, found without importing it: its `__init__` imports
    torch and sets torch's threads to 1 for the whole process (the dialog engine then decoded on one
    core of two)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise EngineError("the silero-vad package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"


class SileroVad:
    """Silero VAD (ONNX) shared by every session; one call evaluates a batch of streams together."""

    def __init__(self, model_path: str | Path | None = None) -> None:
        import onnxruntime

        opts = onnxruntime.SessionOptions()
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = 1
        opts.log_severity_level = 3
        self._session = onnxruntime.InferenceSession(
            str(model_path or default_vad_model()), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self._sr = np.array(VAD_SAMPLE_RATE, dtype=np.int64)

    def probabilities(self, streams: list[VadStream], chunks: list[np.ndarray]) -> list[np.ndarray]:
        """For each stream, the speech probability of each of its 512-sample chunks, in order.

        `chunks[i]` has shape (k_i, 512); streams advance step by step, batched across streams.
        """
        out = [np.empty(len(c), np.float32) for c in chunks]
        steps = max((len(c) for c in chunks), default=0)
        for step in range(steps):
            active = [i for i, c in enumerate(chunks) if len(c) > step]
            x = np.stack([np.concatenate([streams[i].context, chunks[i][step]]) for i in active])
            state = np.concatenate([streams[i].state for i in active], axis=1)
            prob, new_state = self._session.run(None, {"input": x, "state": state, "sr": self._sr})
            for j, i in enumerate(active):
                out[i][step] = prob[j, 0]
                streams[i].state = np.ascontiguousarray(new_state[:, j : j + 1])
                streams[i].context = x[j, -_CONTEXT_SAMPLES:].copy()
        return out
