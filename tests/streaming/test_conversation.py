"""The conversation core, driven by scripted recognizer, LLM, TTS and playback reports (it is pure)."""

from __future__ import annotations

import numpy as np

from duplexd import commands as cmd
from duplexd.config import TtsConfig, TurnConfig
from duplexd.events import (
    ReplyDelta,
    ReplyDone,
    ReplyInterrupted,
    ReplyStarted,
    TranscriptUpdated,
    TurnContinued,
    TurnEnded,
    UtteranceFinalized,
    Word,
)
from duplexd.streaming import conversation as cv
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

SR = OUTPUT_SAMPLE_RATE


def words(text: str, start: float = 0.0) -> tuple[Word, ...]:
    return tuple(Word(w, start + 0.3 * i, start + 0.3 * i + 0.25) for i, w in enumerate(text.split()))


def of(outputs: list[cv.Output], kind: type) -> list:
    return [o for o in outputs if isinstance(o, kind)]


def new() -> cv.Conversation:
    return cv.Conversation(TurnConfig(min_silence_ms=250), TtsConfig(first_words=3))


def unpaused() -> cv.Conversation:
    """A conversation where speech does not pause the reply: words alone interrupt it, hypotheses too."""
    return cv.Conversation(TurnConfig(min_silence_ms=250, pause_on_speech_ms=0), TtsConfig(first_words=3))


def say(conv: cv.Conversation, utt: int, text: str, *, p_end: float = 0.5) -> list[cv.Output]:
    """The user says `text` as utterance `utt`: a partial with two committed words, then the final."""
    w = words(text)
    out = conv.observe([TranscriptUpdated(utt, w, min(2, len(w)))])
    out += conv.observe([UtteranceFinalized(utt, w)])
    appends = of(out, cmd.AppendUserText)
    if appends:
        conv.p_end_of_turn(p_end, appends[-1].version)
    return out


def start_reply(conv: cv.Conversation, text: str = "What is the capital of France?") -> int:
    say(conv, 1, text)
    out = conv.tick(stream_s=5.0, silence_ms=400, asr_settled=True)
    (turn,) = of(out, TurnEnded)
    return turn.turn


def stream_reply(conv: cv.Conversation, reply: int, text: str) -> list[cv.Output]:
    """The LLM produces `text` one word-token at a time, then ends."""
    out: list[cv.Output] = []
    toks = text.split(" ")
    for i in range(len(toks)):
        out += conv.reply_text(reply, [" ".join(toks[: i + 1])], done=False)
    return out + conv.reply_text(reply, [], done=True)


def voice_all(conv: cv.Conversation, reply: int, outputs: list[cv.Output], seconds_per_piece: float = 1.0):
    """TTS every Synthesize command (1 s of audio each); returns the PlayAudio/EndAudio outputs."""
    out: list[cv.Output] = []
    for s in of(outputs, cmd.Synthesize):
        out += conv.audio_ready(reply, s.index, np.full(int(seconds_per_piece * SR), 0.1, np.float32))
    return out


def assert_said_again(
    conv: cv.Conversation, out: list[cv.Output], before: cmd.AppendUserText, retracted: tuple[str, ...], said: str
) -> None:
    """`out` takes back exactly the appends `retracted`, then says `said` as one append, versions in order
    after `before` (the last append sent); P(end of turn) is then given for it."""
    assert [type(o) for o in out] == [cmd.RetractUserText, cmd.AppendUserText]
    retract, append = out
    assert retract.texts == retracted and append.text == said
    assert before.version < retract.version < append.version
    conv.p_end_of_turn(0.9, append.version)


def turn_text(conv: cv.Conversation) -> str:
    """The text of the turn that ends now (the recognizer settled, a long silence)."""
    (turn,) = of(conv.tick(stream_s=5.0, silence_ms=400, asr_settled=True), TurnEnded)
    return turn.text


def test_committed_words_stream_into_the_llm_as_they_commit() -> None:
    conv = new()
    out = conv.observe([TranscriptUpdated(1, words("what is the"), 1)])
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["what"]
    out = conv.observe([TranscriptUpdated(1, words("what is the time"), 3)])
    assert [a.text for a in of(out, cmd.AppendUserText)] == [" is the"]
    out = conv.observe([UtteranceFinalized(1, words("what is the time now"))])
    assert [a.text for a in of(out, cmd.AppendUserText)] == [" time now"]
    out = conv.observe([UtteranceFinalized(2, words("please"))])
    assert [a.text for a in of(out, cmd.AppendUserText)] == [" please"]  # same turn, next utterance


def test_a_final_that_decided_sent_words_again_takes_them_back_from_the_llm() -> None:
    """`asr.final_redecode`: the final pass heard the utterance whole and changed words already committed
    (and sent): their appends are taken back, exactly as sent, and the final's words replace them; the turn
    is what the final says. Words of an earlier utterance stay."""
    conv = new()
    conv.observe([UtteranceFinalized(1, words("please"))])
    first = of(conv.observe([TranscriptUpdated(2, words("men the", 1.0), 1)]), cmd.AppendUserText)
    first += of(conv.observe([TranscriptUpdated(2, words("men the coat", 1.0), 2)]), cmd.AppendUserText)
    assert [a.text for a in first] == [" men", " the"]
    out = conv.observe([UtteranceFinalized(2, words("mend the coat before", 1.0))])
    assert_said_again(conv, out, first[-1], (" men", " the"), " mend the coat before")
    assert turn_text(conv) == "please mend the coat before"


