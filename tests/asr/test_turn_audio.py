"""The acoustic end-of-turn model (Smart Turn v3, from the pipecat-ai wheel) on real speech."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.asr import turn_audio
from duplexd.bench import scenarios as sc
from duplexd.clients.clips import Clip

needs_model = pytest.mark.skipif(
    turn_audio.smart_turn_path() is None, reason="Smart Turn v3 ships in pipecat-ai: pip install 'duplexd[smart-turn]'"
)


@pytest.fixture(scope="module")
def model() -> turn_audio.TurnAudioModel:
    path = turn_audio.smart_turn_path()
    assert path is not None
    return turn_audio.TurnAudioModel(path)


def audio_of(clip: Clip) -> np.ndarray:
    return sc.load(clip.path).astype(np.float32) / 32768.0


@needs_model
def test_the_input_is_the_spectrogram_the_model_was_trained_on(clip_by_name: dict[str, Clip]) -> None:
    """Whisper's log-mel of the normalized last 8 s, as pipecat computes it for this model."""
    from pipecat.audio.turn.smart_turn._whisper_features import compute_whisper_log_mel_features

    audio = audio_of(clip_by_name[sc.PAUSE_CLIP])
    padded = np.pad(audio, (turn_audio.WINDOW_S * 16_000 - len(audio), 0))
    reference = compute_whisper_log_mel_features(padded, do_normalize=True)
    ours = turn_audio.log_mel(audio)
    assert ours.shape == reference.shape == (80, 800)
    assert np.abs(ours - reference).max() < 1e-4


@needs_model
@pytest.mark.parametrize("name", [sc.PAUSE_CLIP, "clip12_sb_spk1_snt4.wav", "clip14_sb_spk2_snt2.wav"])
def test_a_finished_sentence_sounds_finished_and_a_mid_sentence_stop_does_not(
    model: turn_audio.TurnAudioModel, clip_by_name: dict[str, Clip], name: str
) -> None:
    speech = sc.load(clip_by_name[name].path)
    x = speech.astype(np.float32) / 32768.0
    d = len(speech) / sc.RATE
    end = sc.speech_end_s(speech)
    cut = sc.quietest_cut(speech, 0.4 * d, 0.6 * d)  # where bench voice inserts its mid-sentence pauses
    pause = int(0.2 * sc.RATE)  # the model hears the 200 ms of the pause (turn.pause_ms) too
    finished = model.probability(np.concatenate([x[: int(end * sc.RATE)], np.zeros(pause, np.float32)]))
    stopped = model.probability(np.concatenate([x[:cut], np.zeros(pause, np.float32)]))
    assert finished > 0.5 > stopped, (finished, stopped)


def test_auto_uses_the_model_only_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turn_audio, "smart_turn_path", lambda: None)
    assert turn_audio.resolve_turn_audio("auto") is None and turn_audio.load_turn_audio("off") is None
    with pytest.raises(turn_audio.TurnAudioUnavailable, match=r"pip install 'duplexd\[smart-turn\]'"):
        turn_audio.resolve_turn_audio("smart-turn")
