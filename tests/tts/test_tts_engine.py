"""The TTS engines speak: 24 kHz float audio that Whisper transcribes back to the text."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from duplexd.config import TtsConfig
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE, load_tts

pytestmark = pytest.mark.slow

TEXT = "Hello there, the weather is lovely today."


@pytest.mark.parametrize("name", ["hibari", "piper"])
def test_engine_speaks_the_text(name: str, engines) -> None:
    if name == "piper":
        pytest.importorskip("piper", reason="the Piper engine is an extra: pip install 'duplexd[piper]'")
    tts = load_tts(TtsConfig(engine=name))
    audio = tts.synthesize(TEXT)
    assert audio.dtype == np.float32 and audio.ndim == 1
    seconds = len(audio) / OUTPUT_SAMPLE_RATE
    assert 1.0 < seconds < 6.0
    assert np.abs(audio).max() <= 1.0 and np.sqrt(np.mean(audio**2)) > 0.02
    heard = engines.asr.transcribe(soxr.resample(audio, OUTPUT_SAMPLE_RATE, 16_000), "")
    text = " ".join(w.text for w in heard.words).lower()
    assert "weather" in text and "today" in text, text
    assert len(tts.synthesize("")) == 0 or np.sqrt(np.mean(tts.synthesize("") ** 2)) < 0.01


def test_hibari_is_deterministic_and_speed_changes_duration() -> None:
    normal = load_tts(TtsConfig())
    fast = load_tts(TtsConfig(speed=1.5))
    a, b = normal.synthesize(TEXT), normal.synthesize(TEXT)
    assert np.array_equal(a, b)
    assert len(fast.synthesize(TEXT)) < 0.8 * len(a)


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="tts.engine"):
        TtsConfig(engine="espeak")