def test_a_final_that_only_adds_words_takes_nothing_back() -> None:
    conv = new()
    conv.observe([TranscriptUpdated(1, words("what is the"), 2)])
    out = conv.observe([UtteranceFinalized(1, words("what is the time"))])
    assert of(out, cmd.RetractUserText) == [] and [a.text for a in of(out, cmd.AppendUserText)] == [" the time"]


def test_words_the_client_has_not_committed_are_corrected_before_they_reach_the_llm() -> None:
    """With `auto_turns` off, appends wait for the client's commit: a final that decided them again
    replaces them there, and only the final's words reach the LLM."""
    conv = new()
    conv.auto_turns = False
    assert conv.observe([TranscriptUpdated(1, words("men the coat"), 2)]) == []
    out = conv.observe([UtteranceFinalized(1, words("mend the coat"))])
    assert of(out, cmd.RetractUserText) == [] and of(out, cmd.AppendUserText) == []
    out = conv.commit(3.0)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["mend the coat"]
    assert of(out, TurnEnded)[0].text == "mend the coat"


def _split_at_a_pause(conv: cv.Conversation) -> list[cmd.AppendUserText]:
    """ "I said Sunday is the best." finalized at a pause, then the speaker goes on: "part" committed."""
    sent = of(conv.observe([UtteranceFinalized(1, words("I said Sunday is the best."))]), cmd.AppendUserText)
    sent += of(conv.observe([TranscriptUpdated(2, words("part of", 2.0), 1)]), cmd.AppendUserText)
    assert [a.text for a in sent] == ["I said Sunday is the best.", " part"]
    return sent


def test_a_continuation_rejoins_the_sentence_it_continues_in_the_llm_and_the_turn() -> None:
    """The speaker went on after a pause that finalized "... best.": the continuation's final reads the join
    ("best." -> "best"); the utterance before's last append and the continuation's are taken back, exactly
    as sent, and the sentence goes to the LLM again as one; the turn reads as one sentence."""
    conv = new()
    sent = _split_at_a_pause(conv)
    joined = words("I said Sunday is the best")
    final = UtteranceFinalized(2, words("part of the week.", 2.0), continues=1, previous=joined)
    out = conv.observe([final])
    said = "I said Sunday is the best part of the week."
    assert_said_again(conv, out, sent[-1], ("I said Sunday is the best.", " part"), said)
    assert turn_text(conv) == said


def test_a_continuation_whose_join_changed_nothing_only_adds_its_words() -> None:
    conv = new()
    _split_at_a_pause(conv)
    out = conv.observe([UtteranceFinalized(2, words("part of the week.", 2.0), continues=1, previous=None)])
    assert of(out, cmd.RetractUserText) == [] and [a.text for a in of(out, cmd.AppendUserText)] == [" of the week."]


def test_a_continuation_is_not_rejoined_across_a_typed_message() -> None:
    conv = new()
    conv.observe([UtteranceFinalized(1, words("I said Sunday is the best."))])
    conv.user_text("really")
    final = UtteranceFinalized(2, words("part of it.", 2.0), continues=1, previous=words("I said Sunday is the best"))
    out = conv.observe([final])
    assert of(out, cmd.RetractUserText) == [] and [a.text for a in of(out, cmd.AppendUserText)] == [" part of it."]


def test_a_rejoined_sentence_waits_for_the_clients_commit_as_one() -> None:
    conv = new()
    conv.auto_turns = False
    conv.observe([UtteranceFinalized(1, words("I said Sunday is the best."))])
    conv.observe([TranscriptUpdated(2, words("part of", 2.0), 1)])
    final = UtteranceFinalized(2, words("part of it.", 2.0), continues=1, previous=words("I said Sunday is the best"))
    assert conv.observe([final]) == []
    out = conv.commit(4.0)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["I said Sunday is the best part of it."]
    assert of(out, TurnEnded)[0].text == "I said Sunday is the best part of it."


def test_turn_ends_after_short_silence_when_complete_long_when_not() -> None:
    conv = new()
    say(conv, 1, "I want to go to the", p_end=1e-6)
    assert conv.tick(stream_s=3.0, silence_ms=600, asr_settled=True) == []  # mid-sentence pause
    out = conv.tick(stream_s=3.6, silence_ms=1200, asr_settled=True)
    assert of(out, TurnEnded)[0].text == "I want to go to the"
    conv = new()
    say(conv, 1, "What time is it?", p_end=0.4)
    assert conv.tick(stream_s=2.0, silence_ms=200, asr_settled=True) == []
    assert conv.tick(stream_s=2.0, silence_ms=300, asr_settled=False) == []  # a pass still due
    out = conv.tick(stream_s=2.05, silence_ms=300, asr_settled=True)
    (turn,) = of(out, TurnEnded)
    assert turn.text == "What time is it?" and turn.p_end == 0.4 and abs(turn.eos_s - 1.75) < 1e-9
    assert of(out, cmd.StartReply) == [cmd.StartReply(1)] and of(out, ReplyStarted) == [ReplyStarted(1)]


def test_a_stale_p_end_is_ignored() -> None:
    conv = new()
    out = say(conv, 1, "What time is it?", p_end=0.4)
    version = of(out, cmd.AppendUserText)[-1].version
    conv.observe([UtteranceFinalized(2, words("in Paris"))])  # new words: the 0.4 was for older text
    conv.p_end_of_turn(0.5, version)
    assert conv.tick(stream_s=3.0, silence_ms=400, asr_settled=True) == []


