"""What the Realtime endpoint asks of the conversation core: truncating a reply after it ended, a reply's
token cap, and replies that the user's words do not interrupt (scripted, pure)."""

from __future__ import annotations

from test_conversation import SR, new, of, start_reply, stream_reply, voice_all, words

from duplexd import commands as cmd
from duplexd.events import ReplyDone, ReplyInterrupted, TranscriptUpdated, TurnEnded, UtteranceFinalized
from duplexd.streaming import conversation as cv

TEXT = "Paris is the capital of France. It is a big city."  # pieces: "Paris is the" (1 s), the rest (1 s each)


def finished(conv: cv.Conversation) -> int:
    """A reply voiced, sent and played out: the conversation is listening again."""
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, TEXT))
    conv.audio_sent(reply)
    conv.played(10 * SR)
    assert not conv.replying
    return reply


def test_truncating_the_last_reply_after_it_ended_cuts_it_to_what_was_heard() -> None:
    conv = new()
    reply = finished(conv)
    heard, out = conv.truncate(reply, int(1.5 * SR))
    assert heard == "Paris is the capital" and out == [cmd.InterruptReply(reply, 4)]
    # A later, shorter truncate cuts again; a longer one (or the same) has nothing left to cut.
    assert conv.truncate(reply, 2 * SR) == ("Paris is the capital", [])
    heard, out = conv.truncate(reply, SR)
    assert heard == "Paris is the" and out == [cmd.InterruptReply(reply, 3)]
    assert conv.truncate(reply - 1, 0) is None  # an older reply is not kept


def test_truncating_after_a_barge_in_cuts_only_below_what_the_barge_in_kept() -> None:
    conv = new()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, TEXT))
    conv.played(int(1.5 * SR))
    out = conv.observe([TranscriptUpdated(2, words("wait no"), 2)])
    assert of(out, ReplyInterrupted)[0].heard_text == "Paris is the capital"
    assert conv.truncate(reply, 2 * SR)[1] == []  # (the client played no more than the server assumed)
    assert conv.truncate(reply, int(0.5 * SR))[1] == [cmd.InterruptReply(reply, 1)]


def test_truncating_the_reply_in_progress_stops_it_at_that_point() -> None:
    conv = new()
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, TEXT))
    conv.played(int(2.5 * SR))  # (the server's estimate is ahead of the client's truncate)
    heard, out = conv.truncate(reply, SR)
    assert heard == "Paris is the" and of(out, cmd.InterruptReply) == [cmd.InterruptReply(reply, 3)]
    assert of(out, ReplyInterrupted)[0].reason == "cancel" and not conv.replying


def test_a_reply_ends_at_its_token_cap_and_its_audio_plays() -> None:
    conv = new()
    conv.max_reply_tokens = 4
    reply = start_reply(conv)
    out = stream_reply(conv, reply, TEXT)
    assert of(out, cmd.InterruptReply) == [cmd.InterruptReply(reply, 4)]  # the LLM stops there
    audio = voice_all(conv, reply, out)
    assert of(audio, cmd.EndAudio) == [cmd.EndAudio(reply)]
    done = of(conv.audio_sent(reply), ReplyDone)[0]
    assert done.text == "Paris is the capital" and conv.capped(reply)
    conv.played(10 * SR)
    conv.max_reply_tokens = None
    (start,) = of(conv.respond(6.0, max_tokens=4), cmd.StartReply)  # (a cap for this reply only)
    assert of(stream_reply(conv, start.reply, "No."), cmd.InterruptReply) == [] and not conv.capped(start.reply)


def test_without_barge_in_the_users_words_wait_for_the_next_turn() -> None:
    conv = new()
    conv.barge_in = False
    reply = start_reply(conv)
    voice_all(conv, reply, stream_reply(conv, reply, TEXT))
    out = conv.observe([TranscriptUpdated(2, words("wait no stop"), 3)])
    assert out == [] and conv.replying
    conv.audio_sent(reply)
    out = conv.played(10 * SR)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["wait no stop"]


