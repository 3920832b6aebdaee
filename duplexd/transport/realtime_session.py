"""`/v1/realtime`: an OpenAI Realtime session on the same session core as `/v1/stream`.

The connection is a `_Connection` (the same `Session`, `Conversation`, workers, pacing, admission and
limits) that reads OpenAI client events and writes OpenAI server events instead of the native ones:

    input_audio_buffer.append     -> 24 kHz PCM16 frames into the Session (VAD, streaming ASR)
    VAD speech start / stop       -> input_audio_buffer.speech_started / speech_stopped
    committed words (LocalAgreement) -> conversation.item.input_audio_transcription.delta
    end of turn (endpointer, or commit) -> input_audio_buffer.committed, conversation.item.added,
                                        ...transcription.completed, conversation.item.done
    reply                         -> response.created, response.output_item.added, conversation.item.added,
                                     response.content_part.added, ...output_audio_transcript.delta (or
                                     output_text.delta), response.output_audio.delta, ... .done,
                                     response.done (completed, or cancelled on barge-in / response.cancel)

Audio goes out paced as on the native path (at most `audio_lead_ms` ahead of real-time playback: a Realtime
client sends no playback reports); `conversation.item.truncate` tells the server where playback stopped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from duplexd.errors import ErrorCode, Overloaded
from duplexd.streaming import conversation as cv
from duplexd.streaming.events import (
    ErrorRaised,
    Event,
    ReplyDone,
    ReplyInterrupted,
    ReplyStarted,
    SpeechStarted,
    SpeechStopped,
    TranscriptUpdated,
    TurnEnded,
    UtteranceFinalized,
)
from duplexd.transport import protocol
from duplexd.transport import realtime as rt
from duplexd.transport.server import CLOSE_POLICY, CLOSE_TRY_AGAIN_LATER, _Closing, _Connection
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

COMMIT_SILENCE_S = 0.7  # `input_audio_buffer.commit`: silence appended so the recognizer finalizes the words


@dataclasses.dataclass(slots=True)
class _Response:
    id: str
    item_id: str
    reply: int
    modalities: tuple[str, ...]
    text: str = ""
    audio_ms: float = 0.0


class RealtimeConnection(_Connection):
    numbered = False

    def __init__(self, server: Any, ws: Any) -> None:
        super().__init__(server, ws)
        self.ids = rt.Ids("")
        self.settings = rt.SessionSettings(instructions=server.config.dialog.system_prompt)
        self._user_item: str | None = None  # the user item being spoken (audio), until its turn ends
        self._previous_item: str | None = None
        self._utt_sent: dict[int, int] = {}  # utterance -> words already sent as transcription deltas
        self._response: _Response | None = None
        self._next_modalities: tuple[str, ...] | None = None  # response.create's, for the next response
        self._commit_pending = False
        self._in_seq = 0

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def _opening(self) -> None:
        try:
            await self._start(protocol.SessionStart(version=1, sample_rate=rt.AUDIO_RATE, dialog=True))
        except Overloaded as exc:
            self.ended = True
            extra = {} if exc.retry_after_ms is None else {"retry_after_ms": exc.retry_after_ms}
            self._out_error(ErrorCode.OVERLOADED, str(exc), **extra)
            raise _Closing(CLOSE_TRY_AGAIN_LATER, "overloaded") from None
        if self.conversation is None:
            self._rt_error(rt.RealtimeError("server_error", "This server runs without a dialog model."))
            self.ended = True
            raise _Closing(CLOSE_POLICY, "no dialog model")

    def _started_message(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]:
        assert self.session is not None
        self.ids = rt.Ids(self.session.id)
        return {
            "type": "session.created",
            "event_id": self.ids.new("event"),
            "session": rt.session_object(self.session.id, self.settings),
        }

    def _new_conversation(self) -> cv.Conversation:
        conv = super()._new_conversation()
        self._apply_turn_detection(conv, self.settings.turn_detection)
        return conv

    # -- client events -----------------------------------------------------------------------------------

    async def _on_audio(self, data: bytes) -> None:
        self._client_error(rt.RealtimeError("invalid_event", "Binary messages are not part of this protocol."))

    async def _on_text(self, data: str) -> bool:
        try:
            event, event_id = rt.parse(data)
            await self._handle_event(event, event_id)
        except rt.RealtimeError as exc:
            self._client_error(exc)
        return False

    def _client_error(self, exc: rt.RealtimeError) -> None:
        self.server.counters["protocol_errors"] += 1
        self.errors += 1
        self._rt_error(exc)
        if self.errors >= self.server.config.transport.max_errors:
            self._rt_error(rt.RealtimeError(ErrorCode.TOO_MANY_ERRORS.value, "Too many invalid events."))
            raise _Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

    def _rt_error(self, exc: rt.RealtimeError, kind: str = "invalid_request_error") -> None:
        self.send(rt.error_event(self.ids, exc, kind))

    async def _handle_event(self, event: rt.ClientEvent, event_id: str | None) -> None:
        session, conv = self.session, self.conversation
        assert session is not None and conv is not None
        match event:
            case rt.AudioAppend(pcm=pcm):
                await self._append(pcm)
            case rt.SessionUpdate():
                await self._update(event, event_id)
            case rt.AudioCommit():
                if conv.auto_turns:
                    raise rt.RealtimeError(
                        "invalid_value", "With server_vad, turns are committed by the server.", event_id=event_id
                    )
                self._commit_pending = True
                silence = np.zeros(int(COMMIT_SILENCE_S * rt.AUDIO_RATE), "<i2").tobytes()
                await self._append(silence, limited=False)  # (ours, not the client's: not rate limited)
                self._maybe_commit()
            case rt.AudioClear():
                conv.clear()
                self._user_item = None
                self._ev("input_audio_buffer.cleared")
            case rt.UserText(text=text, item_id=item_id):
                self._settle_reply()
                if conv.replying:
                    raise rt.RealtimeError(
                        "conversation_already_has_active_response",
                        "Wait for the response to finish (or cancel it) before adding items.",
                        event_id=event_id,
                    )
                self._user_text_item(item_id or self.ids.new("item"), text)
                self._dispatch(conv.user_text(text))
            case rt.ResponseCreate(output_modalities=modalities):
                self._settle_reply()
                if conv.replying:
                    raise rt.RealtimeError(
                        "conversation_already_has_active_response",
                        "A response is already in progress.",
                        event_id=event_id,
                    )
                self._next_modalities = modalities
                self._dispatch(conv.respond(session.heard_s))
            case rt.ResponseCancel():
                if not conv.replying:
                    raise rt.RealtimeError(
                        "response_cancel_not_active", "There is no response in progress.", event_id=event_id
                    )
                self._dispatch(conv.cancel())
            case rt.ItemTruncate(item_id=item_id, content_index=index, audio_end_ms=end_ms):
                r = self._response
                if r is None or r.item_id != item_id:
                    raise rt.RealtimeError(
                        "invalid_value", f"Item {item_id!r} is not the response in progress.", event_id=event_id
                    )
                self._truncate(end_ms)
                self.send(
                    {
                        "type": "conversation.item.truncated",
                        "event_id": self.ids.new("event"),
                        "item_id": item_id,
                        "content_index": index,
                        "audio_end_ms": end_ms,
                    }
                )

    def _settle_reply(self) -> None:
        """After `response.done` the response is over for a Realtime client, whose playback the server
        does not hear about: count its audio as played, so the conversation takes the next turn."""
        conv = self.conversation
        if conv is not None and conv.replying and self._response is None:
            self._reported = (self.playout.sent, time.monotonic())
            self._dispatch(conv.played(self.playout.sent))

    async def _append(self, pcm: bytes, *, limited: bool = True) -> None:
        session = self.session
        assert session is not None
        step = 2 * rt.AUDIO_RATE * self.server.config.transport.max_frame_ms // 1000
        now = time.monotonic()
        if limited and not self.audio_limit.allow(len(pcm) / 2 / rt.AUDIO_RATE, now):
            raise rt.RealtimeError(
                "rate_limited",
                f"Audio is arriving faster than real time ({self.audio_limit.ahead_s(now):.1f} s ahead, "
                f"{self.audio_limit.burst_s:g} s allowed); this append was dropped.",
                param="audio",
            )
        for at in range(0, len(pcm), step):
            self._in_seq += 1
            chunks = session.accept_frame(self._in_seq, pcm[at : at + step], now)
            await self._run_vad(session, chunks)

    async def _update(self, u: rt.SessionUpdate, event_id: str | None) -> None:
        conv, server = self.conversation, self.server
        assert conv is not None and server.dialog is not None
        unsupported = list(u.unsupported)
        if u.instructions is not None and u.instructions != self.settings.instructions:
            if conv.turns or conv.replying or self._user_item is not None:
                unsupported.append("session.instructions (only before the conversation starts)")
            else:  # a fresh LLM context with the new system prompt
                old = self.dialog_sid
                if old is not None:
                    server.dialog.close(old)
                self.dialog_sid = await server.dialog.open(self, u.instructions)
                self.settings.instructions = u.instructions
        if u.output_modalities is not None:
            self.settings.output_modalities = u.output_modalities
        if u.turn_detection is not False:
            td = u.turn_detection
            assert td is None or isinstance(td, rt.TurnDetection)
            if td is not None and not td.interrupt_response:
                unsupported.append("session.audio.input.turn_detection.interrupt_response=false")
            self.settings.turn_detection = td
            self._apply_turn_detection(conv, td)
        if unsupported:
            self._rt_error(
                rt.RealtimeError(
                    "unsupported_parameter",
                    "Accepted, but not supported by this server (ignored): " + ", ".join(unsupported),
                    param=unsupported[0],
                    event_id=event_id,
                )
            )
        assert self.session is not None
        self.send(
            {
                "type": "session.updated",
                "event_id": self.ids.new("event"),
                "session": rt.session_object(self.session.id, self.settings),
            }
        )

    def _apply_turn_detection(self, conv: cv.Conversation, td: rt.TurnDetection | None) -> None:
        conv.auto_turns = td is not None
        conv.auto_respond = td is not None and td.create_response  # (a commit waits for response.create)
        if td is not None and td.silence_duration_ms is not None:
            turn = dataclasses.replace(
                self.server.config.turn, min_silence_ms=td.silence_duration_ms, max_silence_ms=td.silence_duration_ms
            )
            conv.set_turn_config(turn)

    def _truncate(self, end_ms: int) -> None:
        """The client stopped playing the response at `end_ms` of its audio: that is what was heard."""
        conv, r = self.conversation, self._response
        assert conv is not None and r is not None
        start = conv.reply_start_sample
        if start is not None:
            played = start + round(end_ms * OUTPUT_SAMPLE_RATE / 1000)
            self._reported = (min(played, self.playout.sent), time.monotonic())
            self._dispatch(conv.played(min(played, self.playout.sent)))
        if conv.replying:
            self._dispatch(conv.cancel())

    def _maybe_commit(self) -> None:
        session, conv = self.session, self.conversation
        if not self._commit_pending or session is None or conv is None:
            return
        if session.asr_settled and conv.text_settled:
            self._commit_pending = False
            if self._user_item is None:
                self._user_item = self.ids.new("item")
            self._dispatch(conv.commit(session.heard_s))

    def _tick(self) -> None:
        super()._tick()
        self._maybe_commit()

    # -- server events -----------------------------------------------------------------------------------

    def _user_text_item(self, item_id: str, text: str) -> None:
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": text}],
        }
        for kind in ("conversation.item.added", "conversation.item.done"):
            self.send(
                {"type": kind, "event_id": self.ids.new("event"), "previous_item_id": self._previous_item, "item": item}
            )
        self._previous_item = item_id

    def _ev(self, kind: str, **fields: Any) -> None:
        self.send({"type": kind, "event_id": self.ids.new("event"), **fields})

    def _out_event(self, event: Event) -> None:
        send, ids = self.send, self.ids
        match event:
            case SpeechStarted(t_s=t):
                if self._user_item is None:
                    self._user_item = ids.new("item")
                send(
                    {
                        "type": "input_audio_buffer.speech_started",
                        "event_id": ids.new("event"),
                        "audio_start_ms": round(1000 * t),
                        "item_id": self._user_item,
                    }
                )
            case SpeechStopped(t_s=t) if self._user_item is not None:
                send(
                    {
                        "type": "input_audio_buffer.speech_stopped",
                        "event_id": ids.new("event"),
                        "audio_end_ms": round(1000 * t),
                        "item_id": self._user_item,
                    }
                )
            case TranscriptUpdated(utterance=u, words=words, committed=n):
                self._transcript_delta(u, words[:n])
            case UtteranceFinalized(utterance=u, words=words):
                self._transcript_delta(u, words)
            case TurnEnded(text=text, eos_s=eos):
                self._user_turn_done(text, eos)
            case ReplyStarted(reply=reply):
                self._response_started(reply)
            case ReplyDone(reply=reply, text=text):
                self._response_done(reply, text, "completed", None)
            case ReplyInterrupted(reply=reply, heard_text=heard, reason=reason):
                why = "turn_detected" if reason == "barge_in" else "client_cancelled"
                self._response_done(reply, heard, "cancelled", why)
            case ErrorRaised(code=code, message=message):
                self._rt_error(rt.RealtimeError(str(code), message), kind="server_error")
            case _:
                pass  # frame acks, speculation reports: not part of this protocol

    def _transcript_delta(self, utterance: int, words: tuple[Any, ...]) -> None:
        sent = self._utt_sent.get(utterance, 0)
        new = [w.text.strip() for w in words[sent:] if w.text.strip()]
        self._utt_sent[utterance] = max(sent, len(words))
        if not new or self._user_item is None or (self.conversation is not None and self.conversation.replying):
            return
        self.send(
            {
                "type": "conversation.item.input_audio_transcription.delta",
                "event_id": self.ids.new("event"),
                "item_id": self._user_item,
                "content_index": 0,
                "delta": " ".join(new) + " ",
            }
        )

    def _user_turn_done(self, text: str, eos_s: float) -> None:
        item_id, self._user_item = self._user_item, None
        if item_id is None:  # a turn of typed items only: they were reported when created
            return
        ids, send = self.ids, self.send
        send(
            {
                "type": "input_audio_buffer.committed",
                "event_id": ids.new("event"),
                "previous_item_id": self._previous_item,
                "item_id": item_id,
            }
        )
        item: dict[str, Any] = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        self._ev("conversation.item.added", previous_item_id=self._previous_item, item=item)
        send(
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "event_id": ids.new("event"),
                "item_id": item_id,
                "content_index": 0,
                "transcript": text,
                "usage": {"type": "duration", "seconds": round(max(0.0, eos_s), 3)},
            }
        )
        item["content"] = [{"type": "input_audio", "transcript": text}]
        self._ev("conversation.item.done", previous_item_id=self._previous_item, item=item)
        self._previous_item = item_id

    def _response_started(self, reply: int) -> None:
        ids = self.ids
        modalities = self._next_modalities or self.settings.output_modalities
        self._next_modalities = None
        r = self._response = _Response(ids.new("resp"), ids.new("item"), reply, modalities)
        self.text_only = modalities == ("text",)
        self._ev("response.created", response=self._response_object(r, "in_progress"))
        item = self._item(r, "in_progress", [])
        self._ev("response.output_item.added", response_id=r.id, output_index=0, item=item)
        self._ev("conversation.item.added", previous_item_id=self._previous_item, item=item)
        self._ev("response.content_part.added", **self._part_ids(r), part=self._part(r))

    def _send_token(self, reply: int, text: str) -> None:
        r = self._response
        if r is None or r.reply != reply:
            return
        r.text += text
        kind = "response.output_text.delta" if self.text_only else "response.output_audio_transcript.delta"
        self.send({"type": kind, "event_id": self.ids.new("event"), **self._part_ids(r), "delta": text})

    def _out_audio(self, seq: int, pcm: bytes) -> None:
        r = self._response
        if r is None or self.text_only:
            return
        r.audio_ms += 1000 * len(pcm) / 2 / OUTPUT_SAMPLE_RATE
        self._ev("response.output_audio.delta", **self._part_ids(r), delta=rt.encode_audio(pcm))

    def _response_done(self, reply: int, text: str, status: str, reason: str | None) -> None:
        r = self._response
        if r is None or r.reply != reply:
            return
        self._response = None
        part = self._part_ids(r)
        r.text = text
        if self.text_only:
            self._ev("response.output_text.done", **part, text=text)
        else:
            self._ev("response.output_audio.done", **part)
            self._ev("response.output_audio_transcript.done", **part, transcript=text)
        self._ev("response.content_part.done", **part, part=self._part(r))
        item = self._item(r, "completed" if status == "completed" else "incomplete", [self._content(r)])
        self._ev("response.output_item.done", response_id=r.id, output_index=0, item=item)
        self._ev("conversation.item.done", previous_item_id=self._previous_item, item=item)
        self._previous_item = r.item_id
        response = self._response_object(r, status, [item])
        if reason is not None:
            response["status_details"] = {"type": "cancelled", "reason": reason}
        self._ev("response.done", response=response)

    def _response_object(self, r: _Response, status: str, output: list[Any] | None = None) -> dict[str, Any]:
        return {
            "id": r.id,
            "object": "realtime.response",
            "status": status,
            "output": output or [],
            "output_modalities": list(r.modalities),
            "audio": {"output": {"format": rt.AUDIO_FORMAT, "voice": self.settings.voice}},
        }

    def _item(self, r: _Response, status: str, content: list[Any]) -> dict[str, Any]:
        return {
            "id": r.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _content(self, r: _Response) -> dict[str, Any]:
        if r.modalities == ("text",):
            return {"type": "output_text", "text": r.text}
        return {"type": "output_audio", "transcript": r.text}

    def _part(self, r: _Response) -> dict[str, Any]:
        if r.modalities == ("text",):
            return {"type": "text", "text": r.text}
        return {"type": "audio", "transcript": r.text}

    @staticmethod
    def _part_ids(r: _Response) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
