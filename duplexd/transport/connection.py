"""One session's connection core: its session cores, and what it owes the client. No socket.

`Connection` is sans-socket, in the style of python-websockets' protocol objects: a shell
(`transport.shell.WebSocketShell`, the only code that touches the WebSocket) hands it each client message with
the time it arrived (`receive`), writes what it has to send (`data_to_send`), drives its reply-audio pacing
(`tick`), and says when the socket is gone (`link_lost`); how the core wants the socket closed is `close`. The
core never reads or writes a socket. It does await its own workers (the VAD thread, opening a dialog session,
the recognizer draining at `session.end`), which run off the event loop; the workers' callbacks (`emit`,
`on_reply`, ...) take the time where they enter.

Its codec speaks the protocol: `transport.native` (protocol v1) or `transport.realtime_session` (OpenAI
Realtime).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from duplexd.aio import wait_set
from duplexd.asr.echo import EchoCanceller, EchoLevels, FarEnd
from duplexd.errors import ErrorCode, Overloaded, ProtocolError
from duplexd.events import (
    Event,
    ReplyRelayed,
    ReplySpeculation,
    ReplyToolCalled,
)
from duplexd.streaming import conversation as cv
from duplexd.streaming.clock import PlaybackClock
from duplexd.streaming.playout import Playout
from duplexd.streaming.session import Session
from duplexd.transport import protocol
from duplexd.transport.limits import AudioRateLimit
from duplexd.transport.outbox import (
    CLOSE_POLICY,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    CLOSE_UNSUPPORTED_DATA,
    CLOSE_WILL_RESUME,
    Close,
    Closing,
    Link,
    Outbox,
)
from duplexd.transport.protocol import ServerType
from duplexd.transport.resume import EventLog, SentAudio, hand_over, new_resume_token, refusal
from duplexd.transport.tokens import ReplyTokens
from duplexd.transport.voice import VoiceLoop
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

if TYPE_CHECKING:
    from duplexd.transport.server import Server

log = logging.getLogger(__name__)

_FATAL_CLOSE = {
    ErrorCode.UNSUPPORTED_VERSION: CLOSE_PROTOCOL_ERROR,
    ErrorCode.NOT_STARTED: CLOSE_PROTOCOL_ERROR,
    ErrorCode.BAD_SAMPLE_RATE: CLOSE_UNSUPPORTED_DATA,
    ErrorCode.TOO_MANY_ERRORS: CLOSE_POLICY,
    ErrorCode.RESUME_REFUSED: CLOSE_POLICY,
}


class Codec(Protocol):
    """A protocol spoken on a session's socket, over its connection: what a client message does, and how the
    session core's events, reply tokens, audio and errors are written."""

    numbered: bool  # events are numbered and kept for a resume

    async def opening(self, now: float) -> None: ...
    async def on_text(self, data: str, now: float) -> bool: ...  # True: the connection's reading is over
    async def on_binary(self, data: bytes, now: float) -> None: ...
    def started(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]: ...
    def configure(self, conversation: cv.Conversation) -> None: ...
    def event(self, event: Event) -> None: ...
    def token(self, reply: int, text: str) -> None: ...
    def audio(self, seq: int, pcm: bytes) -> None: ...
    def error(self, code: ErrorCode, message: str, **extra: Any) -> None: ...
    def tick(self, now: float) -> None: ...
    def release(self) -> None: ...


