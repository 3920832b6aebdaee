"""One session's conversation at work: the half of a connection that is not socket I/O.

The conversation's commands go to the dialog worker, the TTS worker and the playout; its events and reply
tokens go to the client's codec (the native protocol, or OpenAI Realtime's), through the three callables
it is given; reply audio leaves as the client plays it (`pace`). Time is passed in, except in the
callbacks handed to the TTS worker, which read `now` when the audio arrives.

    reply token (dialog worker) -> reply_text -> Conversation -> ReplyDelta -> send_token
    TTS audio                   -> tts_audio  -> Conversation -> PlayAudio  -> Playout -> pace -> send_audio

Back-pressure: a reply's TTS pieces go to the TTS worker one at a time, each once the audio of the one before
it has come back, and only while the playout is not `full` (`transport.max_queued_audio_s`); the rest wait
here and go as `pace` sends frames. The playout's queue grows only by the audio of the one piece out, so it
never has to refuse a push. One at a time costs nothing: the worker serves the earliest deadline first, a
reply's later pieces have later deadlines, and a piece keeps the deadline it had when the conversation made
it, so the worker would not have taken it before the audio of the piece ahead of it was delivered (a piece
that waited for room gets the later deadline of the audio queued when it goes).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duplexd import commands as cmd
from duplexd.asr.echo import FarEnd
from duplexd.errors import Overloaded
from duplexd.events import Event, ReplyDelta, ReplyDone, ReplyInterrupted, ReplyStarted, TurnEnded
from duplexd.scheduler.dialog import DialogWorker
from duplexd.scheduler.tts import TtsWorker
from duplexd.streaming import conversation as cv
from duplexd.streaming.clock import PlaybackClock
from duplexd.streaming.playout import Playout
from duplexd.streaming.session import Session
from duplexd.streaming.timeline import Timeline, TurnTiming
from duplexd.transport.metrics import Metrics
from duplexd.transport.resume import SentAudio
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Piece:
    """A reply's TTS piece not yet handed to the TTS worker."""

    reply: int
    index: int
    text: str
    deadline: float  # as computed when the conversation made the piece