def test_reply_streams_as_deltas_and_pieces_and_ends_after_playback() -> None:
    conv = new()
    reply = start_reply(conv)
    out = stream_reply(conv, reply, "Paris is the capital of France.")
    assert "".join(d.text for d in of(out, ReplyDelta)) == "Paris is the capital of France."
    assert [s.text for s in of(out, cmd.Synthesize)] == ["Paris is the", "capital of France."]
    audio = voice_all(conv, reply, out)
    assert len(of(audio, cmd.PlayAudio)) == 2 and of(audio, cmd.EndAudio) == [cmd.EndAudio(reply)]
    done = conv.audio_sent(reply)
    assert of(done, ReplyDone)[0].audio_ms == 2000
    assert conv.replying  # still audible
    conv.played(2 * SR)
    assert not conv.replying and conv.phase is cv.Phase.LISTENING


def test_pieces_are_played_in_order_whatever_order_tts_finishes() -> None:
    conv = new()
    reply = start_reply(conv)
    out = stream_reply(conv, reply, "Paris is the capital of France.")
    first, second = of(out, cmd.Synthesize)
    assert conv.audio_ready(reply, second.index, np.ones(10, np.float32)) == []
    played = conv.audio_ready(reply, first.index, np.ones(20, np.float32))
    assert [len(p.samples) for p in of(played, cmd.PlayAudio)] == [20, 10]


def test_barge_in_cuts_the_context_to_what_was_heard() -> None:
    conv = new()
    reply = start_reply(conv)
    out = stream_reply(conv, reply, "Paris is the capital of France. It is a big city.")
    voice_all(conv, reply, out)
    conv.played(int(1.5 * SR))  # all of "Paris is the" and half of "capital of France."
    assert conv.observe([TranscriptUpdated(2, words("wait"), 1)]) == []  # one word is a blip
    out = conv.observe([TranscriptUpdated(2, words("wait no"), 2)])
    (stop,) = of(out, cmd.InterruptReply)
    (told,) = of(out, ReplyInterrupted)
    assert told.heard_ms == 1500 and told.reason == "barge_in"
    assert told.heard_text == "Paris is the capital"  # cut back to a word boundary
    assert stop.heard_tokens == 4
    assert of(out, cmd.StopAudio) == [cmd.StopAudio(reply)]
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["wait no"]  # starts the user's next turn
    assert not conv.replying


def test_barge_in_before_any_audio_keeps_nothing() -> None:
    conv = new()
    reply = start_reply(conv)
    conv.reply_text(reply, ["Paris"], done=False)
    out = conv.observe([TranscriptUpdated(2, words("and Berlin"), 2)])
    assert of(out, cmd.InterruptReply) == [cmd.InterruptReply(reply, 0)]
    assert of(out, ReplyInterrupted)[0].heard_text == ""


def test_backchannels_and_echo_do_not_interrupt_and_are_dropped() -> None:
    conv = new()
    reply = start_reply(conv)
    out = stream_reply(conv, reply, "Paris is the capital of France.")
    voice_all(conv, reply, out)
    assert conv.observe([TranscriptUpdated(2, words("Yeah. Mm-hmm, okay"), 3)]) == []
    assert conv.observe([UtteranceFinalized(2, words("yeah mm-hmm okay"))]) == []
    assert conv.observe([UtteranceFinalized(3, words("capital of France"))]) == []  # its own voice
    conv.audio_sent(reply)
    out = conv.played(2 * SR)
    assert not conv.replying and of(out, cmd.AppendUserText) == []  # neither joins the next turn


def test_words_after_the_reply_join_the_next_turn() -> None:
    conv = new()
    reply = start_reply(conv)
    out = stream_reply(conv, reply, "Paris.")
    voice_all(conv, reply, out)
    conv.audio_sent(reply)
    assert conv.observe([TranscriptUpdated(2, words("yeah Berlin"), 1)]) == []  # one new word: not yet
    # Played out: "yeah" alone does not count as the user talking yet (it may be a backchannel, or the
    # reply's echo going on), so it waits for the words after it.
    assert of(conv.played(10 * SR), cmd.AppendUserText) == []
    out = conv.observe([UtteranceFinalized(2, words("yeah Berlin?"))])
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["yeah Berlin?"]
    say(conv, 3, "And Rome?")
    assert of(conv.tick(stream_s=9.0, silence_ms=400, asr_settled=True), TurnEnded)[0].text == "yeah Berlin? And Rome?"


def test_the_reply_s_echo_after_it_played_out_is_not_a_turn() -> None:
    """Measured (bench voice, clip09's reply through a room, rt60 0.6 s, 190 ms): the echo of its last words
    went on after the reply had played out, "Not just about | your dog", and was a turn of its own: the
    assistant answered its own echo."""
    conv = new()
    reply = start_reply(conv)
    said = "I'm here to help with any kind of conversation, not just about your dog."
    voice_all(conv, reply, stream_reply(conv, reply, said))
    conv.audio_sent(reply)
    conv.tick(stream_s=8.0, silence_ms=0, asr_settled=False)
    assert conv.observe([TranscriptUpdated(2, words("Not just", start=7.6), 2)]) == []
    out = conv.played(10 * SR)  # played out at 8.0 s: the echo goes on
    assert not conv.replying and of(out, cmd.AppendUserText) == []
    assert conv.observe([TranscriptUpdated(2, words("Not just about", start=7.6), 3)]) == []
    assert conv.observe([UtteranceFinalized(2, words("Not just about", start=7.6))]) == []
    assert conv.observe([UtteranceFinalized(3, words("your dog.", start=8.3))]) == []  # begun in the tail
    assert of(conv.tick(stream_s=10.0, silence_ms=1500, asr_settled=True), TurnEnded) == []
    # Speech that begins after the echo has died away is the user's, whatever it says.
    out = conv.observe([UtteranceFinalized(4, words("your dog", start=9.0))])
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["your dog"]


