"""The native protocol v1 (`/v1/stream`, docs/protocol.md) as a codec over a session's connection.

Client messages in (`session.start` / `session.resume`, binary audio frames, `playback`, `ack`,
`reply.cancel`, `user.text`, `session.update`, `session.end`) become the connection's session-core calls;
the core's events, reply tokens and audio frames go out as native messages (numbered `n` and kept for a
resume). `transport.realtime_session` is the other codec, OpenAI Realtime's.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from duplexd import events as ev
from duplexd.errors import ErrorCode, ProtocolError
from duplexd.events import Event
from duplexd.transport import protocol
from duplexd.transport.protocol import ServerType
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

if TYPE_CHECKING:
    from duplexd.streaming.conversation import Conversation
    from duplexd.transport.connection import Connection


CONTEXT_TURNS = 64  # finished turns kept to rebuild the LLM's context with new instructions


class NativeCodec:
    numbered = True  # events carry `n` and are kept for a resume

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.instructions = conn.server.config.dialog.system_prompt
        # The conversation as the LLM holds it, (role, text), for a `session.update` of the instructions: the
        # context is rebuilt from these (the newest; the engine's window keeps fewer anyway).
        self._turns: deque[tuple[str, str]] = deque(maxlen=CONTEXT_TURNS)
        self._prompt_stale = False  # new instructions wait for the reply in progress to end

    async def opening(self, now: float) -> None:
        """Before the first message is read: the native protocol waits for `session.start`."""

    def configure(self, conversation: Conversation) -> None:
        """A new conversation: the server's settings stand."""

    def tick(self, now: float) -> None:
        if self._prompt_stale:
            self._rebuild(now)

    def release(self) -> None:
        pass

    def event(self, event: Event) -> None:
        match event:
            case ev.TurnEnded(text=text) if text.strip():
                self._turns.append(("user", text))
            case ev.ReplyDone(text=text) | ev.ReplyInterrupted(heard_text=text) if text.strip():
                self._turns.append(("assistant", text))
            case ev.TurnContinued():  # (the turn and its withdrawn reply: the next turn.ended holds them both)
                if self._turns and self._turns[-1][0] == "assistant":
                    self._turns.pop()
                if self._turns and self._turns[-1][0] == "user":
                    self._turns.pop()
        self.conn.send(protocol.encode_event(event))

    def audio(self, seq: int, pcm: bytes) -> None:
        self.conn.send(protocol.encode_audio_frame(seq, pcm, protocol.BinaryKind.AUDIO_OUT))

    def error(self, code: ErrorCode, message: str, **extra: Any) -> None:
        self.conn.send(protocol.error_message(code, message, **extra))

    def started(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]:
        t, server = self.conn.server.config.transport, self.conn.server
        return {
            "type": ServerType.SESSION_STARTED,
            "session_id": self.conn.session.id if self.conn.session else None,
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
            "resume": {"token": self.conn.resume_token, "grace_s": t.resume_grace_s},
            **(self._settings() if dialog else {}),
            **self._open_datagram(msg),
        }

    def token(self, reply: int, text: str) -> None:
        """A reply token: kept until acknowledged (`transport.tokens`); over the WebSocket once."""
        seq = self.conn.tokens.push(reply, text)
        if self.conn.attached:
            self.conn.send({"type": ServerType.REPLY_DELTA, "reply": reply, "text": text, "token_seq": seq})

    async def on_text(self, data: str, now: float) -> bool:
        msg = protocol.parse_text(data, self.conn.server.limits)
        if isinstance(msg, protocol.SessionStart | protocol.SessionResume):
            if self.conn.session is not None:
                raise ProtocolError(ErrorCode.ALREADY_STARTED, "session already started")
            if isinstance(msg, protocol.SessionResume):
                target = self.conn.server.find_resumable(msg)
                if target.attached:  # its old socket has not failed yet (a half-open TCP connection): drop it
                    if target.link is not None:
                        target.link.abort()
                    async with asyncio.timeout(5):  # (not wait_for: see duplexd/aio.py)
                        await target.link_closed.wait()
                self.conn.resume = (target, msg)
                return True
            await self.conn.start(msg)
            return False
        if self.conn.session is None:
            raise ProtocolError(ErrorCode.NOT_STARTED, f"{type(msg).__name__} before session.start", fatal=True)
        match msg:
            case protocol.Playback(played_ms=played_ms):
                self._on_playback(played_ms, now)
                return False
            case protocol.TokenAck(token_seq=seq, event_seq=events):
                if seq is not None and seq > self.conn.tokens.last_seq:
                    raise ProtocolError(
                        ErrorCode.BAD_ACK,
                        f"ack.token_seq {seq} is past the last token sent ({self.conn.tokens.last_seq})",
                    )
                if events is not None and events > self.conn.events.last:
                    raise ProtocolError(
                        ErrorCode.BAD_ACK,
                        f"ack.event_seq {events} is past the last event sent ({self.conn.events.last})",
                    )
                if seq is not None:
                    self.conn.tokens.ack(seq, now)
                if events is not None:
                    self.conn.events.ack(events)
                return False
            case protocol.ReplyCancel():
                if self.conn.conversation is None or not self.conn.conversation.replying:
                    raise ProtocolError(ErrorCode.NO_REPLY, "reply.cancel with no reply in progress")
                self.conn.dispatch(self.conn.conversation.cancel(), now)
                return False
            case protocol.UserText(text=text):
                self._user_text(text, now)
                return False
            case protocol.SessionUpdate():
                self._update(msg, now)
                return False
        await self._finish()
        self.conn.ended = True
        return True

    def _settings(self) -> dict[str, Any]:
        voice = self.conn.voice
        return {"instructions": self.instructions, "voice": voice is None or not voice.text_only}

    def _user_text(self, text: str, now: float) -> None:
        """A typed turn: it ends the user's turn (with any words spoken in it so far) and is answered."""
        session, conv = self.conn.session, self.conn.conversation
        assert session is not None
        if conv is None:
            raise ProtocolError(ErrorCode.NO_DIALOG, "user.text in a transcription-only session")
        if conv.replying:
            raise ProtocolError(
                ErrorCode.REPLYING, "user.text while the assistant replies: send reply.cancel first, or wait"
            )
        self.conn.dispatch(conv.user_text(text, own_turn_at=session.heard_s), now)
        self.conn.dispatch(conv.respond(session.heard_s), now)

    def _update(self, msg: protocol.SessionUpdate, now: float) -> None:
        """New instructions (the LLM's context is rebuilt with them, after the reply in progress) and/or
        spoken or text-only replies (from the next reply's next piece on)."""
        if self.conn.conversation is None or self.conn.voice is None:
            raise ProtocolError(ErrorCode.NO_DIALOG, "session.update in a transcription-only session")
        if msg.voice is not None:
            self.conn.voice.text_only = not msg.voice
        if msg.instructions is not None and msg.instructions != self.instructions:
            self.instructions = msg.instructions
            self._prompt_stale = True
            self._rebuild(now)
        self.conn.send({"type": ServerType.SESSION_UPDATED, **self._settings()})

    def _rebuild(self, now: float) -> None:
        conv = self.conn.conversation
        if conv is None or conv.replying:
            return  # (the next tick tries again)
        self.conn.dispatch(conv.replace_context(self.instructions, list(self._turns)), now)
        self._prompt_stale = False

    def _on_playback(self, played_ms: float, now: float) -> None:
        sent_ms = 1000 * self.conn.playout.sent / OUTPUT_SAMPLE_RATE
        previous_ms = 1000 * (self.conn.clock.reported or 0) / OUTPUT_SAMPLE_RATE
        if played_ms < 0 or not previous_ms - 1 <= played_ms <= sent_ms + 1:  # 1 ms for the client's rounding
            raise ProtocolError(
                ErrorCode.BAD_PLAYBACK,
                f"playback.played_ms {played_ms:.1f} is outside [{previous_ms:.1f}, {sent_ms:.1f}] "
                "(it must not go back or pass the audio sent)",
            )
        self.conn.played(min(self.conn.playout.sent, round(played_ms * OUTPUT_SAMPLE_RATE / 1000)), now)

    def _open_datagram(self, msg: protocol.SessionStart) -> dict[str, Any]:
        if not msg.datagram or self.conn.conversation is None:
            return {"datagram": None}
        return {"datagram": self.conn.tokens.open_datagram()}

    async def on_binary(self, data: bytes, now: float) -> None:
        session = self.conn.session
        if session is None:
            raise ProtocolError(ErrorCode.NOT_STARTED, "audio before session.start", fatal=True)
        frame = protocol.parse_binary(data, session.sample_rate, self.conn.server.limits)
        if not self.conn.audio_limit.allow(len(frame.pcm) / 2 / session.sample_rate, now):
            raise ProtocolError(
                ErrorCode.RATE_LIMITED,
                f"audio is arriving faster than real time ({self.conn.audio_limit.ahead_s(now):.1f} s ahead, "
                f"{self.conn.audio_limit.burst_s:g} s allowed): frame {frame.seq} dropped",
            )
        chunks = session.accept_frame(frame.seq, frame.pcm, now)
        await self.conn.run_vad(session, chunks)

    async def _finish(self) -> None:
        """session.end: decode what was heard, send the last transcripts, then say goodbye."""
        session = self.conn.session
        assert session is not None
        await self.conn.run_vad(session, session.flush_audio())
        session.end_of_stream()
        await self.conn.server.asr.drained(session)
        self.conn.emit(session.finish_without_pass())
        if self.conn.conversation is not None:
            self.conn.dispatch(self.conn.conversation.end(), time.monotonic())  # (after the drain)
        self.conn.send({"type": ServerType.SESSION_ENDED, "session_id": session.id})
