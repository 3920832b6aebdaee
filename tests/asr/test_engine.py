"""The faster-whisper engine on real audio: one pass, the offline baseline, and the prompt cap."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.asr.commit import norm
from duplexd.bench.data import wer
from duplexd.clients.clips import Clip
from duplexd.clients.stream import read_audio

pytestmark = pytest.mark.slow


def _audio(clip: Clip) -> np.ndarray:
    pcm, rate = read_audio(clip.path)
    assert rate == 16000
    return pcm.astype(np.float32) / 32768


def test_one_pass_transcribes_a_clip_with_word_times(engines, clip_by_name: dict[str, Clip]) -> None:
    asr = engines.asr
    clip = clip_by_name["clip02_libri_1272-128104-0000.wav"]
    result = asr.transcribe(_audio(clip), "")
    words = result.words
    assert wer([clip.text or ""], [" ".join(w.text for w in words)]) <= 0.1
    starts = [w.start_s for w in words]
    assert starts == sorted(starts)
    assert all(0.0 <= w.start_s <= w.end_s <= clip.duration_s + 0.05 for w in words)


def test_offline_baseline_transcribes_the_same_clip(engines, clip_by_name: dict[str, Clip]) -> None:
    asr = engines.asr
    clip = clip_by_name["clip02_libri_1272-128104-0000.wav"]
    result = asr.transcribe_offline(_audio(clip))
    assert wer([clip.text or ""], [" ".join(w.text for w in result.words)]) <= 0.1


@pytest.mark.parametrize("kind", ["silence", "white noise"])
def test_a_pass_over_no_speech_yields_no_words(engines, kind: str) -> None:
    asr = engines.asr
    n = 3 * 16000
    audio = np.zeros(n, np.float32) if kind == "silence" else np.random.default_rng(3).normal(0, 0.03, n)
    assert asr.transcribe(audio.astype(np.float32), "").words == []


def test_the_prompt_is_cut_to_its_last_whole_words(engines) -> None:
    asr = engines.asr
    text = (
        "If the reader will excuse me, I will say nothing of my antecedents, nor of the circumstances which led"
        " me to leave my native country. The narrative would be tedious to him and painful to myself."
    )
    tokens = asr._clip_prompt(text)
    assert 0 < len(tokens) <= asr._config.prompt_max_tokens
    kept = asr._tokenizer.decode(tokens).strip()
    assert kept != text and text.endswith(" " + kept)  # the newest whole words, none cut in half
    assert asr._clip_prompt("") == []


def test_a_window_the_prompt_would_leave_unread_is_decoded_without_it(engines, clip_by_name: dict[str, Clip]) -> None:
    # Measured in the voice loop: clip06's "... frequent formal review of activities they're under" from the
    # 3.2 s of "frequent" on, with the words said before it as the prompt: Whisper ended at once, no word
    # at all (three passes running, and the final), and without the prompt it read every word.
    asr = engines.asr
    clip = clip_by_name["clip06_lj050-0131.wav"]
    window = _audio(clip)[43840:100032]
    words = [norm(w.text) for w in asr.transcribe(window, "unless a system is established. for the").words]
    assert "review of activities" in " ".join(words)


def test_a_preview_pass_encodes_a_shorter_input_and_reads_clear_speech_as_a_full_pass_does(
    engines, clip_by_name: dict[str, Clip], monkeypatch: pytest.MonkeyPatch
) -> None:
    asr = engines.asr
    encoded: list[int] = []
    encode = asr._model.encode
    monkeypatch.setattr(asr._model, "encode", lambda features: encoded.append(features.shape[-1]) or encode(features))
    clip = clip_by_name["clip02_libri_1272-128104-0000.wav"]  # 5.9 s
    audio = _audio(clip)
    full = [norm(w.text) for w in asr.transcribe(audio, "").words]
    preview = [norm(w.text) for w in asr.transcribe(audio, "", preview=True).words]
    short = [norm(w.text) for w in asr.transcribe(audio[:32000], "", preview=True).words]
    # Whisper's 30 s (3000 frames); twice the window; `asr.preview_encoder_s` (10 s) at least.
    assert encoded[0] == 3000 and encoded[2] == 1000
    assert encoded[1] == pytest.approx(2 * 100 * len(audio) / 16000, abs=2)
    assert preview == full
    assert short and " ".join(short) in " ".join(full)


def test_the_packaged_whisper_base_is_a_config_choice(
    clip_by_name: dict[str, Clip], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from duplexd.asr.engine import FasterWhisperEngine, resolve_asr_model
    from duplexd.config import AsrConfig

    monkeypatch.setenv("DUPLEXD_MODEL_CACHE", str(tmp_path))
    folder = resolve_asr_model("base")  # joined from its two wheels into the model cache, once
    assert folder.startswith(str(tmp_path)) and resolve_asr_model("base") == folder
    engine = FasterWhisperEngine(AsrConfig(model="base"))
    assert engine.name.startswith("whisper-base") and engine._model.model.is_multilingual
    clip = clip_by_name["clip02_libri_1272-128104-0000.wav"]
    result = engine.transcribe(_audio(clip), "")
    assert wer([clip.text or ""], [" ".join(w.text for w in result.words)]) <= 0.1