def test_a_backchannel_over_the_reply_s_end_is_dropped_but_one_after_it_answers_it() -> None:
    """ "Okay" said over the last words of a reply is a backchannel, as over the rest of it; "Yes." begun
    after the reply has played out may answer its question: it is the user's turn."""
    for start, appended in ((7.8, []), (8.2, ["Yes."])):
        conv = new()
        reply = start_reply(conv)
        voice_all(conv, reply, stream_reply(conv, reply, "Shall I book it for you?"))
        conv.audio_sent(reply)
        conv.tick(stream_s=8.0, silence_ms=0, asr_settled=False)
        conv.played(10 * SR)
        assert conv.observe([TranscriptUpdated(2, words("Yes.", start=start), 1)]) == []
        out = conv.observe([UtteranceFinalized(2, words("Yes.", start=start))])
        assert [a.text for a in of(out, cmd.AppendUserText)] == appended


def test_a_user_who_talks_as_the_reply_ends_is_heard_at_once() -> None:
    """Speech over the end of a reply goes to the user's turn as soon as it would have interrupted the reply
    (`barge_in_words` words of their own), not only at its final."""
    conv = new()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
    conv.audio_sent(reply)
    conv.tick(stream_s=8.0, silence_ms=0, asr_settled=False)
    assert conv.observe([TranscriptUpdated(2, words("and Berlin", start=7.8), 1)]) == []
    conv.played(10 * SR)
    out = conv.observe([TranscriptUpdated(2, words("and Berlin and", start=7.8), 2)])
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["and Berlin"]
    out = conv.observe([UtteranceFinalized(2, words("and Berlin and Rome?", start=7.8))])
    assert [a.text for a in of(out, cmd.AppendUserText)] == [" and Rome?"]


def test_cancel_without_a_reply_is_a_no_op_and_with_one_interrupts() -> None:
    conv = new()
    assert conv.cancel() == []
    reply = start_reply(conv)
    out = conv.cancel()
    assert of(out, ReplyInterrupted)[0].reason == "cancel" and of(out, cmd.InterruptReply)[0].reply == reply
    assert conv.cancel() == []


def test_stale_replies_and_audio_are_ignored() -> None:
    conv = new()
    reply = start_reply(conv)
    conv.cancel()
    assert conv.reply_text(reply, ["late"], done=False) == []
    assert conv.audio_ready(reply, 0, np.ones(5, np.float32)) == []
    assert conv.audio_sent(reply) == []
    assert conv.played(-5) == []


def test_second_turn_numbers_follow_and_audio_positions_continue() -> None:
    conv = new()
    reply = start_reply(conv)
    out = stream_reply(conv, reply, "Paris.")
    voice_all(conv, reply, out)
    conv.audio_sent(reply)
    conv.played(SR)
    say(conv, 2, "And Germany?")
    out = conv.tick(stream_s=9.0, silence_ms=400, asr_settled=True)
    assert of(out, TurnEnded)[0].turn == 2
    out = stream_reply(conv, 2, "Berlin.")
    voice_all(conv, 2, out)
    conv.played(int(1.5 * SR))  # half of the second reply's audio
    out = conv.cancel()
    assert of(out, ReplyInterrupted)[0].heard_ms == 500


def test_a_long_enough_hypothesis_interrupts_before_words_commit() -> None:
    conv = unpaused()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
    assert conv.observe([TranscriptUpdated(2, words("no that is"), 0)]) == []  # "is": the reply's own word
    out = conv.observe([TranscriptUpdated(2, words("no that is wrong"), 0)])
    assert of(out, ReplyInterrupted)


def test_where_speech_pauses_the_reply_only_committed_words_interrupt_it() -> None:
    """Measured (bench voice, noise run 4): a throat clearing over the reply was no speech to VAD (no pause),
    but Whisper's hypothesis read "uh, no that is" and interrupted it. Real speech pauses the reply first;
    a hypothesis alone never interrupts a reply whose audio speech would pause."""
    conv = new()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
    assert conv.observe([TranscriptUpdated(2, words("uh, no that is wrong"), 0)]) == []
    assert of(conv.observe([TranscriptUpdated(2, words("uh, no that is wrong"), 3)]), ReplyInterrupted)


def test_misheard_echo_of_the_reply_does_not_interrupt() -> None:
    conv = unpaused()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "She had your dog suit and greasy wash water all year."))
    # What Whisper made of the loudspeaker: near-misses of the reply's words.
    assert conv.observe([TranscriptUpdated(2, words("See? Dux greasie watter"), 0)]) == []  # 0.62 like it
    assert conv.observe([UtteranceFinalized(2, words("She hid your dux"))]) == []
    out = conv.observe([TranscriptUpdated(3, words("stop talking please"), 0)])
    assert [(i.reason, i.by) for i in of(out, ReplyInterrupted)] == [("barge_in", "stop talking please")]


