"""How the user stopped talking: the acoustic end-of-turn signal, from Smart Turn v3.

Whisper punctuates a mid-sentence pause as a sentence often enough ("The birch canoe slid on the." and a
second of silence) that the LLM's P(end of turn) on the text takes it for a finished turn. The audio
cannot be fooled that way: a speaker who has finished lets pitch and loudness fall, one who pauses stops
mid-phrase. Smart Turn v3 (pipecat's open end-of-turn model: a Whisper-tiny-sized encoder, 8.7 MB int8
ONNX, BSD-2) reads the last 8 s of audio up to the pause and says how likely the turn is over.

The model ships in the `pipecat-ai` wheel (`pip install 'duplexd[smart-turn]'`); it is found on disk, never
downloaded. `turn.audio_model = "auto"` uses it when that package is installed.

    model = TurnAudioModel(smart_turn_path())
    p = model.probability(audio_16k)   # the audio up to (and 200 ms into) the pause; ~50 ms on one core

Measured on the speech set (docs/benchmarks.md): true ends of the single-speaker clips 0.84-0.99 but for 3
of 18; the quietest points mid-sentence below 0.1 but where the clip has a sentence boundary there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

RATE = 16_000
WINDOW_S = 8  # the model reads the last 8 s (left-padded with silence)
_SAMPLES = WINDOW_S * RATE
_PACKAGE = "pipecat"
_MODEL = Path("audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx")


class TurnAudioUnavailable(ValueError):
    """`turn.audio_model = "smart-turn"` without the package that ships the model."""


def smart_turn_path() -> Path | None:
    """The Smart Turn v3 model file in the installed `pipecat-ai` package (None: not installed). Found
    without importing the package (its import starts a logger and prints a banner)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / _MODEL
        if path.is_file():
            return path
    return None


def log_mel(audio: np.ndarray) -> np.ndarray:
    """The model's input for `audio` (float, 16 kHz): its last 8 s (left-padded with silence), normalized
    to zero mean and unit variance, as Whisper's 80-bin log-mel spectrogram, shape (80, 800)."""
    from faster_whisper.feature_extractor import FeatureExtractor

    x = np.asarray(audio, np.float32)[-_SAMPLES:]
    x = np.pad(x, (_SAMPLES - len(x), 0))
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    return FeatureExtractor(chunk_length=WINDOW_S)(x, padding=0)[:, : _SAMPLES // 160].astype(np.float32)


class TurnAudioModel:
    """Smart Turn v3 on onnxruntime, one thread. Not thread-safe: one caller at a time (the server's
    turn-audio worker)."""

    name = "smart-turn-v3.2"

    def __init__(self, path: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self._session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])

    def probability(self, audio: np.ndarray) -> float:
        """P(the turn is over) for speech that paused at the end of `audio` (float, 16 kHz)."""
        features = log_mel(audio)[None]
        (out,) = self._session.run(None, {"input_features": features})
        return float(np.clip(out.reshape(-1)[0], 0.0, 1.0))


def resolve_turn_audio(setting: str) -> Path | None:
    """The model file `turn.audio_model` asks for: `smart-turn` (`TurnAudioUnavailable` without its
    package), `auto` (it if installed), `off` (None)."""
    if setting == "off":
        return None
    path = smart_turn_path()
    if path is None and setting == "smart-turn":
        raise TurnAudioUnavailable(
            "turn.audio_model = smart-turn needs the package that ships the model: "
            "pip install 'duplexd[smart-turn]' (or set turn.audio_model = off)"
        )
    return path


def load_turn_audio(setting: str, threads: int = 1) -> TurnAudioModel | None:
    path = resolve_turn_audio(setting)
    return None if path is None else TurnAudioModel(path, threads)
