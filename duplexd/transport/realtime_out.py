"""What a Realtime client is told: OpenAI's server events for what happens in the session core.

    VAD speech start / stop          -> input_audio_buffer.speech_started / speech_stopped
    committed words (LocalAgreement) -> conversation.item.input_audio_transcription.delta
    end of turn                      -> input_audio_buffer.committed, conversation.item.added,
                                        ...transcription.completed, conversation.item.done
    reply                            -> response.created, rate_limits.updated, response.output_item.added,
                                        conversation.item.added, response.content_part.added, transcript (or
                                        text) deltas, output_audio deltas, ... .done, response.done

Pure: each method returns the events to send, and keeps what the next ones need (the user item being spoken,
the response in progress, the items).
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duplexd.config import ServerConfig
from duplexd.events import ReplyToolCalled, Word
from duplexd.transport import realtime as rt
from duplexd.transport.realtime_items import Items
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

Events = list[dict[str, Any]]


@dataclass(slots=True)
class Response:
    id: str
    item_id: str
    reply: int  # the conversation's reply number (0: out of band)
    modalities: tuple[str, ...]
    metadata: dict[str, str] | None = None
    max_output_tokens: int | None = None
    text: str = ""
    audio_ms: float = 0.0
    calls: list[dict[str, Any]] = field(default_factory=list)  # its function_call / mcp_call output items
    before: str | None = None  # (with calls) the item before its message

    @property
    def text_only(self) -> bool:
        return self.modalities == ("text",)


@dataclass(frozen=True, slots=True)
class Pending:
    """`response.create`'s parameters, for the response it starts."""

    modalities: tuple[str, ...] | None
    metadata: dict[str, str] | None
    max_output_tokens: int | None


# -- ids, session objects, errors ----------------------------------------------------------------------


class Ids:
    """Event, item and response ids of one session (`event_1`, `item_1`, ...)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._counter = itertools.count(1)

    def new(self, prefix: str) -> str:
        return f"{prefix}_{next(self._counter)}"


@dataclass(frozen=True, slots=True)
class VadDefaults:
    """The server's own values, shown where a `server_vad` leaves a field out."""

    threshold: float
    prefix_padding_ms: int
    silence_duration_ms: int

    @classmethod
    def of(cls, config: ServerConfig) -> VadDefaults:
        return cls(config.vad.threshold, round(1000 * config.asr.preroll_s), config.turn.min_silence_ms)


def turn_detection_object(td: rt.TurnDetection | None, defaults: VadDefaults) -> dict[str, Any] | None:
    if td is None:
        return None
    if td.type == "semantic_vad":
        return {
            "type": "semantic_vad",
            "eagerness": td.eagerness,
            "create_response": td.create_response,
            "interrupt_response": td.interrupt_response,
        }
    return {
        "type": "server_vad",
        "threshold": defaults.threshold if td.threshold is None else td.threshold,
        "prefix_padding_ms": defaults.prefix_padding_ms if td.prefix_padding_ms is None else td.prefix_padding_ms,
        "silence_duration_ms": defaults.silence_duration_ms
        if td.silence_duration_ms is None
        else td.silence_duration_ms,
        "idle_timeout_ms": td.idle_timeout_ms,
        "create_response": td.create_response,
        "interrupt_response": td.interrupt_response,
    }


