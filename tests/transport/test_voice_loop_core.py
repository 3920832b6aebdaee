"""The voice loop without sockets or models: the conversation's commands reach the workers and the playout in
order, reply audio is paced by the playback clock, and a barge-in stops everything in the right order.
Time is passed in; the workers are recorders (the boundary of this unit), the conversation, playout and
clock are the real ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duplexd import commands as cmd
from duplexd.config import TtsConfig, TurnConfig
from duplexd.events import (
    ReplyDone,
    ReplyInterrupted,
    ReplyStarted,
    TranscriptUpdated,
    TurnEnded,
    UtteranceFinalized,
    Word,
)
from duplexd.streaming import conversation as cv
from duplexd.streaming.clock import PlaybackClock
from duplexd.streaming.playout import Playout
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
    starved: list[bool] = field(default_factory=list)

    def note_reply_audio(self, starved: bool, now: float) -> None:
        self.starved.append(starved)


class Recorder:
    """The dialog and TTS workers, and the client: everything handed to them, in one ordered log."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def submit(self, *args: object, **kwargs: object) -> None:
        self.log.append(("dialog" if len(args) == 2 else "tts", args[1]))

    def prefetch(self, text: str) -> None:
        self.log.append(("prefetch", text))

    def cancel(self, key: object) -> None:
        self.log.append(("tts.cancel", key))

    def of(self, kind: str) -> list[object]:
        return [x for k, x in self.log if k == kind]


def loop(now: float = 0.0) -> tuple[VoiceLoop, Recorder, FakeSession]:
    rec, session = Recorder(), FakeSession()
    conv = cv.Conversation(TurnConfig(min_silence_ms=250), TtsConfig(first_words=3))
    voice = VoiceLoop(
        session,  # type: ignore[arg-type]
        conv,
        rec,  # type: ignore[arg-type]
        7,
        rec,  # type: ignore[arg-type]
        playout=Playout(FRAME, LEAD),
        clock=PlaybackClock(now, reports=True),
        sent_audio=SentAudio(10 * SR),
        metrics=Metrics(),
        send_event=lambda e: rec.log.append(("event", e)),
        send_token=lambda reply, text: rec.log.append(("token", text)),
        send_audio=lambda seq, pcm: rec.log.append(("audio", len(pcm) // 2)),
        wake=lambda: None,
        listening=lambda: True,
        now=lambda: now,
    )
    return voice, rec, session


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
    assert cmd.StartReply(turn) in rec.of("dialog")
    voice.reply_text(turn, ["Paris", "Paris is", "Paris is the capital."], True, 3.1)
    assert rec.of("token") == ["Paris", " is", " the capital."]
    assert " ".join(rec.of("tts")) == "Paris is the capital."  # (in pieces, the first one short)
    for index in range(len(rec.of("tts"))):
        voice.tts_audio(turn, index, np.zeros(SR // 2, np.float32), 3.2)  # half a second of speech each
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
