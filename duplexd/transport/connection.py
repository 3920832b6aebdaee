"""One session's connection: the handle of its session cores, and its current WebSocket.

A reader feeds the session cores (`Session`, `Conversation`); a sender drains a bounded queue; in a
conversation a pacer sends reply audio as the client plays it, and with the datagram path a timer repeats
unacknowledged tokens. Its codec speaks the protocol: `transport.native` (protocol v1) or
`transport.realtime_session` (OpenAI Realtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from duplexd.errors import ErrorCode, Overloaded, ProtocolError
from duplexd.events import (
    Event,
    ReplySpeculation,
)
from duplexd.streaming import conversation as cv
from duplexd.streaming.clock import PlaybackClock
from duplexd.streaming.playout import Playout
from duplexd.streaming.session import Session
from duplexd.transport import protocol
from duplexd.transport.limits import AudioRateLimit
from duplexd.transport.protocol import ServerType
from duplexd.transport.resume import EventLog, SentAudio, hand_over, new_resume_token, refusal
from duplexd.transport.tokens import ReplyTokens
from duplexd.transport.voice import VoiceLoop
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

if TYPE_CHECKING:
    from duplexd.transport.server import Server

log = logging.getLogger(__name__)

# RFC 6455 close codes.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_WILL_RESUME = 4000  # a client closing with this code keeps its session for `session.resume`

_FATAL_CLOSE = {
    ErrorCode.UNSUPPORTED_VERSION: CLOSE_PROTOCOL_ERROR,
    ErrorCode.NOT_STARTED: CLOSE_PROTOCOL_ERROR,
    ErrorCode.BAD_SAMPLE_RATE: CLOSE_UNSUPPORTED_DATA,
    ErrorCode.TOO_MANY_ERRORS: CLOSE_POLICY,
    ErrorCode.RESUME_REFUSED: CLOSE_POLICY,
}


class _Closing(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Codec(Protocol):
    """A protocol spoken on a session's socket, over its connection: what a client message does, and how the
    session core's events, reply tokens, audio and errors are written."""

    numbered: bool  # events are numbered and kept for a resume
    reports_playback: bool  # the client reports its playback

    async def opening(self) -> None: ...
    async def on_text(self, data: str) -> bool: ...  # True: the connection's reading is over
    async def on_binary(self, data: bytes) -> None: ...
    def started(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]: ...
    def configure(self, conversation: cv.Conversation) -> None: ...
    def event(self, event: Event) -> None: ...
    def token(self, reply: int, text: str) -> None: ...
    def audio(self, seq: int, pcm: bytes) -> None: ...
    def error(self, code: ErrorCode, message: str, **extra: Any) -> None: ...
    def tick(self) -> None: ...
    def release(self) -> None: ...


