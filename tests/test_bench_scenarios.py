"""The conversation scenarios `bench voice` composes: a mid-sentence pause is as long as it says, as VAD
hears it from the last word to the next."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from duplexd.asr.vad import VAD_CHUNK_SAMPLES, SileroVad, VadStream
from duplexd.bench import scenarios as sc
from duplexd.bench.voice import ECHO_GAINS, Run, _pausable, _questions, _rate, echo_rooms_for, sentence_ends_inside
from duplexd.clients.clips import Clip, silence_around
from duplexd.clients.converse import answered_after, listening_after
from duplexd.clients.stream import Received

LEAD_S = 0.5  # (what bench voice sends before each clip)


def _silence_at(audio: np.ndarray, t_s: float) -> tuple[float, float]:
    """The run of 32 ms chunks Silero VAD does not call speech around `t_s` (its length, and where it
    ends): computed here chunk by chunk, not by the code under test."""
    k = len(audio) // VAD_CHUNK_SAMPLES
    chunks = (audio[: k * VAD_CHUNK_SAMPLES].astype(np.float32) / 32768).reshape(k, -1)
    (probs,) = SileroVad().probabilities([VadStream()], [chunks])
    chunk_s = VAD_CHUNK_SAMPLES / sc.RATE
    lo = hi = int(t_s / chunk_s)
    assert probs[lo] < 0.5
    while lo > 0 and probs[lo - 1] < 0.5:
        lo -= 1
    while hi < k and probs[hi] < 0.5:
        hi += 1
    return (hi - lo) * chunk_s, hi * chunk_s


def test_silence_around_a_point_in_speech_is_none_and_in_a_gap_is_the_gap(clip_by_name: dict[str, Clip]) -> None:
    speech = sc.load(clip_by_name[sc.PAUSE_CLIP].path)
    word = round(1.0 * sc.RATE)  # ("The birch canoe ...": in a word)
    assert silence_around(speech, word) == (0.0, 0.0)
    gapped = np.concatenate([speech[:word], sc.silence(0.7), speech[word:]])
    before, after = silence_around(gapped, word + round(0.2 * sc.RATE))
    assert before + after == pytest.approx(0.7, abs=0.1)
    assert before == pytest.approx(0.2, abs=0.07)


def test_a_clip_whose_speech_is_over_by_its_middle_has_no_mid_sentence_point(clips: list[Clip]) -> None:
    pausable = [c.path.name for c, _ in _pausable(_questions(clips, quick=False))]
    assert "clip19_fw_stereo_right.wav" not in pausable  # ("The horizon seems extremely distant." then silence)
    assert sc.PAUSE_CLIP in pausable and "clip02_libri_1272-128104-0000.wav" in pausable
    assert len(pausable) >= 12


def test_a_pause_is_heard_as_long_as_asked_where_the_cut_falls_in_a_gap_of_its_own(clips: list[Clip]) -> None:
    # clip06's quietest point mid-sentence is a 0.25 s gap between two words: a 1.0 s pause inserted
    # there was heard as 1.25 s (longer than `turn.max_silence_ms`); clip22's "home" after it starts softly.
    for clip, speech in _pausable(_questions(clips, quick=False)):
        d = len(speech) / sc.RATE
        paused, resumes_s = sc.with_pause(speech, 0.4 * d, 0.6 * d, 1.0, lead_s=LEAD_S)
        inside_s = LEAD_S + sc.quietest_cut(speech, 0.4 * d, 0.6 * d) / sc.RATE + 0.3  # (in the pause)
        heard_s, ends_s = _silence_at(np.concatenate([sc.silence(LEAD_S), paused]), inside_s)
        assert heard_s == pytest.approx(1.0, abs=0.07), clip.path.name
        assert LEAD_S + resumes_s == pytest.approx(ends_s, abs=0.04), clip.path.name


def test_sound_over_a_reply_that_ends_a_turn_of_its_own_is_a_false_barge_in() -> None:
    """Measured (bench voice, clip09's echo through a room): the echo of the reply's last words, heard after
    it had played out, was a second turn, answered by the assistant; the reply was never interrupted, so
    the rate counted it as no false barge-in. A talk-over's turn of its own is the user's, as it should."""

    def run(scenario: str, turns: int, interrupted: bool) -> Run:
        return Run(scenario, "clip09", 3.4, turns, False, interrupted, 0.8, 0.8, 0.9, "reply", 12.0)

    echo = [run("echo", 1, False), run("echo", 2, False), run("echo", 1, True), run("echo", 1, False)]
    assert _rate(echo, "echo") == 0.5
    assert _rate([run("noise", 2, False)], "noise") == 1.0
    assert _rate([run("talk_over", 2, False), run("talk_over", 2, True)], "talk_over") == 0.5


@pytest.mark.parametrize(
    ("text", "reference", "ends"),
    [
        ("The child almost hurt. The small dog.", "THE CHILD ALMOST HURT THE SMALL DOG", 1),
        ("The child almost hurt the small dog.", "THE CHILD ALMOST HURT THE SMALL DOG", 0),
        ("Mr. Quilter is the apostle. And we are glad.", "Mr. Quilter is the apostle and we are glad", 1),
        ("8. The Press Yard", "8. The Press Yard", 0),  # (the reference's own)
        ("", "WHAT JOY THERE IS IN LIVING", 0),
    ],
)
def test_sentence_ends_inside_a_turn_said_with_a_pause_are_those_the_reference_lacks(
    text: str, reference: str, ends: int
) -> None:
    assert sentence_ends_inside(text, reference) == ends


def test_more_echo_rooms_than_clips_take_the_clips_in_turn() -> None:
    """`bench voice --echo-rooms N`: one false barge-in in the default 10 echo conversations is 10 %; N rooms
    at each level, the clips in turn, measure closer to the issue's 2 %. The default is one room per clip."""
    clips = [Clip(Path(f"clip{i}.wav"), 1.0, "", 1) for i in range(5)]
    default = echo_rooms_for(clips)
    assert [c for c, _ in default] == clips * len(ECHO_GAINS)
    assert sorted({spec.gain for _, spec in default}) == sorted(ECHO_GAINS)
    many = echo_rooms_for(clips, 12)
    assert len(many) == 12 * len(ECHO_GAINS)
    assert [c for c, _ in many[:12]] == (clips * 3)[:12]
    assert len({spec.name for _, spec in many}) > len({spec.name for _, spec in default})
    rt60 = sorted(spec.rt60_s for _, spec in many[:12])
    assert rt60[0] < 0.25 and rt60[-1] > 0.55  # (spread over the same 0.2-0.6 s)


def test_listening_after_the_replies_waits_for_them_all_and_then_for_the_time_given() -> None:
    now = time.monotonic()
    until = listening_after(3.5)
    started, done = Received(now - 9, {"type": "reply.started"}), Received(now - 4, {"type": "reply.done"})
    assert until([started, done])
    assert not until([started, Received(now - 1, {"type": "reply.done"})])  # (ended 1 s ago: listen on)
    assert not until([started, done, Received(now - 2, {"type": "reply.started"})])  # (the echo's own turn)
    assert not until([])


def test_after_a_turn_that_ended_too_soon_the_rest_of_the_question_is_waited_for() -> None:
    now = time.monotonic()
    t0 = Received(now - 10, {"type": "session.started"})
    until = answered_after(speech_end_s=6.0, give_up_s=6.0)  # (the speech ended 4 s ago)
    early, cut = Received(now - 6, {"type": "reply.started"}), Received(now - 5, {"type": "reply.interrupted"})
    assert not until([t0, early, cut])  # (its reply began during the speech: the rest's turn is to come)
    late, done = Received(now - 3, {"type": "reply.started"}), Received(now - 1, {"type": "reply.done"})
    assert not until([t0, early, cut, late])  # (that reply still plays)
    assert until([t0, early, cut, late, done])
    assert until([Received(now - 13, {"type": "session.started"}), early, cut])  # (6 s after the speech: no more)
