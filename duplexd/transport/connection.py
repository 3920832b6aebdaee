"""One session's connection: the handle of its session cores, and its current WebSocket.

A reader feeds the session cores (`Session`, `Conversation`); a sender drains a bounded queue; in a
conversation a pacer sends reply audio as the client plays it, and with the datagram path a timer repeats
unacknowledged tokens. The native protocol is spoken here; `transport.realtime_session` speaks OpenAI's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

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
from duplexd.transport.resume import EventLog, SentAudio, hand_over, new_resume_token
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


class Connection:
    """A session's handle and its current WebSocket: a reader that feeds the session cores, a sender that
    drains a bounded queue, (in a conversation) a pacer that sends reply audio as the client plays it, and
    (with the datagram path) a timer that repeats unacknowledged tokens.

    The handle outlives a connection that drops: it waits `resume_grace_s` for `session.resume` on a new
    WebSocket (`run(resume=...)`), keeping the reply tokens the client has not acknowledged and the reply
    audio it may not have received; everything else it would have sent waits in the bounded queue."""

    numbered = True  # native events carry `n` and are kept for a resume (Realtime has no resume)
    reports_playback = True  # the client says what it has played (`playback`); Realtime clients never do

    def __init__(self, server: Server, ws: ServerConnection) -> None:
        self.server = server
        self.ws = ws
        self.attached = True
        self.ended = False  # session.end, a fatal error, or a refusal: nothing to resume
        self.resume: tuple[Connection, protocol.SessionResume] | None = None  # set on a resuming connection
        self.resume_token = new_resume_token()
        self._expiry: asyncio.TimerHandle | None = None
        self._lost_while_detached = False
        self._slow_close: asyncio.Task[None] | None = None  # closing a client that does not read
        self._link_closed = asyncio.Event()
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
        self.clock = PlaybackClock(time.monotonic(), reports=self.reports_playback)
        self.tokens = ReplyTokens(t, server.datagram)
        self.sent_audio = SentAudio(int(t.resume_audio_s * OUTPUT_SAMPLE_RATE))
        self.voice: VoiceLoop | None = None  # the conversation at work (a session with dialog)
        self.audio_limit = AudioRateLimit(server.config.security.audio_burst_s)
        self.events = EventLog(t.resume_events)  # (numbered: all but frame.ack)

    async def run(self, resume: protocol.SessionResume | None = None) -> None:
        try:
            if resume is not None:
                await self._resumed(resume)
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(self._send_loop())
                timers = [tg.create_task(self._pace_loop()), tg.create_task(self.tokens.run())]
                try:
                    await self._opening()
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

    async def _opening(self) -> None:
        """Before the first message is read (the native protocol waits for `session.start`)."""

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
        self._link_closed.set()
        if self.session is None:
            return
        grace = self.server.config.transport.resume_grace_s if self.numbered else 0.0  # (Realtime: no resume)
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
        now = time.monotonic()
        queued: list[str | bytes | None] = []
        while not self._out.empty():
            queued.append(self._out.get_nowait())
        plan = hand_over(msg, session.id, self.tokens.sender, self.sent_audio, self.events, queued, now)
        if isinstance(plan, str):
            for item in queued:  # (back as they were: the session goes on waiting for a resume)
                self._out.put_nowait(item)
            return await self._refuse_resume(plan)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.attached = True
        self._link_closed = asyncio.Event()
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
        if isinstance(msg, dict) and self.numbered and msg.get("type") != ServerType.FRAME_ACK:
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

    # What goes out, in the native protocol (`_RealtimeConnection` speaks OpenAI's instead).

    def _out_event(self, event: Event) -> None:
        self.send(protocol.encode_event(event))

    def _out_audio(self, seq: int, pcm: bytes) -> None:
        self.send(protocol.encode_audio_frame(seq, pcm, protocol.BinaryKind.AUDIO_OUT))

    def _out_error(self, code: ErrorCode, message: str, **extra: Any) -> None:
        self.send(protocol.error_message(code, message, **extra))

    def _started_message(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]:
        t, server = self.server.config.transport, self.server
        return {
            "type": ServerType.SESSION_STARTED,
            "session_id": self.session.id if self.session else None,
            "node": t.node or None,
            "version": protocol.PROTOCOL_VERSION,
            "sample_rate": msg.sample_rate,
            "dialog": dialog,
            "output": {
                "sample_rate": OUTPUT_SAMPLE_RATE,
                "format": "pcm16",
                "frame_ms": t.audio_frame_ms,
                "lead_ms": t.audio_lead_ms,
            },
            "limits": {
                "max_message_bytes": t.max_message_bytes,
                "max_frame_ms": t.max_frame_ms,
                "ack_interval_ms": t.ack_interval_ms,
            },
            "models": server.models(),
            "resume": {"token": self.resume_token, "grace_s": t.resume_grace_s},
            **self._open_datagram(msg),
        }

    def emit(self, events: list[Event]) -> None:
        """Events of the session core (VAD, ASR): to the client, and into the conversation."""
        for event in events:
            self._out_event(event)
        if self.conversation is not None:
            self._dispatch(self.conversation.observe(events))
            self._tick()

    async def _send_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(msg)

    def _send_token(self, reply: int, text: str) -> None:
        """A reply token: kept until acknowledged (`transport.tokens`); over the WebSocket once."""
        seq = self.tokens.push(reply, text)
        if self.attached:
            self.send({"type": ServerType.REPLY_DELTA, "reply": reply, "text": text, "token_seq": seq})

    # the conversation (`transport.voice`)

    def _tick(self) -> None:
        if self.voice is not None:
            self.voice.tick(time.monotonic())

    def _dispatch(self, outputs: list[cv.Output]) -> None:
        """Carry out the conversation's commands; send its events."""
        if self.voice is not None:
            self.voice.dispatch(outputs, time.monotonic())

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.reply_text(reply, texts, done, time.monotonic())

    def on_p_end(self, p: float, version: int) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.p_end(p, version, time.monotonic())

    def on_draft(self, texts: list[str]) -> None:  # DialogClient
        if self.voice is not None:
            self.voice.draft(texts, time.monotonic())

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:  # DialogClient
        self._out_event(ReplySpeculation(reply, drafts, hit, draft_tokens))

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
                self._out_error(ErrorCode.IDLE_TIMEOUT, f"nothing received for {idle_s:.0f} s")
                raise _Closing(CLOSE_POLICY, ErrorCode.IDLE_TIMEOUT.value) from None
            except ConnectionClosedOK:
                return
            try:
                if isinstance(message, str):
                    done = await self._on_text(message)
                    if done:
                        return
                else:
                    await self._on_audio(message)
            except ProtocolError as exc:
                self._on_protocol_error(exc)
            except Overloaded as exc:
                self.ended = True
                extra = {} if exc.retry_after_ms is None else {"retry_after_ms": exc.retry_after_ms}
                self._out_error(ErrorCode.OVERLOADED, str(exc), **extra)
                raise _Closing(CLOSE_TRY_AGAIN_LATER, "overloaded") from None

    def _on_protocol_error(self, exc: ProtocolError) -> None:
        self.server.counters["protocol_errors"] += 1
        self.errors += 1
        self._out_error(exc.code, exc.message)
        if exc.fatal:
            raise _Closing(_FATAL_CLOSE.get(exc.code, CLOSE_PROTOCOL_ERROR), exc.code.value)
        if self.errors >= self.server.config.transport.max_errors:
            self._out_error(ErrorCode.TOO_MANY_ERRORS, "too many protocol errors")
            raise _Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

    async def _on_text(self, data: str) -> bool:
        msg = protocol.parse_text(data, self.server.limits)
        if isinstance(msg, protocol.SessionStart | protocol.SessionResume):
            if self.session is not None:
                raise ProtocolError(ErrorCode.ALREADY_STARTED, "session already started")
            if isinstance(msg, protocol.SessionResume):
                target = self.server.find_resumable(msg)
                if target.attached:  # its old socket has not failed yet (a half-open TCP connection): drop it
                    if target.ws.transport is not None:
                        target.ws.transport.abort()
                    await asyncio.wait_for(target._link_closed.wait(), 5)
                self.resume = (target, msg)
                return True
            await self._start(msg)
            return False
        if self.session is None:
            raise ProtocolError(ErrorCode.NOT_STARTED, f"{type(msg).__name__} before session.start", fatal=True)
        match msg:
            case protocol.Playback(played_ms=played_ms):
                self._on_playback(played_ms)
                return False
            case protocol.TokenAck(token_seq=seq, event_seq=events):
                if seq is not None and seq > self.tokens.last_seq:
                    raise ProtocolError(
                        ErrorCode.BAD_ACK, f"ack.token_seq {seq} is past the last token sent ({self.tokens.last_seq})"
                    )
                if events is not None and events > self.events.last:
                    raise ProtocolError(
                        ErrorCode.BAD_ACK, f"ack.event_seq {events} is past the last event sent ({self.events.last})"
                    )
                if seq is not None:
                    self.tokens.ack(seq, time.monotonic())
                if events is not None:
                    self.events.ack(events)
                return False
            case protocol.ReplyCancel():
                if self.conversation is None or not self.conversation.replying:
                    raise ProtocolError(ErrorCode.NO_REPLY, "reply.cancel with no reply in progress")
                self._dispatch(self.conversation.cancel())
                return False
        await self._finish()
        self.ended = True
        return True

    def _on_playback(self, played_ms: float) -> None:
        sent_ms = 1000 * self.playout.sent / OUTPUT_SAMPLE_RATE
        previous_ms = 1000 * (self.clock.reported or 0) / OUTPUT_SAMPLE_RATE
        if played_ms < 0 or not previous_ms - 1 <= played_ms <= sent_ms + 1:  # 1 ms for the client's rounding
            raise ProtocolError(
                ErrorCode.BAD_PLAYBACK,
                f"playback.played_ms {played_ms:.1f} is outside [{previous_ms:.1f}, {sent_ms:.1f}] "
                "(it must not go back or pass the audio sent)",
            )
        samples = min(self.playout.sent, round(played_ms * OUTPUT_SAMPLE_RATE / 1000))
        self.clock.report(samples, time.monotonic())
        self.sent_audio.played(samples)
        if self.conversation is not None:
            self._dispatch(self.conversation.played(samples))

    async def _start(self, msg: protocol.SessionStart) -> None:
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
                send_event=self._out_event,
                send_token=self._send_token,
                send_audio=self._out_audio,
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
        self.send(self._started_message(msg, dialog))

    def _new_conversation(self) -> cv.Conversation:
        spec, config, dialog = self.server.config.speculation, self.server.config, self.server.dialog
        return cv.Conversation(
            config.turn,
            config.tts,
            speculate=spec.enabled,
            drafts=spec.drafts_per_session,
            llm_p_end=dialog is None or dialog.engine.reports_p_end,
        )

    def _open_datagram(self, msg: protocol.SessionStart) -> dict[str, Any]:
        if not msg.datagram or self.conversation is None:
            return {"datagram": None}
        return {"datagram": self.tokens.open_datagram()}

    async def _on_audio(self, data: bytes) -> None:
        session = self.session
        if session is None:
            raise ProtocolError(ErrorCode.NOT_STARTED, "audio before session.start", fatal=True)
        frame = protocol.parse_binary(data, session.sample_rate, self.server.limits)
        now = time.monotonic()
        if not self.audio_limit.allow(len(frame.pcm) / 2 / session.sample_rate, now):
            raise ProtocolError(
                ErrorCode.RATE_LIMITED,
                f"audio is arriving faster than real time ({self.audio_limit.ahead_s(now):.1f} s ahead, "
                f"{self.audio_limit.burst_s:g} s allowed): frame {frame.seq} dropped",
            )
        chunks = session.accept_frame(frame.seq, frame.pcm, now)
        await self._run_vad(session, chunks)

    async def _run_vad(self, session: Session, chunks: Any) -> None:
        probs = await self.server.vad.probabilities(session.vad_stream, chunks)
        self.emit(session.apply_vad(chunks, probs, time.monotonic()))
        if session.wants_pass():
            self.server.asr.notify()

    async def _finish(self) -> None:
        """session.end: decode what was heard, send the last transcripts, then say goodbye."""
        session = self.session
        assert session is not None
        await self._run_vad(session, session.flush_audio())
        session.end_of_stream()
        await self.server.asr.drained(session)
        self.emit(session.finish_without_pass())
        if self.conversation is not None:
            self._dispatch(self.conversation.end())
        self.send({"type": ServerType.SESSION_ENDED, "session_id": session.id})