def test_the_question_said_again_over_a_reply_that_quotes_it_is_the_user() -> None:
    """Measured (bench voice, `repeat`): 7 of 16 replies quoted the question closely enough to be its echo by
    the text check ("The horizon seems extremely distant." -> "The horizon is extremely distant, and ..."),
    and the question said again over each was taken for that echo: the reply paused, then played on."""
    conv = unpaused()
    reply = start_reply(conv, "The horizon seems extremely distant.")
    said = "The horizon is extremely distant, and it's a very distant place."
    voice_all(conv, reply, stream_reply(conv, reply, said))
    # Its echo, as heard: the reply's words, not the question's.
    assert conv.observe([UtteranceFinalized(2, words("The horizon is extremely distant,"))]) == []
    out = conv.observe([UtteranceFinalized(3, words("The horizon seems extremely distant."))])
    assert of(out, ReplyInterrupted)


def test_the_question_s_words_in_a_short_echo_are_still_its_echo() -> None:
    """Measured (bench voice, echo through a room): Whisper, prompted with the question "In 1813,", heard the
    echo of its reply "In 2013: 1913" as "In 1813, In 1813": the question's words, two of them."""
    conv = unpaused()
    reply = start_reply(conv, "In 1813.")
    voice_all(conv, reply, stream_reply(conv, reply, "In 2013: 1913"))
    assert conv.observe([TranscriptUpdated(2, words("In 1813, In 1813, In 1813"), 0)]) == []
    assert conv.observe([UtteranceFinalized(2, words("In 1813, In 1813."))]) == []


def test_whisper_s_loop_on_a_cut_echo_is_the_echo_not_new_speech() -> None:
    """Measured (bench voice, echo through a room at -6 and 0 dB): the echo of "In 2013: 1913", cut by the
    pause, came back as "In 1813, In 1813, In 1813" and its three "1813"s interrupted the reply."""
    assert cv.without_loops("in 1813 in 1813 in 1813".split()) == ["in", "1813"]
    assert cv.without_loops("a b c a b c d a b".split()) == "a b c d a b".split()
    for kept in ("stop stop stop", "no no I said no", ""):
        assert cv.without_loops(kept.split()) == kept.split()
    # (a speaker's own restart reads as said once: only the echo check reads this, the words all count)
    assert cv.without_loops("I think I think so".split()) == "I think so".split()
    conv = unpaused()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "In 2013: 1913"))
    assert conv.observe([TranscriptUpdated(2, words("In 1813, In 1813, In 1813"), 0)]) == []
    assert conv.observe([TranscriptUpdated(2, words("in 1813, in 1813, in 18"), 0)]) == []  # 2 words, not 3
    out = conv.observe([TranscriptUpdated(3, words("stop stop stop"), 0)])
    assert of(out, ReplyInterrupted)


def test_pieces_and_near_misses_of_the_reply_s_words_are_its_echo() -> None:
    """Measured (bench voice, echo at -6 dB): the echo of "In 2013: 1913" ("in twenty thirteen nineteen
    thirteen") came back as two utterances, "teen." and "19th.", and the two words interrupted the reply."""
    conv = new()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "In 2013: 1913"))
    assert conv.observe([UtteranceFinalized(2, words("teen."))]) == []
    assert conv.observe([UtteranceFinalized(3, words("19th."))]) == []
    assert conv.observe([UtteranceFinalized(4, words("Thirteen"))]) == []
    out = conv.observe([UtteranceFinalized(5, words("no, the first one"))])
    assert of(out, ReplyInterrupted)


def test_words_whose_audio_the_echo_canceller_took_out_are_the_reply_s_echo() -> None:
    """Measured (bench voice, clip09's reply through a room at 0 dB): its echo came back as "This is", in no
    word of the reply, and the two words interrupted it. The canceller had taken 15-65 dB out of the echo
    alone; a user talking over it as loud as it loses 3-6 dB."""
    conv = unpaused()
    cancelled_db = {2.0: 30.0, 4.0: 4.0}  # (the audio from 2 s on: echo only; from 4 s on: someone talking)
    conv.echo_db = lambda start_s, end_s: next(
        db for t, db in sorted(cancelled_db.items(), reverse=True) if start_s >= t
    )
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "I'm sorry for the mistake, but I'm a voice assistant."))
    assert conv.observe([TranscriptUpdated(2, words("This is", start=2.5), 2)]) == []
    assert conv.observe([UtteranceFinalized(2, words("This is it", start=2.5))]) == []
    out = conv.observe([TranscriptUpdated(3, words("no stop", start=4.2), 2)])
    assert [i.by for i in of(out, ReplyInterrupted)] == ["no stop"]  # (not the echo's "This is it")
    # Where the canceller had no echo to cancel (None: the loudspeaker silent, or not heard), words count.
    conv = unpaused()
    conv.echo_db = lambda start_s, end_s: None
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "I'm sorry for the mistake, but I'm a voice assistant."))
    assert of(conv.observe([TranscriptUpdated(2, words("This is", start=2.5), 2)]), ReplyInterrupted)