def session_object(session_id: str, s: rt.SessionSettings, defaults: VadDefaults) -> dict[str, Any]:
    """The session as it is in effect (`session.created`, `session.updated`)."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": rt.MODEL_NAME,
        "output_modalities": list(s.output_modalities),
        "instructions": s.instructions,
        "tools": list(s.tools),
        "tool_choice": s.tool_choice,
        "max_output_tokens": "inf" if s.max_output_tokens is None else s.max_output_tokens,
        "tracing": None,
        "truncation": "auto",
        "audio": {
            "input": {
                "format": rt.AUDIO_FORMAT,
                "transcription": {"model": "whisper-tiny.en"},
                "noise_reduction": None,
                "turn_detection": turn_detection_object(s.turn_detection, defaults),
            },
            "output": {"format": rt.AUDIO_FORMAT, "voice": s.voice, "speed": 1.0},
        },
    }


def error_event(ids: Ids, exc: rt.RealtimeError, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {
        "type": "error",
        "event_id": ids.new("event"),
        "error": {
            "type": kind,
            "code": exc.code,
            "message": exc.message,
            "param": exc.param,
            "event_id": exc.event_id,
        },
    }


def encode_audio(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


# -- the conversation ------------------------------------------------------------------------------------


class RealtimeOut:
    def __init__(self, ids: Ids, items: Items, settings: rt.SessionSettings, conversation_id: str) -> None:
        self.ids, self.items, self.settings = ids, items, settings
        self.conversation_id = conversation_id
        self.user_item: str | None = None  # the user item being spoken (audio), until its turn ends
        self.response: Response | None = None  # the conversation's response in progress
        self.next: Pending | None = None  # response.create's, for the next response
        self.responded = False  # a response has ended (the idle timeout counts only after one)
        self._utt_sent: dict[int, int] = {}  # utterance -> words already sent as transcription deltas

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": self.ids.new("event"), **fields}

    # -- the user ------------------------------------------------------------------------------------------

    def speech_started(self, t_s: float) -> Events:
        if self.user_item is None:
            self.user_item = self.ids.new("item")
        return [
            self.event("input_audio_buffer.speech_started", audio_start_ms=round(1000 * t_s), item_id=self.user_item)
        ]

    def speech_stopped(self, t_s: float) -> Events:
        if self.user_item is None:
            return []
        return [self.event("input_audio_buffer.speech_stopped", audio_end_ms=round(1000 * t_s), item_id=self.user_item)]

    def words(self, utterance: int, words: tuple[Word, ...], *, replying: bool) -> Events:
        """The utterance's committed `words` so far: the new ones as a transcription delta (none while a
        response is in progress: those words belong to the next turn)."""
        sent = self._utt_sent.get(utterance, 0)
        new = [w.text.strip() for w in words[sent:] if w.text.strip()]
        self._utt_sent[utterance] = max(sent, len(words))
        if not new or self.user_item is None or replying:
            return []
        delta = " ".join(new) + " "
        kind = "conversation.item.input_audio_transcription.delta"
        return [self.event(kind, item_id=self.user_item, content_index=0, delta=delta)]

    def turn_ended(self, text: str, eos_s: float) -> Events:
        """The user's spoken turn is over: its item, committed and transcribed."""
        item_id, self.user_item = self.user_item, None
        if item_id is None:  # a turn of typed items only: they were reported when created
            return []
        after = self.items.last
        item: dict[str, Any] = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        out = [
            self.event("input_audio_buffer.committed", previous_item_id=after, item_id=item_id),
            self.event("conversation.item.added", previous_item_id=after, item=dict(item)),
            self.event(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=0,
                transcript=text,
                usage={"type": "duration", "seconds": round(max(0.0, eos_s), 3)},
            ),
        ]
        item["content"] = [{"type": "input_audio", "transcript": text}]
        out.append(self.event("conversation.item.done", previous_item_id=after, item=item))
        self.items.add(item)
        return out

    # -- the conversation's responses ---------------------------------------------------------------------

    def response_started(self, reply: int, rate_limits: Callable[[int | None], list[dict[str, Any]]]) -> Events:
        """The conversation's reply `reply` starts, with `response.create`'s parameters if it asked for it
        (`rate_limits`: for the response's token cap)."""
        pending, self.next = self.next, None
        if pending is None:  # (a reply of server VAD)
            pending = Pending(None, None, self.settings.max_output_tokens)
        modalities = pending.modalities or self.settings.output_modalities
        ids = self.ids
        r = Response(ids.new("resp"), ids.new("item"), reply, modalities, pending.metadata, pending.max_output_tokens)
        self.response = r
        item = self.message(r, "in_progress", [])
        out = [
            self.event("response.created", response=self.response_object(r, "in_progress")),
            self.event("rate_limits.updated", rate_limits=rate_limits(r.max_output_tokens)),
            self.event("response.output_item.added", response_id=r.id, output_index=0, item=item),
            self.event("conversation.item.added", previous_item_id=self.items.last, item=item),
            self.event("response.content_part.added", **part_ids(r), part=part(r)),
        ]
        self.items.keep(item, reply)
        return out

    def token(self, reply: int, text: str) -> Events:
        r = self.response
        if r is None or r.reply != reply:
            return []
        r.text += text
        kind = "response.output_text.delta" if r.text_only else "response.output_audio_transcript.delta"
        return [self.event(kind, **part_ids(r), delta=text)]

    def tool_call(self, reply: int, call: ReplyToolCalled) -> Events:
        """The response called a tool: a `function_call` item (the client runs it, and answers with a
        `function_call_output` item and `response.create`), or an `mcp_call` item with the MCP server's
        result. Each is an output item of the response after its message, and an item of the conversation."""
        r = self.response
        if r is None or r.reply != reply:
            return []
        index = 1 + len(r.calls)
        item_id = self.ids.new("item")
        at = {"response_id": r.id, "item_id": item_id, "output_index": index}
        if call.server:
            item: dict[str, Any] = {
                "id": item_id,
                "object": "realtime.item",
                "type": "mcp_call",
                "server_label": call.server.partition("@")[0],  # (a session's own: `label@session`)
                "name": call.name,
                "arguments": "",
                "approval_request_id": None,
                "output": None,
                "error": None,
            }
        else:
            item = {
                "id": item_id,
                "object": "realtime.item",
                "type": "function_call",
                "status": "in_progress",
                "name": call.name,
                "call_id": call.call_id,
                "arguments": "",
            }
        after = r.calls[-1]["id"] if r.calls else r.item_id
        out = [
            self.event("response.output_item.added", response_id=r.id, output_index=index, item=dict(item)),
            self.event("conversation.item.added", previous_item_id=after, item=dict(item)),
        ]
        item["arguments"] = call.arguments
        if call.server:
            out += [
                self.event("response.mcp_call_arguments.delta", **at, delta=call.arguments),
                self.event("response.mcp_call_arguments.done", **at, arguments=call.arguments),
                self.event("response.mcp_call.in_progress", item_id=item_id, output_index=index),
            ]
            if call.error:
                item["error"] = {"type": "tool_execution_error", "message": call.output or ""}
            else:
                item["output"] = call.output
            kind = "response.mcp_call.failed" if call.error else "response.mcp_call.completed"
            out.append(self.event(kind, item_id=item_id, output_index=index))
        else:
            item["status"] = "completed"
            out += [
                self.event("response.function_call_arguments.delta", **at, call_id=call.call_id, delta=call.arguments),
                self.event(
                    "response.function_call_arguments.done",
                    **at,
                    call_id=call.call_id,
                    name=call.name,
                    arguments=call.arguments,
                ),
            ]
        out += [
            self.event("response.output_item.done", response_id=r.id, output_index=index, item=dict(item)),
            self.event("conversation.item.done", previous_item_id=after, item=dict(item)),
        ]
        if not r.calls:
            r.before = self.items.last  # (the item the message follows)
        r.calls.append(item)
        self.items.add(item)
        return out

    def audio(self, pcm: bytes, *, delta: bool = True) -> Events:
        """Reply audio of the response in progress; `delta` False: counted, not sent as an event (a WebRTC
        call plays it on its audio track)."""
        r = self.response
        if r is None or r.text_only:
            return []
        r.audio_ms += 1000 * len(pcm) / 2 / OUTPUT_SAMPLE_RATE
        return [self.event("response.output_audio.delta", **part_ids(r), delta=encode_audio(pcm))] if delta else []

    def response_done(self, reply: int, text: str, status: str, reason: str | None) -> Events:
        """The response of `reply` ended: `completed`, `incomplete` (`max_output_tokens`) or `cancelled`
        (`turn_detected`, `client_cancelled`), with `text` as it was heard."""
        r = self.response
        if r is None or r.reply != reply:
            return []
        self.response = None
        r.text = text
        self.responded = True
        return self.ended(r, status, reason, in_conversation=True)

    def ended(self, r: Response, status: str, reason: str | None, *, in_conversation: bool) -> Events:
        """The closing events of response `r` (its text final); one of the conversation is kept as its
        assistant item (out-of-band responses are not)."""
        ids = part_ids(r)
        if r.text_only:
            out = [self.event("response.output_text.done", **ids, text=r.text)]
        else:
            out = [
                self.event("response.output_audio.done", **ids),
                self.event("response.output_audio_transcript.done", **ids, transcript=r.text),
            ]
        out.append(self.event("response.content_part.done", **ids, part=part(r)))
        item = self.message(r, "completed" if status == "completed" else "incomplete", [content(r)])
        out.append(self.event("response.output_item.done", response_id=r.id, output_index=0, item=item))
        if in_conversation:
            before = r.before if r.calls else self.items.last
            out.append(self.event("conversation.item.done", previous_item_id=before, item=item))
            self.items.keep(item, r.reply, r.audio_ms, newest=not r.calls)  # (its calls follow it)
            if not r.calls:
                self.items.last = r.item_id
        output = [item, *r.calls]
        response = self.response_object(r, status, output, reason=reason, in_conversation=in_conversation)
        out.append(self.event("response.done", response=response))
        return out

    # -- the objects in them ------------------------------------------------------------------------------

    def response_object(
        self,
        r: Response,
        status: str,
        output: list[Any] | None = None,
        *,
        reason: str | None = None,
        in_conversation: bool = True,
    ) -> dict[str, Any]:
        response = {
            "id": r.id,
            "object": "realtime.response",
            "conversation_id": self.conversation_id if in_conversation else None,
            "status": status,
            "output": output or [],
            "output_modalities": list(r.modalities),
            "audio": {"output": {"format": rt.AUDIO_FORMAT, "voice": self.settings.voice}},
            "max_output_tokens": "inf" if r.max_output_tokens is None else r.max_output_tokens,
            "metadata": r.metadata,
        }
        if reason is not None:
            response["status_details"] = {"type": status, "reason": reason}
        return response

    @staticmethod
    def message(r: Response, status: str, content: list[Any]) -> dict[str, Any]:
        return {
            "id": r.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }


def content(r: Response) -> dict[str, Any]:
    if r.text_only:
        return {"type": "output_text", "text": r.text}
    return {"type": "output_audio", "transcript": r.text}


def part(r: Response) -> dict[str, Any]:
    if r.text_only:
        return {"type": "text", "text": r.text}
    return {"type": "audio", "transcript": r.text}


def part_ids(r: Response) -> dict[str, Any]:
    return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
