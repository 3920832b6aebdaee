"""The voice loop without sockets or models: the conversation's commands reach the workers and the playout in
order, reply audio is paced by the playback clock, and a barge-in stops everything in the right order.
Time is passed in; the workers are recorders (the boundary of this unit), the conversation, playout and
clock are the real ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from duplexd import commands as cmd
from duplexd.config import TtsConfig, TurnConfig
from duplexd.events import (
    ReplyDone,
    ReplyInterrupted,
    ReplyPaused,
    ReplyResumed,
    ReplyStarted,
    TranscriptUpdated,
    TurnEnded,
    UtteranceFinalized,
    Word,
)
from duplexd.streaming import conversation as cv
from duplexd.streaming.clock import PlaybackClock
from duplexd.streaming.playout import MAX_QUEUED_SAMPLES, Playout
from duplexd.transport.metrics import Metrics
from duplexd.transport.resume import SentAudio
from duplexd.transport.voice import VoiceLoop

SR = 24_000
FRAME, LEAD = SR // 50, SR // 5  # 20 ms frames, 200 ms ahead of playback


@dataclass
class FakeSession:
    id: str = "s1"
    heard_s: float = 0.0
    silence_ms: float = 0.0
    asr_settled: bool = True
    voiced_ms: float = 0.0
    starved: list[bool] = field(default_factory=list)
    turns_ended: int = 0

    def note_reply_audio(self, starved: bool, now: float) -> None:
        self.starved.append(starved)

    def turn_ended(self) -> None:
        self.turns_ended += 1


class Recorder:
    """The dialog and TTS workers, and the client: everything handed to them, in one ordered log. TTS pieces
    wait in `jobs` (text, deliver, deadline) until `synthesize` delivers them; `now` is the time the voice
    loop reads in the TTS worker's callbacks."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.jobs: list[tuple[str, Callable[[np.ndarray], None], float]] = []
        self.now = 0.0

    def submit(self, *args: object, **kwargs: object) -> None:
        self.log.append(("dialog" if len(args) == 2 else "tts", args[1]))
        if len(args) == 3:
            self.jobs.append((args[1], args[2], kwargs["deadline"]))  # type: ignore[arg-type]

    def prefetch(self, text: str) -> None:
        self.log.append(("prefetch", text))

    def cancel(self, key: object) -> None:
        self.log.append(("tts.cancel", key))

    def of(self, kind: str) -> list[object]:
        return [x for k, x in self.log if k == kind]