class Connection:
    """A session's handle and its current WebSocket: a reader that feeds the session cores, a sender that
    drains a bounded queue, (in a conversation) a pacer that sends reply audio as the client plays it, and
    (with the datagram path) a timer that repeats unacknowledged tokens. What the messages mean is its
    codec's: the native protocol (`native.NativeCodec`) or OpenAI Realtime's (`realtime_session.RealtimeCodec`).

    The handle outlives a connection that drops: it waits `resume_grace_s` for `session.resume` on a new
    WebSocket (`run(resume=...)`), keeping the reply tokens the client has not acknowledged and the reply
    audio it may not have received; everything else it would have sent waits in the bounded queue."""

    def __init__(self, server: Server, ws: ServerConnection, codec: Callable[[Connection], Codec]) -> None:
        """`codec`: the protocol spoken on the socket, built for this connection (`native.NativeCodec`, or
        `realtime_session.RealtimeCodec`)."""
        self.server = server
        self.ws = ws
        self.attached = True
        self.ended = False  # session.end, a fatal error, or a refusal: nothing to resume
        self.resume: tuple[Connection, protocol.SessionResume] | None = None  # set on a resuming connection
        self.resume_token = new_resume_token()
        self._expiry: asyncio.TimerHandle | None = None
        self._lost_while_detached = False
        self._slow_close: asyncio.Task[None] | None = None  # closing a client that does not read
        self.link_closed = asyncio.Event()
        self.session: Session | None = None
        self.conversation: cv.Conversation | None = None
        self.dialog_sid: int | None = None
        self.errors = 0
        self._out: asyncio.Queue[str | bytes | None] = asyncio.Queue(maxsize=server.config.transport.outbound_queue)
        self._overflowed = False
        t = server.config.transport
        self.playout = Playout(
            OUTPUT_SAMPLE_RATE * t.audio_frame_ms // 1000, OUTPUT_SAMPLE_RATE * t.audio_lead_ms // 1000
        )
        self._audio_wake = asyncio.Event()
        self.tokens = ReplyTokens(t, server.datagram)
        self.sent_audio = SentAudio(int(t.resume_audio_s * OUTPUT_SAMPLE_RATE))
        self.voice: VoiceLoop | None = None  # the conversation at work (a session with dialog)
        self.audio_limit = AudioRateLimit(server.config.security.audio_burst_s)
        self.events = EventLog(t.resume_events)  # (numbered: all but frame.ack)
        self.codec = codec(self)
        self.clock = PlaybackClock(time.monotonic(), reports=self.codec.reports_playback)

    async def run(self, resume: protocol.SessionResume | None = None) -> None:
        try:
            if resume is not None:
                await self._resumed(resume)
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(self._send_loop())
                timers = [tg.create_task(self._pace_loop()), tg.create_task(self.tokens.run())]
                try:
                    await self.codec.opening()
                    await self._read_loop()
                    self.send(None)  # let the sender finish what is queued, then stop
                except _Closing as closing:
                    self.ended = True
                    self.send(None)
                    await sender
                    await self.ws.close(closing.code, closing.reason)
                finally:
                    for task in timers:
                        task.cancel()
        except* ConnectionClosed:
            pass

    @property
    def busy_replying(self) -> bool:
        return self.conversation is not None and self.conversation.replying

    async def flush(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until everything queued for the client has been written."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._out.empty():
                break
            await asyncio.sleep(0.01)

    def end_link(self) -> None:
        """The WebSocket is gone: end the session, or keep it for a resume if the link merely dropped."""
        self.attached = False
        self.link_closed.set()
        if self.session is None:
            return
        grace = self.server.config.transport.resume_grace_s if self.codec.numbered else 0.0  # (Realtime: no resume)
        close = self.ws.protocol.close_rcvd  # (None: the link failed without a closing handshake)
        dropped = close is None or close.code == CLOSE_WILL_RESUME
        if self.ended or self._overflowed or not dropped or grace <= 0:
            self.release()
            return
        self.server.counters["detached"] += 1
        self.session.note_reply_audio(False, time.monotonic())  # nobody is listening: not a server lag
        self._expiry = asyncio.get_running_loop().call_later(grace, self._expire)
        log.info(
            "session %s detached; resumable for %.0f s",
            self.session.id,
            grace,
            extra={"event": "session.detached", "session": self.session.id, "token_seq": self.tokens.last_seq},
        )

    def _expire(self) -> None:
        if not self.attached and self.session is not None:
            self.server.counters["expired"] += 1
            log.info("session %s was not resumed", self.session.id, extra={"event": "session.expired"})
            self.release()

    async def _resumed(self, msg: protocol.SessionResume) -> None:
        """Take over from the previous connection: tokens the client has not acknowledged, the audio it has
        not received, then what was queued for it meanwhile."""
        session = self.session
        if session is None or self._lost_while_detached:
            return await self._refuse_resume("the session has ended")
        if (why := refusal(msg, self.tokens.sender, self.sent_audio)) is not None:
            return await self._refuse_resume(why)
        now = time.monotonic()
        queued: list[str | bytes | None] = []
        while not self._out.empty():
            queued.append(self._out.get_nowait())
        plan = hand_over(msg, session.id, self.tokens.sender, self.sent_audio, self.events, queued, now)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.attached = True
        self.link_closed = asyncio.Event()
        self.server.counters["resumed"] += 1
        await self.ws.send(protocol.dumps(plan.resumed))
        for frame in plan.frames:
            await self.ws.send(frame)
        for item in plan.queued:
            self.send(item)
        # The client plays from where its copy ended; until it reports, assume real time from now.
        self.clock.resume(now)
        self._audio_wake.set()
        log.info(
            "session %s resumed at token %d, %.0f ms of audio",
            session.id,
            msg.token_seq,
            msg.audio_ms,
            extra={"event": "session.resumed", "session": session.id, "tokens_resent": len(plan.resumed["tokens"])},
        )

    async def _refuse_resume(self, message: str) -> None:
        await self.ws.send(protocol.dumps(protocol.error_message(ErrorCode.RESUME_REFUSED, message)))
        await self.ws.close(CLOSE_POLICY, ErrorCode.RESUME_REFUSED.value)

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

    # outbound

    def send(self, msg: dict[str, Any] | str | bytes | None) -> None:
        if self._overflowed:
            return
        if isinstance(msg, dict) and self.codec.numbered and msg.get("type") != ServerType.FRAME_ACK:
            # Numbered and kept until acknowledged, so a resume can replay what a dead socket swallowed.
            msg = self.events.add(msg)
        try:
            self._out.put_nowait(msg if msg is None or isinstance(msg, str | bytes) else protocol.dumps(msg))
        except asyncio.QueueFull:
            if not self.attached:  # too much happened while the client was away: it cannot resume losslessly
                self._lost_while_detached = True
                self._overflowed = True
                self._expire()
                return
            # The client does not read fast enough; rather than buffer without bound, end the session.
            self._overflowed = True
            sid = self.session.id if self.session else None
            log.warning("closing slow client %s", sid, extra={"event": "session.slow_client", "session": sid})
            self.server.counters["slow_consumers"] += 1
            self._slow_close = asyncio.get_running_loop().create_task(self._close_slow())

    async def _close_slow(self) -> None:
        """Close 1008 `slow_consumer` (the frame queues behind what the client has not read; a client that
        reads again sees it), and drop the connection if it does not answer within 2 s."""
        with contextlib.suppress(TimeoutError, ConnectionClosed):
            await asyncio.wait_for(self.ws.close(CLOSE_POLICY, ErrorCode.SLOW_CONSUMER.value), 2.0)
        if self.ws.transport is not None:
            self.ws.transport.abort()

    @property
    def outbound_bytes(self) -> int:
        """What waits to be written to this client: the queue, and the socket's user-space buffer."""
        queued = sum(len(m) for m in list(self._out._queue) if m is not None)  # type: ignore[attr-defined]
        transport = self.ws.transport
        return queued + (transport.get_write_buffer_size() if transport is not None else 0)

    def emit(self, events: list[Event]) -> None:
        """Events of the session core (VAD, ASR): to the client, and into the conversation."""
        for event in events:
            self.codec.event(event)
        if self.conversation is not None:
            self.dispatch(self.conversation.observe(events))
            self._tick()

    async def _send_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(msg)

    # the conversation (`transport.voice`)

    def _tick(self) -> None:
        if self.voice is not None:
            self.voice.tick(time.monotonic())
        self.codec.tick()

    def dispatch(self, outputs: list[cv.Output]) -> None:
        """Carry out the conversation's commands; send its events."""
        if self.voice is not None:
            self.voice.dispatch(outputs, time.monotonic())

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.reply_text(reply, texts, done, time.monotonic())

    def on_p_end(self, p: float, version: int) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.p_end(p, version, time.monotonic())  # (it ticks the conversation)
            self.codec.tick()

    def on_draft(self, texts: list[str]) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.draft(texts, time.monotonic())

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:  # DialogClient
        self.codec.event(ReplySpeculation(reply, drafts, hit, draft_tokens))

    async def _pace_loop(self) -> None:
        frame_s = self.server.config.transport.audio_frame_ms / 1000
        while True:
            voice = self.voice
            if voice is None or not voice.pacing:
                self._audio_wake.clear()
                await self._audio_wake.wait()
                continue
            voice.pace(time.monotonic())
            self._audio_wake.clear()
            try:
                await asyncio.wait_for(self._audio_wake.wait(), frame_s / 2)
            except TimeoutError:
                pass

    # inbound

    async def _read_loop(self) -> None:
        idle_s = self.server.config.security.idle_timeout_s or None
        while True:
            try:
                message = await asyncio.wait_for(self.ws.recv(), idle_s)
            except TimeoutError:
                self.ended = True
                self.codec.error(ErrorCode.IDLE_TIMEOUT, f"nothing received for {idle_s:.0f} s")
                raise _Closing(CLOSE_POLICY, ErrorCode.IDLE_TIMEOUT.value) from None
            except ConnectionClosedOK:
                return
            try:
                if isinstance(message, str):
                    done = await self.codec.on_text(message)
                    if done:
                        return
                else:
                    await self.codec.on_binary(message)
            except ProtocolError as exc:
                self._on_protocol_error(exc)
            except Overloaded as exc:
                self.ended = True
                extra = {} if exc.retry_after_ms is None else {"retry_after_ms": exc.retry_after_ms}
                self.codec.error(ErrorCode.OVERLOADED, str(exc), **extra)
                raise _Closing(CLOSE_TRY_AGAIN_LATER, "overloaded") from None

    def _on_protocol_error(self, exc: ProtocolError) -> None:
        self.server.counters["protocol_errors"] += 1
        self.errors += 1
        self.codec.error(exc.code, exc.message)
        if exc.fatal:
            raise _Closing(_FATAL_CLOSE.get(exc.code, CLOSE_PROTOCOL_ERROR), exc.code.value)
        if self.errors >= self.server.config.transport.max_errors:
            self.codec.error(ErrorCode.TOO_MANY_ERRORS, "too many protocol errors")
            raise _Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

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
                wake=self._audio_wake.set,
                listening=lambda: self.attached,
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
        return cv.Conversation(
            config.turn,
            config.tts,
            speculate=spec.enabled,
            drafts=spec.drafts_per_session,
            llm_p_end=dialog is None or dialog.engine.reports_p_end,
        )

    async def run_vad(self, session: Session, chunks: Any) -> None:
        probs = await self.server.vad.probabilities(session.vad_stream, chunks)
        self.emit(session.apply_vad(chunks, probs, time.monotonic()))
        if session.wants_pass():
            self.server.asr.notify()