def test_a_fragment_over_the_reply_s_echo_is_not_a_turn_of_its_own() -> None:
    """Measured (bench voice's echo, the microphone kept open after the reply): "in the future." heard over
    clip06's reply through a 0 dB room (its words not the reply's, too few to interrupt it) joined the
    user's next turn at the reply's end; alone, it was that turn, the assistant answered it, and the echo
    of that answer made the next. Where the canceller had echo to cancel under such words, or over most of
    the reply (it decides the microphone hears the loudspeaker a second or so into it: "be." 1.5 s into
    clip06's reply had no level), they are dropped; where it had none (headphones), they are the user's."""

    def over_words(start_s: float, end_s: float) -> float | None:
        return 4.0  # (the canceller took 4 dB out: echo there, and little of it cancelled)

    def over_the_reply(start_s: float, end_s: float) -> float | None:
        return 4.0 if end_s - start_s > 2 else None  # (a word alone: too few chunks with a level)

    def no_echo(start_s: float, end_s: float) -> float | None:
        return None

    for echo_db, appended in ((over_words, []), (over_the_reply, []), (no_echo, ["the future."])):
        conv = new()
        conv.echo_db = echo_db
        reply = start_reply(conv)
        voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
        conv.audio_sent(reply)
        conv.tick(stream_s=9.0, silence_ms=0, asr_settled=False)
        assert conv.observe([UtteranceFinalized(2, words("the future.", start=6.0))]) == []  # one word: no barge-in
        out = conv.played(10 * SR)
        assert [a.text for a in of(out, cmd.AppendUserText)] == appended
    # Two words of its own interrupt the reply, over its echo or not: the user's.
    conv = new()
    conv.echo_db = lambda start_s, end_s: 4.0
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
    assert of(conv.observe([UtteranceFinalized(2, words("no Berlin", start=2.0))]), ReplyInterrupted)


def test_words_whisper_stacked_at_one_instant_do_not_interrupt_a_reply() -> None:
    """Measured (bench voice's echo through a room, before the canceller had converged): Whisper wrote the
    user's own question for the reply's echo, "and we are glad to welcome you.", every word at 8.472 s and
    0 ms long, and it interrupted the reply. Words the audio holds have times of their own; a lone word
    without length (the last of a hypothesis, cut at the window's end) still counts."""
    stacked = tuple(Word(w, 8.472, 8.472) for w in "and we are glad to welcome you.".split())
    conv = new()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
    assert conv.observe([UtteranceFinalized(2, stacked)]) == []
    out = conv.audio_sent(reply) + conv.played(10 * SR)
    assert not of(out, ReplyInterrupted) and not of(out, cmd.AppendUserText)  # (nor a turn of its own)
    # The same words spoken, and two spoken then a last one cut short: the user's.
    for heard in (
        words("and we are glad to welcome you.", start=2.0),
        (*words("no Berlin", 2.0), Word("now", 2.6, 2.6)),
    ):
        conv = new()
        reply = start_reply(conv)
        voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
        assert of(conv.observe([UtteranceFinalized(2, heard)]), ReplyInterrupted), heard
    assert cv.placed([Word("a", 1.0, 1.0), Word("b", 1.0, 1.0), Word("c", 1.0, 1.3), Word("d", 1.3, 1.3)]) == [
        Word("c", 1.0, 1.3),
        Word("d", 1.3, 1.3),
    ]


def test_an_utterance_the_canceller_took_most_of_is_the_reply_s_echo_whatever_its_words() -> None:
    """Measured (bench voice's echo through a room): Whisper, prompted with the question, wrote it for the
    reply's echo ("And we're glad to | welcome"); the canceller took 18 dB out over the utterance, but less
    than `echo_word_db` (10) under "to" and "welcome", and those two words interrupted the reply."""

    def echo_only(start_s: float, end_s: float) -> float | None:
        return 18.0 if end_s - start_s > 1.0 else 7.0  # (the utterance's span; a word alone)

    def user_over_echo(start_s: float, end_s: float) -> float | None:
        return 4.0  # (as loud as the echo: 3-6 dB)

    for echo_db, interrupted in ((echo_only, False), (user_over_echo, True)):
        conv = new()
        conv.echo_db = echo_db
        reply = start_reply(conv)
        voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
        out = conv.observe([UtteranceFinalized(2, words("and we're glad to welcome", start=2.0))])
        assert bool(of(out, ReplyInterrupted)) is interrupted, echo_db


def test_fragments_over_the_echo_do_not_add_up_to_an_interruption() -> None:
    """Measured (bench voice's echo, clip09 through a 0 dB room): "Great." and "Stay | tight." (the canceller
    took 11 dB out under "Stay"), two utterances of the echo with one word each that the reply lacks,
    interrupted it as two words. Each is a fragment over the echo, as dropped at the reply's end; without
    echo (headphones) they are the user's and interrupt it."""
    for echo_db, interrupted in ((lambda start_s, end_s: 4.0, False), (None, True)):
        conv = new()
        conv.echo_db = echo_db
        reply = start_reply(conv)
        voice_all(conv, reply, stream_reply(conv, reply, "Paris is the capital of France."))
        out = conv.observe([UtteranceFinalized(2, words("Great.", start=2.0))])
        out += conv.observe([UtteranceFinalized(3, words("tight.", start=3.5))])
        assert bool(of(out, ReplyInterrupted)) is interrupted, echo_db


def test_echo_score_separates_the_replys_echo_from_new_speech() -> None:
    reply = "she had your dog suit and greasy wash water all year"
    for heard in ("she hid your dux", "dog suit and greasy wash water", "see dux greasie watter"):
        assert cv.echo_score(heard, reply) >= 0.6, heard
    for heard in ("stop talking please", "wait no", "what about mars", "the birch canoe slid"):
        assert cv.echo_score(heard, reply) < 0.6, heard
    assert cv.echo_score("anything", "") == 0.0