def loop(now: float = 0.0, max_samples: int = MAX_QUEUED_SAMPLES) -> tuple[VoiceLoop, Recorder, FakeSession]:
    rec, session = Recorder(), FakeSession()
    rec.now = now
    conv = cv.Conversation(TurnConfig(min_silence_ms=250), TtsConfig(first_words=3))
    voice = VoiceLoop(
        session,  # type: ignore[arg-type]
        conv,
        rec,  # type: ignore[arg-type]
        7,
        rec,  # type: ignore[arg-type]
        playout=Playout(FRAME, LEAD, max_samples),
        clock=PlaybackClock(now),
        sent_audio=SentAudio(10 * SR),
        metrics=Metrics(),
        send_event=lambda e: rec.log.append(("event", e)),
        send_token=lambda reply, text: rec.log.append(("token", text)),
        send_audio=lambda seq, pcm: rec.log.append(("audio", len(pcm) // 2)),
        wake=lambda: None,
        listening=lambda: True,
        now=lambda: rec.now,
    )
    return voice, rec, session


def synthesize(rec: Recorder, seconds: float, now: float, pieces: int | None = None) -> int:
    """The TTS worker at `now`: the pieces handed to it come back, in order, as `seconds` of speech each (also
    those handed on meanwhile; at most `pieces`). Returns how many came back."""
    rec.now, done = now, 0
    while rec.jobs and (pieces is None or done < pieces):
        _, deliver, _ = rec.jobs.pop(0)
        deliver(np.zeros(round(seconds * SR), np.float32))
        done += 1
    return done


def words(text: str) -> tuple[Word, ...]:
    return tuple(Word(w, 0.3 * i, 0.3 * i + 0.25) for i, w in enumerate(text.split()))


def ask(voice: VoiceLoop, session: FakeSession) -> int:
    w = words("what is the capital")
    voice.dispatch(voice.conversation.observe([TranscriptUpdated(1, w, 2), UtteranceFinalized(1, w)]), 0.0)
    voice.p_end(0.9, 2, 0.0)  # (for the words of the last append)
    session.heard_s, session.silence_ms = 3.0, 400.0
    voice.tick(3.0)
    return voice.conversation.turns


def pace(voice: VoiceLoop, start: float, end: float) -> None:
    """The pacer's timer, every 10 ms from `start` through `end`."""
    for i in range(round((end - start) / 0.01) + 1):
        voice.pace(start + 0.01 * i)


def test_a_reply_goes_token_by_token_to_the_client_and_its_audio_is_paced() -> None:
    voice, rec, session = loop()
    turn = ask(voice, session)
    assert [type(e) for e in rec.of("event")[-2:]] == [TurnEnded, ReplyStarted]
    assert session.turns_ended == 1  # (speech after it is the next turn, never a continuation of this one)
    assert cmd.StartReply(turn) in rec.of("dialog")
    voice.reply_text(turn, ["Paris", "Paris is", "Paris is the capital."], True, 3.1)
    assert rec.of("token") == ["Paris", " is", " the capital."]
    assert synthesize(rec, 0.5, 3.2) == 2  # half a second of speech each
    assert " ".join(rec.of("tts")) == "Paris is the capital."  # (in pieces, the first one short)
    assert voice.pacing
    voice.pace(3.2)
    assert sum(rec.of("audio")) == LEAD  # only the lead goes ahead of playback
    pace(voice, 3.2, 3.7)  # half a second later: half a second more
    assert sum(rec.of("audio")) == LEAD + SR // 2
    pace(voice, 3.7, 5.0)
    assert sum(rec.of("audio")) == SR  # all of it, and the reply ends once it has been played
    assert [type(e) for e in rec.of("event")][-1] is ReplyDone and not voice.pacing


def test_a_barge_in_stops_generation_synthesis_and_audio_before_saying_so() -> None:
    voice, rec, session = loop()
    turn = ask(voice, session)
    voice.reply_text(turn, ["Paris", "Paris is", "Paris is the", "Paris is the capital of France."], False, 3.1)
    voice.tts_audio(turn, 0, np.zeros(2 * SR, np.float32), 3.2)
    pace(voice, 3.2, 4.2)  # one second played
    sent = voice.playout.sent
    rec.log.clear()
    voice.dispatch(voice.conversation.observe([TranscriptUpdated(2, words("no wait stop"), 3)]), 4.2)
    kinds = [k if k != "event" else type(x).__name__ for k, x in rec.log]
    assert kinds.index("dialog") < kinds.index("tts.cancel") < kinds.index("ReplyInterrupted")
    (cut,) = [x for k, x in rec.log if k == "dialog"][:1]
    assert isinstance(cut, cmd.InterruptReply) and cut.reply == turn
    (interrupted,) = [x for k, x in rec.log if isinstance(x, ReplyInterrupted)]
    assert 900 <= interrupted.heard_ms <= 1100  # what was played, not what was sent
    assert not voice.playout.queued and voice.played(4.2) == sent  # the client skips to the end of what it got


def test_speech_over_the_reply_pauses_its_audio_and_it_plays_on_from_there() -> None:
    voice, rec, session = loop()
    turn = ask(voice, session)
    voice.reply_text(turn, ["Paris", "Paris is", "Paris is the", "Paris is the capital of France."], True, 3.1)
    synthesize(rec, 2.0, 3.2)
    pace(voice, 3.2, 4.2)  # one second played
    sent = voice.playout.sent
    session.heard_s, session.silence_ms, session.voiced_ms = 5.0, 0.0, 128.0  # a cough
    voice.tick(4.2)
    (paused,) = [x for k, x in rec.log if isinstance(x, ReplyPaused)]
    assert 900 <= paused.played_ms <= 1100
    pace(voice, 4.2, 5.2)  # paused: nothing goes out, the client plays nothing
    assert voice.playout.sent == sent and voice.played(5.2) == voice.played(4.2)
    session.heard_s, session.silence_ms, session.voiced_ms = 6.0, 700.0, 0.0  # no words came of it
    voice.tick(5.2)
    (resumed,) = [x for k, x in rec.log if isinstance(x, ReplyResumed)]
    assert resumed.paused_ms == 1000
    pace(voice, 5.2, 5.7)
    assert voice.played(5.7) - voice.played(5.2) == SR // 2  # it plays on in real time from where it paused
    assert voice.playout.sent > sent
    pace(voice, 5.7, 9.0)  # (4 s of audio: 1 s before the pause, 3 s after)
    assert not [x for k, x in rec.log if isinstance(x, ReplyInterrupted)] and not voice.pacing


def test_a_reply_after_a_wait_plays_in_real_time_for_a_client_that_reports() -> None:
    """The client reported its position (0 ms) as the session opened and then waited, saying nothing, while
    the user spoke: the reply that came 3 s later is paced from when it went out, and speech over it pauses
    it. (Its last report ran on through the wait: the 1 s reply was sent whole and over at once, and the
    user saying the question again over it paused nothing.)"""
    voice, rec, session = loop()
    voice.clock.report(0, 0.0)  # (the native client's first `playback`, as the session opens)
    turn = ask(voice, session)
    voice.reply_text(turn, ["Paris", "Paris is", "Paris is the capital."], True, 3.1)
    synthesize(rec, 0.5, 3.2)
    pace(voice, 3.2, 3.7)  # half a second later: the lead and half a second, not all of it
    assert sum(rec.of("audio")) == LEAD + SR // 2 and voice.pacing
    assert not [x for k, x in rec.log if isinstance(x, ReplyDone)]
    session.heard_s, session.silence_ms, session.voiced_ms = 4.0, 0.0, 128.0  # the user talks over it
    voice.tick(3.7)
    (paused,) = [x for k, x in rec.log if isinstance(x, ReplyPaused)]
    assert 400 <= paused.played_ms <= 600


LONG = "One, two three four, five six seven eight, nine ten eleven twelve, thirteen fourteen fifteen sixteen, and on."


def test_a_replys_pieces_go_to_tts_one_at_a_time_with_the_deadlines_they_were_made_with() -> None:
    voice, rec, session = loop()
    turn = ask(voice, session)
    voice.reply_text(turn, [LONG], True, 3.1)
    made = len(voice.conversation._reply.pieces)  # type: ignore[union-attr]
    assert made >= 4 and rec.of("tts") == ["One,"]  # the others wait for its audio
    deadlines = []
    while rec.jobs:  # each one handed on as the audio of the one before comes back
        assert len(rec.jobs) == 1
        deadlines.append(rec.jobs[0][2])
        synthesize(rec, 0.5, 3.3, pieces=1)
    assert " ".join(rec.of("tts")) == LONG
    # The deadlines they were made with at 3.1 (nothing queued yet), not later ones for the audio that came
    # back since: the TTS worker's order is the one it had when every piece was queued at once.
    assert deadlines == [3.1 + 0.001 * i for i in range(made)]


def test_a_full_playout_holds_the_replys_next_pieces_back_until_its_audio_goes_out() -> None:
    bound = SR  # 1 s of audio not yet sent
    voice, rec, session = loop(max_samples=bound)
    turn = ask(voice, session)
    voice.reply_text(turn, [LONG], True, 3.1)
    made = len(voice.conversation._reply.pieces)  # type: ignore[union-attr]
    assert synthesize(rec, 1.5, 3.2) == 1  # the first piece's audio fills the playout: nothing else goes to TTS
    assert voice.playout.full and rec.of("tts") == ["One,"] and not rec.jobs
    voice.pace(3.2)  # the lead goes out (0.2 s): 1.3 s still queued
    assert voice.playout.full and len(rec.of("tts")) == 1
    pace(voice, 3.2, 3.49)  # played 0.29 s: 1.01 s queued
    assert voice.playout.full and len(rec.of("tts")) == 1
    pace(voice, 3.49, 3.52)  # below the bound: the next piece goes, due when what is queued has played
    assert not voice.playout.full and len(rec.of("tts")) == 2
    (_, _, deadline) = rec.jobs[0]
    assert deadline >= 3.5 + (voice.playout.sent + voice.playout.queued - voice.played(3.5)) / SR
    most, t = 0, 3.52
    for _ in range(4 * made):  # every later piece too, as its audio goes out; never more than a piece over
        synthesize(rec, 1.5, t)
        most = max(most, voice.playout.queued)
        pace(voice, t, t + 0.5)
        t += 0.5
    assert len(rec.of("tts")) == made and most <= bound + round(1.5 * SR)
    pace(voice, t, t + 1.5 * made)
    (done,) = [e for e in rec.of("event") if isinstance(e, ReplyDone)]
    assert sum(rec.of("audio")) == voice.playout.sent == made * round(1.5 * SR)  # nothing dropped
    assert done.audio_ms == 1000 * made * 1.5 and not voice.pacing


def test_a_barge_in_forgets_the_pieces_held_back() -> None:
    voice, rec, session = loop(max_samples=SR)
    turn = ask(voice, session)
    voice.reply_text(turn, [LONG], True, 3.1)
    synthesize(rec, 1.5, 3.2)
    pace(voice, 3.2, 4.2)
    assert len(rec.of("tts")) == 2  # the second piece is out, the rest wait
    voice.dispatch(voice.conversation.observe([TranscriptUpdated(2, words("no wait stop"), 3)]), 4.2)
    assert ("tts.cancel", (session.id, turn)) in rec.log
    synthesize(rec, 1.5, 4.3)  # the cancelled piece's audio, late: ignored, and nothing follows it
    pace(voice, 4.3, 6.0)
    assert len(rec.of("tts")) == 2 and not voice.playout.queued