def test_a_typed_turn_of_its_own_waits_for_respond_whatever_the_silence() -> None:
    conv = new()
    out = conv.user_text("Hello there", own_turn_at=3.0)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["Hello there"]
    (turn,) = of(out, TurnEnded)
    assert turn.text == "Hello there" and not of(out, cmd.StartReply)
    assert conv.tick(stream_s=9.0, silence_ms=5000, asr_settled=True) == []  # the microphone's silence
    (start,) = of(conv.respond(9.0), cmd.StartReply)
    assert start.reply == turn.turn  # the reply answers that turn, no empty one in between


def test_a_replaced_context_carries_the_open_turns_words_that_reached_the_llm() -> None:
    conv = new()
    reply = finished(conv)
    turns = [("user", "What is the capital of France?"), ("assistant", "Paris.")]
    assert conv.replace_context("Be brief.", turns) == [cmd.ReplaceContext("Be brief.", tuple(turns), "")]
    assert conv.truncate(reply, SR) is None  # (the new context holds the reply as reported: nothing to cut)
    conv.observe([TranscriptUpdated(2, words("and Spain"), 2)])
    (rebuilt,) = conv.replace_context(None, turns)
    assert rebuilt.open_user == "and Spain"  # the words already in the LLM follow the turns
    # Words held for the client's commit (turn detection off) have not reached the LLM: not carried.
    conv.auto_turns = False
    conv.observe([TranscriptUpdated(3, words("or Italy"), 2)])
    assert conv.replace_context(None, turns)[0].open_user == "and Spain"
    out = conv.commit(9.0)
    assert [a.text for a in of(out, cmd.AppendUserText)] == [" or Italy"] and of(out, cmd.StartReply)
    # During a reply: nothing (the shell rebuilds when it ends).
    assert conv.replying and conv.replace_context(None, turns) == []


def test_a_later_reply_in_progress_leaves_the_last_one_uncut() -> None:
    conv = new()
    first = finished(conv)
    assert of(conv.user_text("And Spain?") + conv.respond(10.0), cmd.StartReply)
    assert conv.truncate(first, 0) is None  # (the worker cuts only its last reply: the shell rebuilds)


def test_a_clear_drops_the_words_of_cleared_audio_the_recognizer_commits_later() -> None:
    conv = new()
    conv.auto_turns = False
    # "we must find a new home" (0-1.75 s) is still open at the clear: only two words are committed.
    conv.observe([TranscriptUpdated(1, words("we must find a new home"), 2)])
    assert conv.clear(2.0) == []
    # The same utterance's final arrives after the clear, then the words said again (from 3 s).
    conv.observe([UtteranceFinalized(1, words("we must find a new home"))])
    conv.observe([TranscriptUpdated(2, words("we must find", start=3.0), 3)])
    out = conv.commit(5.0)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["we must find"]
    assert of(out, TurnEnded)[0].text == "we must find"


def test_with_the_client_deciding_turns_words_over_the_end_of_a_reply_are_its_to_commit() -> None:
    """Where the server decides turns, words over a reply's last moments wait until they count as the user
    talking (they may be its echo going on); with turn detection off the client commits what it heard."""
    conv = new()
    reply = start_reply(conv)
    conv.auto_turns = False  # (a Realtime session.update setting turn detection off)
    voice_all(conv, reply, stream_reply(conv, reply, "Paris."))
    conv.audio_sent(reply)
    conv.tick(stream_s=8.0, silence_ms=0, asr_settled=False)
    conv.observe([TranscriptUpdated(2, words("and Spain", start=7.8), 1)])
    conv.played(10 * SR)
    out = conv.commit(9.0)
    assert [a.text for a in of(out, cmd.AppendUserText)] == ["and"] and of(out, TurnEnded)[0].text == "and"
