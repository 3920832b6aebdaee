"""Speech over a playing reply pauses it at once; words interrupt it, or it resumes (the conversation is pure)."""

from __future__ import annotations

from duplexd import commands as cmd
from duplexd.config import TtsConfig, TurnConfig
from duplexd.events import ReplyInterrupted, ReplyPaused, ReplyResumed, TranscriptUpdated, UtteranceFinalized
from duplexd.streaming import conversation as cv
from tests.streaming.test_conversation import SR, of, say, start_reply, stream_reply, voice_all, words

TEXT = "Paris is the capital of France. It is a big city."


def playing(**turn: int) -> tuple[cv.Conversation, int]:
    """A conversation whose reply (3 s of audio) is 1.5 s into playing."""
    conv = cv.Conversation(TurnConfig(min_silence_ms=250, **turn), TtsConfig(first_words=3))
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, TEXT))
    conv.played(int(1.5 * SR))
    return conv, reply


def tick(conv: cv.Conversation, t: float, *, voiced_ms: float = 0, silence_ms: float = 0, settled: bool = True):
    return conv.tick(stream_s=t, silence_ms=silence_ms, asr_settled=settled, voiced_ms=voiced_ms)


def test_speech_pauses_the_reply_before_any_word() -> None:
    conv, reply = playing()
    assert tick(conv, 10.0, voiced_ms=96) == []  # shorter than pause_on_speech_ms (128)
    out = tick(conv, 10.04, voiced_ms=128)
    assert of(out, cmd.PauseAudio) == [cmd.PauseAudio(reply)]
    (paused,) = of(out, ReplyPaused)
    assert paused.reply == reply and paused.played_ms == 1500
    assert tick(conv, 10.1, voiced_ms=200) == []  # once


def test_words_confirm_the_pause_as_an_interruption() -> None:
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    conv.played(int(1.6 * SR))  # the client stopped a little after the server said so
    out = conv.observe([TranscriptUpdated(2, words("wait no"), 2)])
    (told,) = of(out, ReplyInterrupted)
    assert told.reason == "barge_in" and told.heard_ms == 1600
    assert of(out, cmd.StopAudio) == [cmd.StopAudio(reply)]
    assert not conv.replying


def test_a_cough_resumes_the_reply_once_the_user_is_quiet() -> None:
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    assert tick(conv, 10.5, silence_ms=100) == []  # the cough is over, not yet quiet for long
    out = tick(conv, 10.8, silence_ms=400, settled=False)  # (a word the recognizer finds later still interrupts)
    assert of(out, cmd.ResumeAudio) == [cmd.ResumeAudio(reply)]
    (resumed,) = of(out, ReplyResumed)
    assert abs(resumed.paused_ms - 800) < 1e-6
    assert conv.replying
    out = conv.observe([TranscriptUpdated(2, words("no wait"), 2)])
    assert of(out, ReplyInterrupted)


def test_a_backchannel_or_the_echo_resumes_it_but_one_real_word_waits_for_quiet() -> None:
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=160)
    assert conv.observe([UtteranceFinalized(2, words("mm-hmm okay"))]) == []
    assert conv.observe([UtteranceFinalized(3, words("capital of France"))]) == []  # its own voice
    assert of(tick(conv, 11.0, silence_ms=400), ReplyResumed)  # (its sound ended 600 ms after the pause)
    tick(conv, 11.9, silence_ms=1000)
    assert of(tick(conv, 12.0, voiced_ms=160), ReplyPaused)  # the user again
    conv.observe([TranscriptUpdated(4, words("hold"), 0)])
    assert tick(conv, 15.0, voiced_ms=500) == []  # a word of theirs: no timeout while they talk
    assert of(tick(conv, 15.7, silence_ms=600), ReplyResumed)  # one word does not interrupt (barge_in_words 2)


def test_noise_that_goes_on_resumes_after_the_timeout_and_does_not_pause_again() -> None:
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    assert tick(conv, 12.0, voiced_ms=2128) == []
    out = tick(conv, 12.5, voiced_ms=2628)  # resume_timeout_ms: 2500
    assert of(out, ReplyResumed)
    assert tick(conv, 12.6, voiced_ms=2728) == []  # the same run of sound does not pause it again
    tick(conv, 12.7, silence_ms=32)
    assert of(tick(conv, 13.0, voiced_ms=128), cmd.PauseAudio)  # a new one does


def test_no_pause_before_the_audio_plays_after_it_or_when_off() -> None:
    conv = cv.Conversation(TurnConfig(min_silence_ms=250), TtsConfig(first_words=3))
    reply = start_reply(conv)
    out = stream_reply(conv, reply, TEXT)
    assert tick(conv, 6.0, voiced_ms=500) == []  # no audio yet: nothing to pause (words still interrupt)
    voice_all(conv, reply, out)
    conv.audio_sent(reply)
    conv.played(3 * SR - 1)
    tick(conv, 7.0)
    assert of(tick(conv, 7.2, voiced_ms=128), cmd.PauseAudio)
    conv, reply = playing(pause_on_speech_ms=0)
    assert tick(conv, 10.0, voiced_ms=1000) == []
    conv, reply = playing()
    conv.barge_in = False  # (a Realtime session whose client interrupts for itself)
    assert tick(conv, 10.0, voiced_ms=1000) == []