class Connection:
    """A session's handle: its session cores (`Session`, `Conversation`, the voice loop), what it owes the
    client (the outbox, the event log, reply tokens until acknowledged, the audio a resume may need) and
    its playback clock. What the messages mean is its codec's: the native protocol (`native.NativeCodec`) or
    OpenAI Realtime's (`realtime_session.RealtimeCodec`).

    The handle outlives a socket that drops: it waits `resume_grace_s` for `session.resume` on a new
    WebSocket (`take_over`), keeping the reply tokens the client has not acknowledged and the reply audio it
    may not have received; everything else it would have sent waits in the bounded outbox."""

    def __init__(self, server: Server, codec: Callable[[Connection], Codec], now: float) -> None:
        """`codec`: the protocol spoken on the socket, built for this connection (`native.NativeCodec`, or
        `realtime_session.RealtimeCodec`)."""
        self.server = server
        self.link: Link | None = None  # the socket's shell, while attached
        self.attached = True
        self.ended = False  # session.end, a fatal error, or a refusal: nothing to resume
        self.close: Close | None = None  # set when the core wants its socket closed
        self.urgent = asyncio.Event()  # set with a `close` that does not wait for the outbox (`flush=False`)
        self.resume: tuple[Connection, protocol.SessionResume] | None = None  # set on a resuming connection
        self.resume_token = new_resume_token()
        self._expiry: asyncio.TimerHandle | None = None
        self._lost_while_detached = False
        self.link_closed = asyncio.Event()
        self.session: Session | None = None
        self.conversation: cv.Conversation | None = None
        self.dialog_sid: int | None = None
        self.errors = 0
        t = server.config.transport
        self.outbox = Outbox(t.outbound_queue)
        self.finished = False  # nothing more will be queued: the shell writes what is left and stops
        self._overflowed = False
        self.playout = Playout(
            OUTPUT_SAMPLE_RATE * t.audio_frame_ms // 1000,
            OUTPUT_SAMPLE_RATE * t.audio_lead_ms // 1000,
            int(OUTPUT_SAMPLE_RATE * t.max_queued_audio_s),  # (the voice loop holds pieces back: back-pressure)
        )
        self._frame_s = t.audio_frame_ms / 1000
        self._scoring: set[asyncio.Task[None]] = set()  # pauses at the turn-audio worker (one per pause)
        self.audio_wake = asyncio.Event()  # reply audio to pace: `tick` has work before its next deadline
        self.tokens = ReplyTokens(t, server.datagram)
        self.sent_audio = SentAudio(int(t.resume_audio_s * OUTPUT_SAMPLE_RATE))
        self.voice: VoiceLoop | None = None  # the conversation at work (a session with dialog)
        self.audio_limit = AudioRateLimit(server.config.security.audio_burst_s)
        self.events = EventLog(t.resume_events)  # (numbered: all but frame.ack)
        self.codec = codec(self)
        self.clock = PlaybackClock(now)

    # -- what the shell calls -----------------------------------------------------------------------

    async def open(self, now: float) -> None:
        """A socket is attached, before the first message is read (the Realtime codec starts its session)."""
        try:
            try:
                await self.codec.opening(now)
            except Overloaded as exc:
                self._overloaded(exc)
        except Closing as closing:
            self._close_after(closing)

    async def receive(self, message: str | bytes, now: float) -> bool:
        """A client message, received at `now`. True: reading is over (`session.end`, a resume handed over
        to another connection, or `close` is set)."""
        try:
            try:
                if isinstance(message, str):
                    if await self.codec.on_text(message, now):
                        return True
                else:
                    await self.codec.on_binary(message, now)
            except ProtocolError as exc:
                self._on_protocol_error(exc)
            except Overloaded as exc:
                self._overloaded(exc)
        except Closing as closing:
            self._close_after(closing)
        return self.close is not None

    def _overloaded(self, exc: Overloaded) -> None:
        """The server is full (at `session.start`, or its workers' queues): say so, then close 1013."""
        self.ended = True
        extra = {} if exc.retry_after_ms is None else {"retry_after_ms": exc.retry_after_ms}
        self.codec.error(ErrorCode.OVERLOADED, str(exc), **extra)
        raise Closing(CLOSE_TRY_AGAIN_LATER, "overloaded") from None

    def timed_out(self, idle_s: float) -> None:
        """Nothing was received for `idle_s` (`security.idle_timeout_s`)."""
        self.ended = True
        self.codec.error(ErrorCode.IDLE_TIMEOUT, f"nothing received for {idle_s:.0f} s")
        self._close_after(Closing(CLOSE_POLICY, ErrorCode.IDLE_TIMEOUT.value))

    def data_to_send(self) -> list[str | bytes]:
        """The messages to write now, in order."""
        return self.outbox.take()

    def finish(self) -> None:
        """Reading is over: what is queued is the last to write."""
        self.finished = True
        self.outbox.ready.set()

    def tick(self, now: float) -> float | None:
        """Send the reply audio that is due; the seconds until it next may be (None: until `audio_wake`)."""
        voice = self.voice
        if voice is None or not voice.pacing:
            return None
        voice.pace(now)
        if not voice.pacing:
            self.codec.tick(now)  # (the reply has just played out: what the codec held back for it may go)
        return self._frame_s / 2

    async def pace(self) -> None:
        """Send the reply audio as it comes due, until cancelled (the shell runs it beside its reader)."""
        while True:
            delay = self.tick(time.monotonic())
            self.audio_wake.clear()
            if delay is None:
                await self.audio_wake.wait()
                continue
            await wait_set(self.audio_wake, delay)

    def attach(self, link: Link) -> None:
        self.link = link
        self.finished = False
        self.close = None
        self.urgent.clear()

    def link_lost(self, close_code: int | None, now: float) -> None:
        """The socket is gone (`close_code`: the code of the client's closing frame, None if there was no
        closing handshake): end the session, or keep it for a resume if the link merely dropped."""
        self.attached = False
        self.link = None
        self.link_closed.set()
        if self.session is None:
            return
        grace = self.server.config.transport.resume_grace_s if self.codec.numbered else 0.0  # (Realtime: no resume)
        dropped = close_code is None or close_code == CLOSE_WILL_RESUME
        if self.ended or self._overflowed or not dropped or grace <= 0:
            self.release()
            return
        self.server.counters["detached"] += 1
        self.session.note_reply_audio(False, now)  # nobody is listening: not a server lag
        self._expiry = asyncio.get_running_loop().call_later(grace, self._expire)
        log.info(
            "session %s detached; resumable for %.0f s",
            self.session.id,
            grace,
            extra={"event": "session.detached", "session": self.session.id, "token_seq": self.tokens.last_seq},
        )

    def take_over(self, msg: protocol.SessionResume, now: float) -> None:
        """`session.resume` on a new socket: first the tokens the client has not acknowledged and the audio it
        has not received, then what was queued for it meanwhile (or the refusal, and `close`)."""
        session = self.session
        if session is None or self._lost_while_detached:
            return self._refuse_resume("the session has ended")
        if (why := refusal(msg, self.tokens.sender, self.sent_audio)) is not None:
            return self._refuse_resume(why)
        plan = hand_over(msg, session.id, self.tokens.sender, self.sent_audio, self.events, self.outbox.take(), now)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.attached = True
        self.link_closed = asyncio.Event()
        self.server.counters["resumed"] += 1
        self.outbox.replace([protocol.dumps(plan.resumed), *plan.frames, *plan.queued])
        # The client plays from where its copy ended; until it reports, assume real time from now.
        self.clock.resume(now)
        self.audio_wake.set()
        log.info(
            "session %s resumed at token %d, %.0f ms of audio",
            session.id,
            msg.token_seq,
            msg.audio_ms,
            extra={"event": "session.resumed", "session": session.id, "tokens_resent": len(plan.resumed["tokens"])},
        )

    def _refuse_resume(self, message: str) -> None:
        final = protocol.dumps(protocol.error_message(ErrorCode.RESUME_REFUSED, message))
        self.close = Close(CLOSE_POLICY, ErrorCode.RESUME_REFUSED.value, flush=False, final=(final,))
        self.urgent.set()

    def _close_after(self, closing: Closing) -> None:
        """Close once what is queued is written (the error that says why is the last of it)."""
        self.ended = True
        self.close = Close(closing.code, closing.reason)
        self.outbox.ready.set()

    def _expire(self) -> None:
        if not self.attached and self.session is not None:
            self.server.counters["expired"] += 1
            log.info("session %s was not resumed", self.session.id, extra={"event": "session.expired"})
            self.release()

    @property
    def busy_replying(self) -> bool:
        return self.conversation is not None and self.conversation.replying

    async def flush(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until everything queued for the client has been handed to the socket."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.outbox:
                break
            await asyncio.sleep(0.01)

    def release(self) -> None:
        self.codec.release()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self.session is not None:
            server = self.server
            server.asr.unregister(self.session)
            server.sessions.pop(self.session.id, None)
            server.handles.pop(self.session.id, None)
            self.tokens.close()
            self.session.note_reply_audio(False, time.monotonic())
            server.underrun_closed_s += self.session.underrun_s
            log.info(
                "session %s ended after %.1f s of audio",
                self.session.id,
                self.session.stream_s,
                extra={
                    "event": "session.ended",
                    "session": self.session.id,
                    "audio_s": round(self.session.stream_s, 2),
                    "frames": self.session.frames,
                    "reply_underrun_s": round(self.session.underrun_s, 3),
                },
            )
            if self.dialog_sid is not None and server.dialog is not None:
                server.dialog.close(self.dialog_sid)
            if self.conversation is not None and server.tts is not None:
                # Only the latest reply can have pieces queued: earlier ones were voiced or stopped.
                server.tts.cancel((self.session.id, self.conversation.turns))
            self.session = None
            self.conversation = None
            self.voice = None
            self.dialog_sid = None

    # -- outbound -----------------------------------------------------------------------------------

    def send(self, msg: dict[str, Any] | str | bytes) -> None:
        if self._overflowed:
            return
        if isinstance(msg, dict) and self.codec.numbered and msg.get("type") != ServerType.FRAME_ACK:
            # Numbered and kept until acknowledged, so a resume can replay what a dead socket swallowed.
            msg = self.events.add(msg)
        if self.outbox.put(msg if isinstance(msg, str | bytes) else protocol.dumps(msg)):
            return
        self._overflowed = True
        if not self.attached:  # too much happened while the client was away: it cannot resume losslessly
            self._lost_while_detached = True
            self._expire()
            return
        # The client does not read fast enough; rather than buffer without bound, end the session: close 1008
        # `slow_consumer` at once (it queues behind what the client has not read; a client that reads again
        # sees it), and drop the socket if the closing handshake does not finish (`SLOW_CLOSE_S`).
        sid = self.session.id if self.session else None
        log.warning("closing slow client %s", sid, extra={"event": "session.slow_client", "session": sid})
        self.server.counters["slow_consumers"] += 1
        self.close = Close(CLOSE_POLICY, ErrorCode.SLOW_CONSUMER.value, flush=False)
        self.urgent.set()

    @property
    def outbound_bytes(self) -> int:
        """What waits to be written to this client: the outbox, and the socket's own buffer."""
        return self.outbox.bytes + (self.link.buffered() if self.link is not None else 0)

    def emit(self, events: list[Event]) -> None:
        """Events of the session core (VAD, ASR): to the client, and into the conversation."""
        now = time.monotonic()  # (the workers' callback: the time is taken here)
        for event in events:
            self.codec.event(event)
        if self.conversation is not None:
            self.dispatch(self.conversation.observe(events), now)
            self._tick_conversation(now)

    def played(self, samples: int, now: float) -> None:
        """The client has played `samples` of the reply audio stream (a native `playback` report; a WebRTC
        call's own track as it plays)."""
        self.clock.report(samples, now)
        self.sent_audio.played(samples)
        if self.conversation is not None:
            self.dispatch(self.conversation.played(samples), now)

    # -- the conversation (`transport.voice`) ---------------------------------------------------------

    def _tick_conversation(self, now: float) -> None:
        if self.voice is not None:
            self.voice.tick(now)
        self.codec.tick(now)

    def dispatch(self, outputs: list[cv.Output], now: float) -> None:
        """Carry out the conversation's commands; send its events."""
        if self.voice is not None:
            self.voice.dispatch(outputs, now)

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.reply_text(reply, texts, done, time.monotonic())

    def on_p_end(self, p: float, version: int) -> None:  # DialogClient
        if self.voice is not None:
            now = time.monotonic()
            self.voice.p_end(p, version, now)  # (it ticks the conversation)
            self.codec.tick(now)

    def on_draft(self, texts: list[str]) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.draft(texts, time.monotonic())

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:  # DialogClient
        self.codec.event(ReplySpeculation(reply, drafts, hit, draft_tokens))

    def on_relay(self, reply: int, text: str, model: str, remote_model: str, decided_ms: float) -> None:  # DialogClient
        self.codec.event(ReplyRelayed(reply, text, model, remote_model, decided_ms))

    def on_tools(self, reply: int, events: list[Any]) -> None:  # DialogClient (`tools.calls.ToolEvent`s)
        for e in events:
            result = e.result
            self.codec.event(
                ReplyToolCalled(
                    reply,
                    e.call.call_id,
                    e.call.name,
                    e.call.arguments,
                    e.server,
                    None if result is None else result.output,
                    result is not None and result.error,
                    0.0 if result is None else 1000 * result.elapsed_s,
                    e.early,
                    1000 * e.waited_s,
                )
            )

    # -- inbound ------------------------------------------------------------------------------------

    def _on_protocol_error(self, exc: ProtocolError) -> None:
        self.server.counters["protocol_errors"] += 1
        self.errors += 1
        self.codec.error(exc.code, exc.message)
        if exc.fatal:
            raise Closing(_FATAL_CLOSE.get(exc.code, CLOSE_PROTOCOL_ERROR), exc.code.value)
        if self.errors >= self.server.config.transport.max_errors:
            self.codec.error(ErrorCode.TOO_MANY_ERRORS, "too many protocol errors")
            raise Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

    async def start(self, msg: protocol.SessionStart) -> None:
        server = self.server
        if not server.admits():
            server.counters["refused"] += 1
            server.metrics.sessions_refused.inc()
            retry = server.config.admission.retry_after_ms
            log.info(
                "refused a session: %d active, limit %d",
                len(server.sessions),
                server.admission.sessions,
                extra={
                    "event": "session.refused",
                    "sessions": len(server.sessions),
                    "limit": server.admission.sessions,
                },
            )
            raise Overloaded(f"server is full ({len(server.sessions)} sessions)", retry_after_ms=retry)
        dialog = msg.dialog and server.dialog is not None
        session = Session(uuid.uuid4().hex, msg.sample_rate, server.session_config)
        if dialog:
            assert server.dialog is not None
            server.starting += 1  # (admitted now: handshakes awaiting meanwhile see this one)
            try:
                self.dialog_sid = await server.dialog.open(self)  # raises PoolFull (Overloaded)
            finally:
                server.starting -= 1
            self.conversation = self._new_conversation()
            self.codec.configure(self.conversation)
            assert server.tts is not None and self.dialog_sid is not None
            far_end = None
            if (mode := server.config.turn.echo_cancellation) != "off":  # (a session with reply audio)
                session.echo, far_end = EchoCanceller(replace_audio=mode == "cancel"), FarEnd(OUTPUT_SAMPLE_RATE)
                session.echo_levels = EchoLevels()
                self.conversation.echo_db = session.echo_levels.attenuation_db
            self.voice = VoiceLoop(
                session,
                self.conversation,
                server.dialog,
                self.dialog_sid,
                server.tts,
                playout=self.playout,
                clock=self.clock,
                sent_audio=self.sent_audio,
                metrics=server.metrics,
                send_event=self.codec.event,
                send_token=self.codec.token,
                send_audio=self.codec.audio,
                wake=self.audio_wake.set,
                listening=lambda: self.attached,
                far_end=far_end,
            )
        self.session = session
        server.sessions[session.id] = session
        server.handles[session.id] = self
        server.counters["sessions"] += 1
        server.metrics.sessions_admitted.inc()
        log.info(
            "session %s started (%d Hz, dialog %s)",
            session.id,
            msg.sample_rate,
            dialog,
            extra={"event": "session.started", "session": session.id, "sessions": len(server.sessions)},
        )
        server.asr.register(session, self.emit)
        self.send(self.codec.started(msg, dialog))

    def _new_conversation(self) -> cv.Conversation:
        spec, config, dialog = self.server.config.speculation, self.server.config, self.server.dialog
        conversation = cv.Conversation(
            config.turn,
            config.tts,
            speculate=spec.enabled,
            drafts=spec.drafts_per_session,
            llm_p_end=dialog is None or dialog.engine.reports_p_end,
        )
        runner = None if dialog is None else getattr(dialog.engine, "runner", None)
        if runner is not None and any(runner.may_run_early(s) for s in runner.specs):
            conversation.listen_draft_s = config.tools.listen_draft_ms / 1000  # (read-only calls start early)
        return conversation

    async def run_vad(self, session: Session, chunks: Any) -> None:
        far = None
        if session.echo is not None and self.voice is not None and len(chunks):
            far = self.voice.echo_reference(chunks.size, time.monotonic())
        vad = await self.server.vad.probabilities(session.vad_stream, chunks, echo=session.echo, far=far)
        self.emit(session.apply_vad(vad.chunks, vad.probs, time.monotonic(), vad.echo_levels))  # (arrives now)
        if session.wants_pass():
            self.server.asr.notify()
        if (pause := session.take_pause_audio()) is not None and self.server.turn_audio is not None:
            self._score_pause(session, *pause)

    def _score_pause(self, session: Session, voice_end_s: float, audio: Any) -> None:
        """How the user stopped talking (the acoustic end-of-turn model, on its worker): to the endpointer."""
        worker = self.server.turn_audio
        assert worker is not None

        async def score() -> None:
            try:
                p = await worker.probability(audio)
            except RuntimeError:  # (the server is shutting down: its worker is gone)
                return
            if p is not None and self.session is session and self.voice is not None:
                now = time.monotonic()
                self.voice.p_audio(p, voice_end_s, now)
                self.codec.tick(now)

        task = asyncio.get_running_loop().create_task(score())
        self._scoring.add(task)  # (a reference until it is done: the loop keeps only weak ones)
        task.add_done_callback(self._scoring.discard)