def test_a_pause_drafts_the_reply_for_the_words_the_final_pass_will_most_likely_give() -> None:
    conv = cv.Conversation(TurnConfig(min_silence_ms=500), TtsConfig(), speculate=True)
    w = words("what is the capital of France?")
    (first,) = of(conv.observe([TranscriptUpdated(1, w, 3)]), cmd.AppendUserText)  # "what is the" committed
    assert first.text == "what is the"
    assert conv.tick(stream_s=3.0, silence_ms=250, asr_settled=False) == []  # P(end) not in yet: no draft
    conv.p_end_of_turn(0.001, first.version)
    assert conv.tick(stream_s=3.0, silence_ms=100, asr_settled=False) == []  # not a pause yet
    drafts = of(conv.tick(stream_s=3.1, silence_ms=250, asr_settled=False), cmd.DraftReply)
    assert [(d.text, d.version) for d in drafts] == [(" capital of France?", 1), (" capital of", 1)]
    assert conv.tick(stream_s=3.2, silence_ms=300, asr_settled=False) == []  # each once
    # The final pass confirms the hypothesis: the words reach the LLM exactly as the first draft assumed.
    (append,) = of(conv.observe([UtteranceFinalized(1, w)]), cmd.AppendUserText)
    assert append.text == drafts[0].text
    conv.p_end_of_turn(0.3, append.version)
    out = conv.tick(stream_s=3.5, silence_ms=600, asr_settled=True)
    assert of(out, cmd.StartReply) and not of(out, cmd.DraftReply)


def test_without_an_llm_p_end_drafts_go_at_the_pause() -> None:
    """The remote backend reports no P(end of turn): a draft (an early request) goes at the pause, and the
    turn ends only after `max_silence_ms`, which is the draft's head start."""
    turn = TurnConfig(min_silence_ms=500, max_silence_ms=1200)
    conv = cv.Conversation(turn, TtsConfig(), speculate=True, llm_p_end=False)
    w = words("what is the capital of France?")
    of(conv.observe([TranscriptUpdated(1, w, 3)]), cmd.AppendUserText)
    assert conv.tick(stream_s=3.0, silence_ms=100, asr_settled=False) == []  # not a pause yet
    drafts = of(conv.tick(stream_s=3.1, silence_ms=250, asr_settled=False), cmd.DraftReply)
    assert [d.text for d in drafts] == [" capital of France?", " capital of"]
    (append,) = of(conv.observe([UtteranceFinalized(1, w)]), cmd.AppendUserText)
    assert append.text == drafts[0].text
    assert not of(conv.tick(stream_s=3.6, silence_ms=700, asr_settled=True), cmd.StartReply)  # no P: waits
    assert of(conv.tick(stream_s=4.1, silence_ms=1200, asr_settled=True), cmd.StartReply)


def test_drafts_for_the_settled_text_and_never_while_replying() -> None:
    conv = cv.Conversation(TurnConfig(min_silence_ms=1000), TtsConfig(), speculate=True)
    out = say(conv, 1, "Tell me a story", p_end=0.001)
    (draft,) = of(conv.tick(stream_s=3.0, silence_ms=300, asr_settled=True), cmd.DraftReply)
    assert draft.text == "" and draft.version == of(out, cmd.AppendUserText)[-1].version
    assert of(conv.tick(stream_s=5.0, silence_ms=1300, asr_settled=True), cmd.StartReply)
    assert of(conv.tick(stream_s=6.0, silence_ms=2300, asr_settled=True), cmd.DraftReply) == []
    off = cv.Conversation(TurnConfig(min_silence_ms=1000), TtsConfig())
    say(off, 1, "Tell me a story", p_end=0.001)
    assert off.tick(stream_s=3.0, silence_ms=300, asr_settled=True) == []  # speculation off


def test_a_draft_s_first_piece_is_the_reply_s_first_piece() -> None:
    """What is synthesized ahead for a draft is exactly what the reply sends to TTS first, if adopted."""
    text = "Paris is the capital of France, and it is lovely."
    tokens = [text[: i + 1] for i in range(len(text)) if i + 1 == len(text) or text[i + 1] == " "]
    conv = new()
    (prefetch,) = conv.draft_text(tokens)
    assert isinstance(prefetch, cmd.PrefetchSpeech)
    reply = start_reply(conv)
    first_piece = of(conv.reply_text(reply, tokens, done=True), cmd.Synthesize)[0]
    assert prefetch.text == first_piece.text == "Paris is the"
    assert conv.draft_text(tokens) == []  # nothing ahead while a reply is under way


