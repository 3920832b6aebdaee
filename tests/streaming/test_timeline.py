"""A turn's latency breakdown from literal times."""

from __future__ import annotations

import pytest

from duplexd.streaming.timeline import Timeline


def test_a_turn_s_parts_add_up_to_voice_to_voice() -> None:
    timeline = Timeline()
    timeline.turn_ended(4, "what is the capital of france", eos_at=10.0, now=10.8)
    timeline.reply_started(4)
    assert timeline.audio(4, now=10.85) is None  # no token yet: not a reply's audio
    timeline.token(4, "Paris", now=10.9)
    timeline.token(4, " is", now=10.95)
    timing = timeline.audio(4, now=11.2)
    assert timing is not None and timeline.audio(4, now=11.3) is None  # reported once
    assert timing.turn_detection_s == pytest.approx(0.8)
    assert timing.first_token_s == pytest.approx(0.1)
    assert timing.first_audio_s == pytest.approx(0.3)
    assert timing.voice_to_voice_s == pytest.approx(1.2)
    ended = timeline.reply_ended(4, "Paris is the capital of France.")
    assert ended is timing and timeline.reply_ended(4) is None  # logged once
    line = ended.summary()
    assert "'what is the capital of france' -> 'Paris is the capital of France.'" in line
    assert "turn ended 0.80s -> first token 0.10s -> first audio 0.30s (voice to voice 1.20s)" in line
    assert ended.fields()["voice_to_voice_s"] == 1.2


def test_an_interrupted_reply_keeps_what_was_generated_and_unknown_parts_show_as_dashes() -> None:
    timeline = Timeline()
    timeline.turn_ended(1, "tell me a story", eos_at=5.0, now=5.5)
    timeline.reply_started(1)
    timeline.token(1, "Once", now=5.6)
    timing = timeline.reply_ended(1)  # interrupted before any audio
    assert timing is not None and timing.reply_text == "Once"
    assert timing.first_audio_s is None and timing.voice_to_voice_s is None
    assert "first audio - (voice to voice -)" in timing.summary()


def test_events_of_another_reply_or_an_unanswered_turn_are_ignored() -> None:
    timeline = Timeline()
    timeline.turn_ended(1, "hello", eos_at=1.0, now=1.5)
    timeline.token(7, "stale", now=1.6)  # a reply that is not this turn's
    timeline.turn_ended(2, "hello again", eos_at=3.0, now=3.4)  # turn 1 got no reply: replaced
    timeline.reply_started(2)
    timeline.token(2, "Hi", now=3.5)
    timing = timeline.audio(2, now=3.6)
    assert timing is not None and timing.turn == 2 and timing.reply_text == "Hi"
    assert timing.turn_detection_s == pytest.approx(0.4)
    assert timeline.reply_ended(7) is None


def test_long_texts_are_cut_in_the_log_line() -> None:
    timeline = Timeline()
    timeline.turn_ended(1, " ".join(f"w{i}" for i in range(30)), eos_at=0.0, now=1.0)
    timeline.reply_started(1)
    timing = timeline.reply_ended(1, "ok")
    assert timing is not None and "w11 ...'" in timing.summary() and "w12" not in timing.summary()
