"""`/v1/realtime`: an OpenAI Realtime session on the same session core as `/v1/stream`.

`RealtimeCodec` is the codec of a `Connection` (the same `Session`, `Conversation`, voice loop, workers,
pacing, admission and limits as `native.NativeCodec`'s): it reads OpenAI client events
(`transport.realtime`) and writes OpenAI server events (`transport.realtime_out`) instead of the native
ones; `input_audio_buffer.append` feeds 24 kHz PCM16 frames into the Session (VAD, streaming ASR).
Out-of-band responses are `transport.realtime_oob`'s.

Audio goes out paced as on the native path (at most `audio_lead_ms` ahead of real-time playback: a Realtime
client sends no playback reports); `conversation.item.truncate` tells the server where playback stopped, for
the response in progress or the last one (its audio may still play after `response.done`).

The conversation's items (user turns, typed messages, responses) are kept (`realtime_items.Items`) for
`conversation.item.retrieve`, `.delete` and `.truncate`. Fields duplexd accepts and does not honour are logged
once per update (never an `error`: clients end their session on errors OpenAI would not send).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from duplexd.commands import SetTools
from duplexd.errors import ErrorCode
from duplexd.events import (
    ErrorRaised,
    Event,
    ReplyDone,
    ReplyInterrupted,
    ReplyStarted,
    ReplyToolCalled,
    SpeechStarted,
    SpeechStopped,
    TranscriptUpdated,
    TurnEnded,
    UtteranceFinalized,
)
from duplexd.streaming import conversation as cv
from duplexd.transport import protocol
from duplexd.transport import realtime as rt
from duplexd.transport.connection import Connection
from duplexd.transport.outbox import CLOSE_POLICY, Closing
from duplexd.transport.realtime_context import LlmContext
from duplexd.transport.realtime_items import Items, chat_tool_choice, function_specs, render
from duplexd.transport.realtime_mcp import SessionMcp
from duplexd.transport.realtime_oob import OutOfBand
from duplexd.transport.realtime_out import (
    Ids,
    Pending,
    RealtimeOut,
    Response,
    VadDefaults,
    error_event,
    session_object,
)

log = logging.getLogger(__name__)

COMMIT_SILENCE_S = 0.7  # `input_audio_buffer.commit`: silence appended so the recognizer finalizes the words
# Errors that answer a race with the server (a cancel as the response ends, a response.create as one starts):
# clients ignore them, and they do not count towards `max_errors` (a long session has many barge-ins).
RACES = frozenset(
    {"response_cancel_not_active", "conversation_already_has_active_response", "input_audio_buffer_commit_empty"}
)
# semantic_vad `eagerness`: factors on the server's end-of-turn silences (min: a complete sentence, max: not)
EAGERNESS = {"high": (0.5, 0.5), "medium": (1.0, 1.0), "auto": (1.0, 1.0), "low": (1.5, 2.0)}


class RealtimeCodec:
    numbered = False

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        server = conn.server
        self.ids = Ids("")
        self.settings = rt.SessionSettings(instructions=server.config.dialog.system_prompt)
        self._commit_pending = False
        self._in_seq = 0
        self.items = Items()  # the conversation as the client sees it (retrieve, delete, truncate, context)
        self.out = RealtimeOut(self.ids, self.items, self.settings, "conv_-")  # (its ids once the session starts)
        self._idle_since: float | None = None  # (idle_timeout_ms) since the last response played out
        self.context = LlmContext(conn, self.items, self.out, self.settings)  # (the LLM's follows the items)
        self._oob: OutOfBand | None = None  # the responses outside the conversation (a dialog model only)
        self._vad_defaults = VadDefaults.of(server.config)
        self.mcp: SessionMcp | None = None  # the session's own `mcp` tools' servers

    def _mcp(self) -> SessionMcp:
        if self.mcp is None:
            session = self.conn.session
            self.mcp = SessionMcp(
                session.id if session is not None else "-",
                self.conn.server.engines_tools,
                self.out,
                self.conn.send,
                self._give_tools,
            )
        return self.mcp

    def _give_tools(self) -> None:
        """The session's tools to the model: its functions, and its MCP servers' tools (once listed)."""
        specs = function_specs(self.settings.tools) + (self.mcp.specs() if self.mcp is not None else ())
        self.conn.dispatch([SetTools(specs, chat_tool_choice(self.settings.tool_choice))], time.monotonic())

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def opening(self, now: float) -> None:
        # (a full server raises Overloaded: the connection answers it as it does for a native session.start)
        await self.conn.start(protocol.SessionStart(version=1, sample_rate=rt.AUDIO_RATE, dialog=True))
        if self.conn.conversation is None:
            self._rt_error(rt.RealtimeError("server_error", "This server runs without a dialog model."))
            self.conn.ended = True
            raise Closing(CLOSE_POLICY, "no dialog model")

    def started(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]:
        assert self.conn.session is not None
        self.ids = self.out.ids = Ids(self.conn.session.id)
        self.out.conversation_id = f"conv_{self.conn.session.id}"
        return {
            "type": "session.created",
            "event_id": self.ids.new("event"),
            "session": session_object(self.conn.session.id, self.settings, self._vad_defaults),
        }

    def configure(self, conversation: cv.Conversation) -> None:
        conversation.continue_turns = False  # (OpenAI's items: words after a turn's end are a new one)
        self._apply_turn_detection(conversation, self.settings.turn_detection)

    def release(self) -> None:
        if self.mcp is not None:
            self.mcp.close()  # (its MCP connections)
        if self._oob is not None:
            self._oob.close()  # (their dialog sessions: the client is gone)

    # -- client events -----------------------------------------------------------------------------------

    async def on_binary(self, data: bytes, now: float) -> None:
        self._client_error(rt.RealtimeError("invalid_event", "Binary messages are not part of this protocol."))

    async def on_text(self, data: str, now: float) -> bool:
        try:
            event, event_id = rt.parse(data)
            await self._handle_event(event, event_id, now)
        except rt.RealtimeError as exc:
            self._client_error(exc)
        return False

    def _client_error(self, exc: rt.RealtimeError) -> None:
        self._rt_error(exc)
        if exc.code in RACES:
            return  # (not a client's fault: it could not know)
        self.conn.server.counters["protocol_errors"] += 1
        self.conn.errors += 1
        if self.conn.errors >= self.conn.server.config.transport.max_errors:
            self._rt_error(rt.RealtimeError(ErrorCode.TOO_MANY_ERRORS.value, "Too many invalid events."))
            raise Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

    def error(self, code: ErrorCode, message: str, **extra: Any) -> None:
        """The connection's own errors (overloaded, shutting down, idle), as a Realtime `error` event."""
        retry = extra.get("retry_after_ms")
        text = message if retry is None else f"{message} (retry after {retry} ms)"
        self._rt_error(rt.RealtimeError(code.value, text), kind="server_error")

    def _rt_error(self, exc: rt.RealtimeError, kind: str = "invalid_request_error") -> None:
        self.conn.send(error_event(self.ids, exc, kind))

    async def _handle_event(self, event: rt.ClientEvent, event_id: str | None, now: float) -> None:
        session, conv = self.conn.session, self.conn.conversation
        assert session is not None and conv is not None
        match event:
            case rt.AudioAppend(pcm=pcm):
                await self._append(pcm, now)
            case rt.SessionUpdate():
                await self._update(event, event_id, now)
            case rt.AudioCommit():
                if conv.auto_turns and self.out.user_item is None:  # (with VAD: the server committed it already)
                    raise rt.RealtimeError(
                        "input_audio_buffer_commit_empty",
                        "Error committing input audio buffer: no speech since the last commit.",
                        event_id=event_id,
                    )
                self._commit_pending = True
                silence = np.zeros(int(COMMIT_SILENCE_S * rt.AUDIO_RATE), "<i2").tobytes()
                await self._append(silence, now, limited=False)  # (ours, not the client's: not rate limited)
                self._maybe_commit(now)
            case rt.AudioClear():
                conv.clear(session.stream_s)
                self.out.user_item = None
                self._ev("input_audio_buffer.cleared")
            case rt.OutputAudioClear():
                r = self.out.response
                if r is not None:
                    self.conn.dispatch(conv.cancel(), now)
                    self._ev("output_audio_buffer.cleared", response_id=r.id)
            case rt.ItemCreate():
                self.context.create_item(event, event_id, now)
            case rt.ResponseCreate():
                await self._respond(event, event_id, now)
            case rt.ResponseCancel(response_id=rid) if rid is not None and self._oob is not None and rid in self._oob:
                self._oob.cancel(rid)
            case rt.ResponseCancel(response_id=rid):
                r = self.out.response
                if r is None or (rid is not None and rid != r.id):
                    raise rt.RealtimeError(
                        "response_cancel_not_active",
                        "Cancellation failed: no active response found",
                        event_id=event_id,
                    )
                self.conn.dispatch(conv.cancel(), now)
            case rt.ItemTruncate(item_id=item_id, content_index=index, audio_end_ms=end_ms):
                self.context.truncate(item_id, index, end_ms, event_id, now)
            case rt.ItemRetrieve(item_id=item_id):
                item = self.items.get(item_id)
                if item is None:
                    raise rt.RealtimeError(
                        "item_retrieve_invalid_item_id",
                        f"Item with item_id not found: {item_id[:64]}",
                        param="item_id",
                        event_id=event_id,
                    )
                self._ev("conversation.item.retrieved", item=item)
            case rt.ItemDelete(item_id=item_id):
                self.context.delete(item_id, event_id, now)

    async def _respond(self, event: rt.ResponseCreate, event_id: str | None, now: float) -> None:
        session, conv = self.conn.session, self.conn.conversation
        assert session is not None and conv is not None
        if event.ignored:
            log.info("session %s: response.create: not honoured here: %s", session.id, ", ".join(event.ignored))
        max_tokens = self.settings.max_output_tokens if event.max_output_tokens is False else event.max_output_tokens
        assert max_tokens is None or isinstance(max_tokens, int)
        if event.out_of_band:
            await self._out_of_band(event, max_tokens, event_id)
            return
        self.context.refuse_while_responding("creating a new one", event_id, now)
        instructions = self.settings.instructions if event.instructions is None else event.instructions
        if self.context.stale or instructions != self.context.prompt:
            self.context.rebuild(instructions, now)  # (this response's own: the session's come back after it)
        self.out.next = Pending(event.output_modalities, event.metadata, max_tokens)
        self.conn.dispatch(conv.respond(session.heard_s, max_tokens=max_tokens), now)

    async def _out_of_band(self, event: rt.ResponseCreate, max_tokens: int | None, event_id: str | None) -> None:
        """`conversation: "none"` or `input` items: a response outside the conversation (`realtime_oob`), with
        the conversation's items, or the `input` given, as its context."""
        server = self.conn.server
        assert server.dialog is not None
        items: list[dict[str, Any]] = self.items.values()
        if event.input is not None:
            items = []
            for given in event.input:
                if isinstance(given, str):
                    if given not in self.items:
                        raise rt.RealtimeError(
                            "invalid_value",
                            f"Item with id {given[:64]} not found in the conversation.",
                            param="response.input",
                            event_id=event_id,
                        )
                    items.append(self.items.get(given))
                else:
                    items.append({**given.item, "id": given.item_id or self.ids.new("item")})
        instructions = self.settings.instructions if event.instructions is None else event.instructions
        system, turns = render(items, instructions)
        r = Response(self.ids.new("resp"), self.ids.new("item"), 0, ("text",), event.metadata, max_tokens)
        if self._oob is None:
            self._oob = OutOfBand(server.dialog, self.out, self.conn.send)
        await self._oob.start(
            r, system, turns, self._rate_limits(max_tokens), alive=lambda: self.conn.session is not None
        )

    async def _append(self, pcm: bytes, now: float, *, limited: bool = True) -> None:
        session = self.conn.session
        assert session is not None
        step = 2 * rt.AUDIO_RATE * self.conn.server.config.transport.max_frame_ms // 1000
        if limited and not self.conn.audio_limit.allow(len(pcm) / 2 / rt.AUDIO_RATE, now):
            raise rt.RealtimeError(
                "rate_limited",
                f"Audio is arriving faster than real time ({self.conn.audio_limit.ahead_s(now):.1f} s ahead, "
                f"{self.conn.audio_limit.burst_s:g} s allowed); this append was dropped.",
                param="audio",
            )
        for at in range(0, len(pcm), step):
            self._in_seq += 1
            chunks = session.accept_frame(self._in_seq, pcm[at : at + step], now)
            await self.conn.run_vad(session, chunks)

    async def _update(self, u: rt.SessionUpdate, event_id: str | None, now: float) -> None:
        session = self.conn.session
        assert session is not None
        self._apply(u)
        self.conn.send(
            {
                "type": "session.updated",
                "event_id": self.ids.new("event"),
                "session": session_object(session.id, self.settings, self._vad_defaults),
            }
        )
        self.context.sync(now)

    def _apply(self, u: rt.SessionUpdate) -> None:
        """Take the settings `u` gives (a `session.update`, or a WebRTC call's `session` at its start)."""
        conv, server, session = self.conn.conversation, self.conn.server, self.conn.session
        assert conv is not None and server.dialog is not None and session is not None
        ignored = list(u.ignored)
        if u.instructions is not None:
            self.settings.instructions = u.instructions  # (in the LLM's context from the next response on)
        if u.output_modalities is not None:
            self.settings.output_modalities = u.output_modalities
        if u.max_output_tokens is not False:
            assert u.max_output_tokens is None or isinstance(u.max_output_tokens, int)
            self.settings.max_output_tokens = u.max_output_tokens
            conv.max_reply_tokens = u.max_output_tokens
        if u.tool_choice is not None:
            self.settings.tool_choice = u.tool_choice
        if u.tools is not None:
            self.settings.tools = u.tools
            ignored += self._mcp().update(u.tools)
        if u.tools is not None or u.tool_choice is not None:
            self._give_tools()
        if u.turn_detection is not False:
            td = u.turn_detection
            assert td is None or isinstance(td, rt.TurnDetection)
            self.settings.turn_detection = td
            self._apply_turn_detection(conv, td)
        if ignored:
            log.info(
                "session %s: session.update accepted; not honoured here: %s",
                session.id,
                ", ".join(ignored),
                extra={"event": "realtime.ignored", "session": session.id, "fields": ignored},
            )

    def _apply_turn_detection(self, conv: cv.Conversation, td: rt.TurnDetection | None) -> None:
        """server_vad: the client's threshold, pre-roll and silence (fixed: min = max); semantic_vad: the
        endpointer's own P(end of turn) and silences, scaled by eagerness."""
        conv.auto_turns = td is not None
        conv.auto_respond = td is not None and td.create_response  # (a commit waits for response.create)
        conv.barge_in = td is None or td.interrupt_response  # (without VAD the client cancels itself)
        self._idle_since = None
        base = self.conn.server.config.turn
        turn = base
        if td is not None and td.type == "semantic_vad":
            low, high = EAGERNESS[td.eagerness]
            lo = round(base.min_silence_ms * low)
            turn = dataclasses.replace(
                base, min_silence_ms=lo, max_silence_ms=max(lo, round(base.max_silence_ms * high))
            )
        elif td is not None and td.silence_duration_ms is not None:
            turn = dataclasses.replace(
                base, min_silence_ms=td.silence_duration_ms, max_silence_ms=td.silence_duration_ms
            )
        conv.set_turn_config(turn)
        if self.conn.session is not None:
            server_vad = td is not None and td.type == "server_vad"
            self.conn.session.tune_vad(
                threshold=td.threshold if server_vad and td is not None else None,
                preroll_ms=td.prefix_padding_ms if server_vad and td is not None else None,
            )

    def _maybe_commit(self, now: float) -> None:
        session, conv = self.conn.session, self.conn.conversation
        if not self._commit_pending or session is None or conv is None:
            return
        if conv.auto_turns and self.out.user_item is None:
            self._commit_pending = False  # the endpointer ended the turn first
            return
        if session.asr_settled and conv.text_settled:
            self._commit_pending = False
            if self.out.user_item is None:
                self.out.user_item = self.ids.new("item")
            self.conn.dispatch(conv.commit(session.heard_s), now)

    def tick(self, now: float) -> None:
        self._maybe_commit(now)
        self._maybe_idle(now)
        self.context.sync(now)

    def _maybe_idle(self, now: float) -> None:
        """server_vad `idle_timeout_ms`: no speech for that long once the last response has played out
        -> `input_audio_buffer.timeout_triggered`, an empty user turn, and a response."""
        session, conv, td = self.conn.session, self.conn.conversation, self.settings.turn_detection
        if session is None or conv is None or td is None or td.idle_timeout_ms is None or not self.out.responded:
            return
        if conv.replying or self.out.user_item is not None or self._commit_pending:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
            return
        idle_s = now - self._idle_since
        if idle_s * 1000 < td.idle_timeout_ms:
            return
        self._idle_since = None
        self.out.user_item = self.ids.new("item")
        end_ms = round(1000 * session.heard_s)
        self._ev(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=max(0, end_ms - round(1000 * idle_s)),
            audio_end_ms=end_ms,
            item_id=self.out.user_item,
        )
        self.out.next = Pending(None, None, self.settings.max_output_tokens)
        self.conn.dispatch(conv.respond(session.heard_s, max_tokens=self.settings.max_output_tokens), now)

    # -- server events -----------------------------------------------------------------------------------

    def _ev(self, kind: str, **fields: Any) -> None:
        self.conn.send(self.out.event(kind, **fields))

    def _send_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.conn.send(event)

    def event(self, event: Event) -> None:
        out, conv = self.out, self.conn.conversation
        replying = conv is not None and conv.replying
        match event:
            case SpeechStarted(t_s=t):
                self._send_all(out.speech_started(t))
            case SpeechStopped(t_s=t):
                self._send_all(out.speech_stopped(t))
            case TranscriptUpdated(utterance=u, words=words, committed=n):
                self._send_all(out.words(u, words[:n], replying=replying))
            case UtteranceFinalized(utterance=u, words=words):
                self._send_all(out.words(u, words, replying=replying))
            case TurnEnded(text=text, eos_s=eos):
                self._send_all(out.turn_ended(text, eos))
            case ReplyStarted(reply=reply):
                self._send_all(out.response_started(reply, self._rate_limits))
                if self.conn.voice is not None:
                    self.conn.voice.text_only = out.response is not None and out.response.text_only
            case ReplyDone(reply=reply, text=text):
                capped = conv is not None and conv.capped(reply)
                status, reason = ("incomplete", "max_output_tokens") if capped else ("completed", None)
                self._response_done(reply, text, status, reason)
            case ReplyInterrupted(reply=reply, heard_text=heard, reason=reason):
                why = "turn_detected" if reason == "barge_in" else "client_cancelled"
                self._response_done(reply, heard, "cancelled", why)
            case ReplyToolCalled(reply=reply):
                self._send_all(out.tool_call(reply, event))
            case ErrorRaised(code=code, message=message):
                self._rt_error(rt.RealtimeError(str(code), message), kind="server_error")
            case _:
                pass  # frame acks, speculation reports: not part of this protocol

    def _response_done(self, reply: int, text: str, status: str, reason: str | None) -> None:
        self._send_all(self.out.response_done(reply, text, status, reason))
        if self.context.outdated:
            asyncio.get_running_loop().call_soon(lambda: self.context.sync(time.monotonic()))  # (after the commands)

    def token(self, reply: int, text: str) -> None:
        self._send_all(self.out.token(reply, text))

    def audio(self, seq: int, pcm: bytes) -> None:
        self._send_all(self.out.audio(pcm))

    def _rate_limits(self, max_output_tokens: int | None) -> list[dict[str, Any]]:
        """`rate_limits.updated` as a response with this token cap (None: "inf") starts. duplexd has no
        quotas: `requests` reports the sessions the server admits now and how many are free; `tokens`, the
        response's output budget."""
        server = self.conn.server
        limit = max(1, round(server.admission.sessions))
        tokens = max_output_tokens or server.config.dialog.max_reply_tokens
        return [
            {"name": "requests", "limit": limit, "remaining": max(0, limit - len(server.sessions))},
            {"name": "tokens", "limit": tokens, "remaining": tokens},
        ]