def test_starved_while_owed_reply_audio_does_not_exist() -> None:
    """The reply-lag signal: from the end of the turn until audio exists, and again whenever the client has
    played everything synthesized while more is owed; never once the reply's audio is complete."""
    conv = new()
    assert not conv.starved  # listening: nothing owed
    reply = start_reply(conv)
    assert conv.starved  # the turn is over and there is no audio yet
    out = conv.reply_text(reply, ["Paris is the capital of France, and"], done=False)
    first, *rest = of(out, cmd.Synthesize)
    conv.audio_ready(reply, first.index, np.full(SR, 0.1, np.float32))
    assert not conv.starved  # one second of audio to play
    conv.played(SR // 2)
    assert not conv.starved
    conv.played(SR)  # all of it played, the rest still being decoded or synthesized
    assert conv.starved
    out = conv.reply_text(reply, ["Paris is the capital of France, and it is lovely."], done=True)
    voice_all(conv, reply, rest + of(out, cmd.Synthesize))
    assert not conv.starved  # the reply's audio is complete


def test_speech_that_sounds_mid_phrase_holds_the_turn_until_max_silence() -> None:
    conv = new()  # min_silence_ms 250, max 1200
    say(conv, 1, "The birch canoe slid on the.", p_end=0.5)  # Whisper punctuated a mid-sentence pause
    conv.p_audio_end(0.05, 2.0)  # the audio: said mid-phrase; the speech ended at 2.0 s
    assert conv.tick(stream_s=2.9, silence_ms=900, asr_settled=True) == []
    conv.p_audio_end(0.05, 1.0)  # (a score for other speech, ended elsewhere, does not hold this one)
    assert of(conv.tick(stream_s=2.9, silence_ms=900, asr_settled=True), TurnEnded)
    conv = new()
    say(conv, 1, "The birch canoe slid on the.", p_end=0.5)
    conv.p_audio_end(0.05, 2.0)
    assert of(conv.tick(stream_s=3.2, silence_ms=1200, asr_settled=True), TurnEnded)


def test_without_an_llm_p_end_the_audio_ends_the_turn() -> None:
    """The remote backend reports no P(end of turn): the acoustic model's answer is the turn signal. Speech
    that sounds finished ends the turn after `min_silence_ms`, as a complete sentence does with the local
    LLM; speech that sounds mid-phrase, or with no answer yet, waits `max_silence_ms`."""
    turn = TurnConfig(min_silence_ms=500, max_silence_ms=1200)
    for p_audio, ends_at_ms in ((0.9, 500), (0.1, 1200), (None, 1200)):
        conv = cv.Conversation(turn, TtsConfig(), llm_p_end=False)
        w = words("what is the capital of France?")
        of(conv.observe([TranscriptUpdated(1, w, 3), UtteranceFinalized(1, w)]), cmd.AppendUserText)
        if p_audio is not None:
            conv.p_audio_end(p_audio, 2.0)  # the speech ended at 2.0 s
        before = conv.tick(stream_s=2.0 + (ends_at_ms - 50) / 1000, silence_ms=ends_at_ms - 50, asr_settled=True)
        assert not of(before, TurnEnded), p_audio
        (ended,) = of(conv.tick(stream_s=2.0 + ends_at_ms / 1000, silence_ms=ends_at_ms, asr_settled=True), TurnEnded)
        assert ended.p_audio == p_audio and ended.p_end is None


def premature_end(conv: cv.Conversation) -> tuple[int, list[cv.Output]]:
    """The endpointer ends "The frosty air passed" (speech over at 1.15 s, the turn at 2.0 s: in the pause
    that bench voice's mid-sentence pauses of 0.8-1.0 s make) and its reply begins to play."""
    say(conv, 1, "The frosty air passed")
    (turn,) = of(conv.tick(stream_s=2.0, silence_ms=850, asr_settled=True), TurnEnded)
    out = stream_reply(conv, turn.turn, "It is cold outside today.")
    out += voice_all(conv, turn.turn, out)
    return turn.turn, out


def test_words_begun_in_the_pause_that_ended_the_turn_continue_it() -> None:
    """Measured (bench voice, mid-sentence pauses of 0.8-1.0 s, the microphone kept open): "The frosty air
    passed | through the coat" ended the turn in the pause; the rest of the question interrupted its reply
    and was a turn of its own, answered alone ('You can use "through" to describe the fabric of the coat').
    Speech begun in that pause (or just after the turn's end) goes on with the turn: the reply is withdrawn
    whole and the next turn's end answers all of it."""
    conv = new()
    reply, _ = premature_end(conv)
    out = conv.observe([TranscriptUpdated(2, words("through his coat", 1.95), 2)])
    (stop,) = of(out, cmd.InterruptReply)
    assert stop.reply == reply and stop.withdraw
    assert of(out, ReplyInterrupted)[0].by == "through his coat"  # (the client stops its audio as for any barge-in)
    assert of(out, TurnContinued) == [TurnContinued(reply, "The frosty air passed")]
    assert [a.text for a in of(out, cmd.AppendUserText)] == [" through his"]  # (after the turn's words)
    assert out.index(stop) < out.index(of(out, cmd.AppendUserText)[0])  # (withdrawn before they are appended)
    (append,) = of(conv.observe([UtteranceFinalized(2, words("through his coat", 1.95))]), cmd.AppendUserText)
    conv.p_end_of_turn(0.5, append.version)
    assert turn_text(conv) == "The frosty air passed through his coat"
    assert conv.truncate(reply, 1000) is None  # (nothing of the withdrawn reply is left to cut)


def test_words_begun_well_after_the_turn_ended_start_a_turn_of_their_own() -> None:
    conv = new()
    reply, _ = premature_end(conv)
    out = conv.observe([TranscriptUpdated(2, words("wait stop talking", 2.6), 2)])  # (0.6 s after its end)
    (stop,) = of(out, cmd.InterruptReply)
    assert stop.reply == reply and not stop.withdraw and not of(out, TurnContinued)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["wait stop"]
    (append,) = of(conv.observe([UtteranceFinalized(2, words("wait stop talking", 2.6))]), cmd.AppendUserText)
    conv.p_end_of_turn(0.5, append.version)
    assert turn_text(conv) == "wait stop talking"


def test_a_turn_does_not_continue_where_the_setting_or_the_protocol_says_so() -> None:
    off = cv.Conversation(TurnConfig(min_silence_ms=250, continue_turn_ms=0), TtsConfig(first_words=3))
    realtime = new()
    realtime.continue_turns = False  # (a Realtime session: OpenAI's items, a new one after every turn)
    for conv in (off, realtime):
        premature_end(conv)
        out = conv.observe([TranscriptUpdated(2, words("through his coat", 1.95), 2)])
        assert not of(out, cmd.InterruptReply)[0].withdraw and not of(out, TurnContinued)
