"""The endpointer: how long a silence ends the turn, by how complete the LLM finds the words."""

from __future__ import annotations

import pytest

from duplexd.asr.endpoint import Endpointer
from duplexd.config import TurnConfig

CFG = TurnConfig(min_silence_ms=250, max_silence_ms=1200, p_complete=0.02, p_incomplete=0.001)
END = Endpointer(CFG)


def test_silence_needed_spans_the_bounds() -> None:
    assert END.silence_needed_ms(0.6, "Can you tell me a joke?") == 250
    assert END.silence_needed_ms(1e-6, "I want to go to the") == 1200
    assert END.silence_needed_ms(None, "anything") == 1200  # unknown: wait as for an unfinished sentence
    mid = END.silence_needed_ms(0.0045, "Hello.")
    assert 250 < mid < 1200


def test_silence_needed_falls_as_completeness_rises() -> None:
    ps = [1e-5, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 0.5]
    needed = [END.silence_needed_ms(p, "x.") for p in ps]
    assert needed == sorted(needed, reverse=True)


@pytest.mark.parametrize("text", ["so I went to...", "and then,", "well…", "the thing is -"])
def test_trailing_off_is_unfinished_whatever_the_llm_says(text: str) -> None:
    assert END.silence_needed_ms(0.9, text) == 1200


def test_turn_over_needs_words_a_settled_transcript_and_the_silence() -> None:
    ok = {"silence_ms": 300.0, "text_final": True, "text": "What time is it?", "p_end": 0.5}
    assert END.turn_over(**ok)
    assert not END.turn_over(**{**ok, "text_final": False})
    assert not END.turn_over(**{**ok, "text": " "})
    assert not END.turn_over(**{**ok, "silence_ms": 200.0})
    assert not END.turn_over(**{**ok, "p_end": 1e-5})  # mid-sentence pause
    assert END.turn_over(**{**ok, "p_end": 1e-5, "silence_ms": 1200.0})


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_silence_ms"):
        TurnConfig(min_silence_ms=500, max_silence_ms=400)
    with pytest.raises(ValueError, match="p_complete"):
        TurnConfig(p_complete=0.001, p_incomplete=0.01)


def test_speech_that_sounds_mid_phrase_waits_the_longest_whatever_the_text() -> None:
    """The acoustic model's P(turn over) below `audio_incomplete`: the turn waits max_silence_ms even for
    text the LLM finds complete (Whisper punctuated a mid-sentence pause); above it, the text decides."""
    assert END.silence_needed_ms(0.6, "The birch canoe slid on the.", p_audio=0.05) == 1200
    assert END.silence_needed_ms(0.6, "Can you tell me a joke?", p_audio=0.9) == 250
    assert END.silence_needed_ms(1e-6, "I want to go to the", p_audio=0.9) == 1200
    ok = {"silence_ms": 900.0, "text_final": True, "text": "The birch canoe slid on the.", "p_end": 0.5}
    assert END.turn_over(**ok) and not END.turn_over(**ok, p_audio=0.1)


def test_with_the_text_unscored_audio_that_sounds_finished_ends_the_turn_as_a_complete_sentence_does() -> None:
    """A remote LLM gives no P(end of turn): the acoustic model's answer is the turn signal. Finished-sounding
    speech waits min_silence_ms; mid-phrase, trailing text, or no acoustic answer yet waits max_silence_ms."""
    unscored = {"text_scored": False}
    assert END.silence_needed_ms(None, "Can you tell me a joke?", p_audio=0.9, **unscored) == 250
    assert END.silence_needed_ms(None, "Can you tell me a joke?", p_audio=0.2, **unscored) == 1200
    assert END.silence_needed_ms(None, "So I went to the...", p_audio=0.9, **unscored) == 1200
    assert END.silence_needed_ms(None, "Can you tell me a joke?", **unscored) == 1200
    # a P(end of turn) still to come (the local LLM, busy): the audio alone does not end the turn
    assert END.silence_needed_ms(None, "Can you tell me a joke?", p_audio=0.9) == 1200
    ok = {"silence_ms": 300.0, "text_final": True, "text": "Can you tell me a joke?", "p_end": None, "p_audio": 0.9}
    assert END.turn_over(**ok, text_scored=False) and not END.turn_over(**ok)


def test_speech_that_sounds_only_half_finished_lengthens_the_wait_and_the_longer_wait_wins() -> None:
    """Between `audio_incomplete` (0.5) and `audio_complete` (0.9) the audio's wait falls linearly from
    max_silence_ms to min_silence_ms; with the text's wait known, the turn waits the longer of the two."""
    sure = "Can you tell me a joke?"
    assert END.silence_needed_ms(0.6, sure, p_audio=0.53) == pytest.approx(1200 - 0.075 * 950)
    assert END.silence_needed_ms(0.6, sure, p_audio=0.7) == pytest.approx(725)
    assert END.silence_needed_ms(0.003, sure, p_audio=0.7) == END.silence_needed_ms(0.003, sure) > 800  # text longer
    assert END.silence_needed_ms(0.6, sure, p_audio=0.99) == 250
    assert END.silence_needed_ms(None, sure, p_audio=0.7, text_scored=False) == pytest.approx(725)
    assert END.silence_needed_ms(0.0, sure) == 1200  # (a probability that underflowed to 0: unfinished)
    with pytest.raises(ValueError, match="audio_complete"):
        TurnConfig(audio_incomplete=0.6, audio_complete=0.5)