def test_a_paused_reply_does_not_end_until_it_has_played() -> None:
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    conv.audio_sent(reply)
    assert conv.replying
    out = tick(conv, 11.0, silence_ms=700)
    assert of(out, ReplyResumed)
    conv.played(3 * SR)
    assert not conv.replying


def test_sound_that_stops_with_the_playback_is_echo_like_and_stops_the_pausing() -> None:
    """The reply's own echo ends as soon as its playback pauses (a user's talking does not): after one such
    pause VAD no longer pauses that reply, after two none of the session's (words still interrupt)."""
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    assert of(tick(conv, 10.5, silence_ms=400), ReplyResumed)  # the sound ended 100 ms after the pause
    tick(conv, 10.6, silence_ms=500)
    assert tick(conv, 11.0, voiced_ms=128) == []  # not this reply again
    assert conv.pauses_on_speech
    conv.audio_sent(reply)
    conv.played(3 * SR)
    assert not conv.replying
    say(conv, 5, "And Germany?")
    (turn,) = of(conv.tick(stream_s=15.0, silence_ms=400, asr_settled=True), cv.TurnEnded)
    reply = turn.turn
    voice_all(conv, reply, stream_reply(conv, reply, TEXT))
    conv.played(4 * SR)
    assert of(tick(conv, 20.0, voiced_ms=128), ReplyPaused)  # the next reply does pause
    assert of(tick(conv, 20.45, silence_ms=400), ReplyResumed)
    assert not conv.pauses_on_speech  # a second echo-like pause: VAD alone pauses no more replies
    tick(conv, 21.0, silence_ms=700)
    assert tick(conv, 21.2, voiced_ms=500) == []


def test_a_user_who_keeps_talking_is_not_echo_like() -> None:
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    conv.observe([TranscriptUpdated(2, words("hold"), 0)])  # one word: it does not interrupt
    assert of(tick(conv, 11.6, silence_ms=400), ReplyResumed)  # talked 1.2 s past the pause
    tick(conv, 12.0, silence_ms=800)
    assert of(tick(conv, 12.2, voiced_ms=128), ReplyPaused)  # it may pause again


def test_a_reply_that_had_played_out_when_it_paused_resumes_as_it_ends() -> None:
    """The pause reached a client that had already played the whole reply: its report ends the reply, and
    the pause with it (the playout and the client must not stay paused for the next reply)."""
    conv, reply = playing()
    conv.audio_sent(reply)
    assert of(tick(conv, 10.0, voiced_ms=128), cmd.PauseAudio)
    out = conv.played(3 * SR)
    assert of(out, cmd.ResumeAudio) == [cmd.ResumeAudio(reply)] and of(out, ReplyResumed)
    assert not conv.replying


def test_a_paused_reply_waits_for_committed_words_and_a_hallucination_only_holds_it() -> None:
    """Measured (bench voice, echo at -6 dB): Whisper made "it's a very good time to get" of the cut echo
    of "In 20...", and its seven words interrupted the paused reply; the next pass heard "in 20th,". Paused,
    the reply is silent already: a hypothesis holds it (no resume while it lasts), committed words confirm."""
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    assert conv.observe([TranscriptUpdated(2, words("it's a very good time to get"), 0)]) == []
    assert tick(conv, 10.8, silence_ms=400) == []  # quiet, but seven words of hypothesis: held
    assert conv.observe([TranscriptUpdated(2, words("in 20th,"), 0)]) == []
    assert of(tick(conv, 10.9, silence_ms=500), cmd.ResumeAudio) == [cmd.ResumeAudio(reply)]
    # Playing where speech does not pause it, the same hypothesis interrupts (three words are enough).
    conv, reply = playing(pause_on_speech_ms=0)
    assert of(conv.observe([TranscriptUpdated(2, words("it's a very good time to get"), 0)]), ReplyInterrupted)
    # Paused, words that held over two passes confirm.
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    assert of(conv.observe([TranscriptUpdated(2, words("wait no stop"), 2)]), ReplyInterrupted)


def test_after_an_echo_like_pause_hypotheses_no_longer_interrupt_committed_words_do() -> None:
    """Measured (bench voice, echo at -6 dB): the reply resumed after an echo-like pause, and the next
    hypothesis of that echo ("In 1813, we are going to take a look") interrupted it."""
    conv, reply = playing()
    tick(conv, 10.0, voiced_ms=128)
    out = tick(conv, 10.6, silence_ms=400)  # the sound stopped 200 ms after the pause: echo-like
    assert of(out, cmd.ResumeAudio)
    assert conv.observe([TranscriptUpdated(2, words("In 1813, we are going to take a look"), 0)]) == []
    assert of(conv.observe([TranscriptUpdated(2, words("we are going to"), 3)]), ReplyInterrupted)