class VoiceLoop:
    def __init__(
        self,
        session: Session,
        conversation: cv.Conversation,
        dialog: DialogWorker,
        dialog_sid: int,
        tts: TtsWorker,
        *,
        playout: Playout,
        clock: PlaybackClock,
        sent_audio: SentAudio,
        metrics: Metrics,
        send_event: Callable[[Event], None],
        send_token: Callable[[int, str], None],
        send_audio: Callable[[int, bytes], None],
        wake: Callable[[], None],
        listening: Callable[[], bool],
        now: Callable[[], float] = time.monotonic,
        far_end: FarEnd | None = None,
    ) -> None:
        """`wake`: the pacer has audio to send. `listening`: a client is attached (reply audio it is owed
        and not given is then a server lag). `now`: the clock of the TTS worker's callbacks. `far_end`: the
        session's echo canceller's reference, fed the reply audio as it goes out."""
        self.session, self.conversation = session, conversation
        self.dialog, self.dialog_sid, self.tts = dialog, dialog_sid, tts
        self.playout, self.clock, self.sent_audio, self.metrics = playout, clock, sent_audio, metrics
        self._send_event, self._send_token, self._send_audio = send_event, send_token, send_audio
        self._wake, self._listening, self._now = wake, listening, now
        self.far_end = far_end
        self.timeline = Timeline()  # the latest turn's latency breakdown, logged once per reply
        self.text_only = False  # replies are text without speech (a Realtime session's `output_modalities`)
        # The current reply's pieces waiting for the TTS worker, in order. Bounded by the reply's length, which
        # its token cap bounds (`dialog.max_reply_tokens`; a Realtime `max_output_tokens`): a piece holds at
        # least one word of it.
        self._pieces: deque[_Piece] = deque()
        self._synthesizing: tuple[int, int] | None = None  # (reply, piece) out at the TTS worker
        self._waited_for_room = False  # the waiting pieces were held back by a full playout
        self._tts_refused = False  # the TTS worker's queue (all sessions) was full at the last submit

    def tick(self, now: float) -> None:
        session = self.session
        self.dispatch(
            self.conversation.tick(
                stream_s=session.heard_s,
                silence_ms=session.silence_ms,
                asr_settled=session.asr_settled,
                voiced_ms=session.voiced_ms,
            ),
            now,
        )

    def dispatch(self, outputs: list[cv.Output], now: float) -> None:
        """Carry out the conversation's commands; send its events."""
        session, conv = self.session, self.conversation
        for out in outputs:
            self._time(out, now)
            match out:
                case (
                    cmd.AppendUserText()
                    | cmd.RetractUserText()
                    | cmd.StartReply()
                    | cmd.DraftReply()
                    | cmd.InterruptReply()
                    | cmd.ReplaceContext()
                    | cmd.SetTools()
                ):
                    self.dialog.submit(self.dialog_sid, out)
                case cmd.Synthesize(reply=reply, index=index) if self.text_only:
                    self.tts_audio(reply, index, np.zeros(0, np.float32), now)  # a text-only reply: no speech
                case cmd.Synthesize(reply=reply, index=index, text=text):
                    self._pieces.append(_Piece(reply, index, text, self._deadline(index, now)))
                    self._synthesize_next(now)
                case cmd.PrefetchSpeech(text=text):
                    self.tts.prefetch(text)
                case cmd.PlayAudio(reply=reply, samples=samples):
                    self.playout.push(reply, samples)  # type: ignore[arg-type]
                    self._wake()
                case cmd.EndAudio(reply=reply):
                    self.playout.end(reply)
                    self._wake()
                case cmd.PauseAudio():
                    self.playout.paused = True
                    self.clock.hold(self.playout.sent, now)
                case cmd.ResumeAudio():
                    self.playout.paused = False
                    self.clock.release(now)
                    self._wake()
                case cmd.StopAudio(reply=reply):
                    self.playout.paused = False
                    self.clock.release(now)
                    self.playout.stop(reply)
                    self._forget_pieces(reply)
                    self.tts.cancel((session.id, reply))
                    # The client drops what it had not played and jumps to the end of what it received.
                    conv.rebase_output(self.playout.sent)
                    self.clock.rebase(self.playout.sent, now)
                    if self.far_end is not None:  # (never played: no echo of it)
                        self.far_end.skip(self.playout.sent)
                case ReplyDelta(reply=reply, text=text):
                    self._send_token(reply, text)
                case TurnEnded():
                    session.turn_ended()  # (speech after it is the next turn, not a breath of this one)
                    self._send_event(out)
                case _:
                    self._send_event(out)
        session.note_reply_audio(conv.starved and self._listening(), now)

    # -- TTS pieces, one at a time and while the playout has room -----------------------------------------

    def _deadline(self, index: int, now: float) -> float:
        """When the audio queued and sent ahead of the client's playback runs out (the TTS worker's order)."""
        ahead = self.playout.sent + self.playout.queued - self.played(now)
        return now + max(0, ahead) / OUTPUT_SAMPLE_RATE + 0.001 * index

    def _synthesize_next(self, now: float) -> None:
        """Hand the next waiting piece to the TTS worker, if none is out and the playout is not full."""
        if not self._pieces or self._synthesizing is not None:
            return
        if self.playout.full:
            self._waited_for_room = True  # (`pace` calls again as frames go out)
            return
        piece = self._pieces.popleft()
        deadline = piece.deadline
        if self._waited_for_room:  # its old deadline has passed: it is due once what is queued now has played
            deadline = max(deadline, self._deadline(piece.index, now))
        self._synthesizing = (piece.reply, piece.index)  # (before the submit: a worker may deliver at once)
        try:
            self.tts.submit(
                (self.session.id, piece.reply),
                piece.text,
                lambda audio, r=piece.reply, i=piece.index: self.tts_audio(r, i, audio, self._now()),
                deadline=deadline,
            )
        except Overloaded:  # the TTS queue (all sessions) is full: the piece waits, `pace` tries again
            if not self._tts_refused:
                log.warning("session %s: TTS queue full, reply %d waits", self.session.id, piece.reply)
            self._tts_refused = True
            if self._synthesizing == (piece.reply, piece.index):
                self._synthesizing = None
            self._pieces.appendleft(piece)
            return
        self._tts_refused = False
        if not self._pieces:
            self._waited_for_room = False

    def _forget_pieces(self, reply: int) -> None:
        self._pieces = deque(p for p in self._pieces if p.reply != reply)
        if self._synthesizing is not None and self._synthesizing[0] == reply:
            self._synthesizing = None
        if not self._pieces:
            self._waited_for_room = False

    def _time(self, out: cv.Output, now: float) -> None:
        """The turn's timeline: into the latency histograms when its first audio is ready, one log line when
        its reply ends."""
        match out:
            case TurnEnded(turn=turn, text=text, eos_s=eos_s):  # (the audio arrives in real time)
                self.timeline.turn_ended(turn, text, eos_at=now - max(0.0, self.session.heard_s - eos_s), now=now)
            case ReplyStarted(reply=reply):
                self.timeline.reply_started(reply)
            case ReplyDelta(reply=reply, text=text):
                self.timeline.token(reply, text, now)
            case cmd.PlayAudio(reply=reply):
                if (timing := self.timeline.audio(reply, now)) is not None:
                    self.metrics.turn(timing)
            case ReplyDone(reply=reply, text=text):
                self._log_turn(self.timeline.reply_ended(reply, text))
            case ReplyInterrupted(reply=reply):  # (the log keeps what was generated, not only what was heard)
                self._log_turn(self.timeline.reply_ended(reply))

    def _log_turn(self, timing: TurnTiming | None) -> None:
        if timing is not None:
            sid = self.session.id
            log.info(
                "session %s %s",
                sid,
                timing.summary(),
                extra={"event": "turn.timing", "session": sid, **timing.fields()},
            )

    # -- what the workers report ----------------------------------------------------------------------------

    def tts_audio(self, reply: int, index: int, audio: np.ndarray, now: float) -> None:
        if self._synthesizing == (reply, index):
            self._synthesizing = None
        self.dispatch(self.conversation.audio_ready(reply, index, audio), now)
        self._synthesize_next(now)

    def reply_text(self, reply: int, texts: list[str], done: bool, now: float) -> None:
        self.dispatch(self.conversation.reply_text(reply, texts, done), now)

    def p_end(self, p: float, version: int, now: float) -> None:
        self.conversation.p_end_of_turn(p, version)
        self.tick(now)

    def p_audio(self, p: float, voice_end_s: float, now: float) -> None:
        self.conversation.p_audio_end(p, voice_end_s)
        self.tick(now)

    def draft(self, texts: list[str], now: float) -> None:
        self.dispatch(self.conversation.draft_text(texts), now)

    # -- reply audio, as the client plays it --------------------------------------------------------------

    def played(self, now: float) -> int:
        """Samples of the output stream the client has played by `now`."""
        return self.clock.played(self.playout.sent, now)

    def echo_reference(self, n: int, now: float) -> np.ndarray | None:
        """What the loudspeaker plays over the next `n` samples of microphone audio (None: no canceller)."""
        if self.far_end is None:
            return None
        if self.playout.paused:  # the client is not playing: the loudspeaker is silent
            return self.far_end.silence(n)
        return self.far_end.take(self.played(now), n)

    @property
    def pacing(self) -> bool:
        """A reply is in progress or its audio still waits to go out."""
        return self.conversation.replying or bool(self.playout.queued)

    def pace(self, now: float) -> None:
        """Send the reply audio due by `now` (up to the lead ahead of the client's playback)."""
        conv = self.conversation
        played = self.played(now)
        frames, done = self.playout.take(played)
        for seq, pcm in frames:
            self.sent_audio.sent(seq, pcm)
            if self.far_end is not None:
                self.far_end.sent(pcm)
            self._send_audio(seq, pcm)
        self._synthesize_next(now)  # frames went out: the playout may have room again
        for reply in done:
            self.dispatch(conv.audio_sent(reply), now)
        self.dispatch(conv.played(played), now)
