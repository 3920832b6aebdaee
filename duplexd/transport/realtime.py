"""The OpenAI Realtime protocol (GA, as the official `openai` package models it) on duplexd's session core.

Pure: client events in (JSON text) -> typed messages, or a `RealtimeError` shaped like OpenAI's `error`
event; server events out as plain dicts. `transport.realtime_session` is the shell that maps them onto the
same `Session` + `Conversation` + workers as the native protocol (docs/protocol.md, "OpenAI Realtime").

Supported client events: `session.update` (instructions, `output_modalities`, `audio.input.turn_detection`
server_vad / null, voice and formats as long as they are PCM 24 kHz; other fields are accepted and listed in
an `error` event with code `unsupported_parameter`, never fatal), `input_audio_buffer.append|commit|clear`,
`conversation.item.create` (user text messages), `response.create`, `response.cancel`,
`conversation.item.truncate`.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

AUDIO_RATE = 24_000
AUDIO_FORMAT = {"type": "audio/pcm", "rate": AUDIO_RATE}
MODEL_NAME = "duplexd"


class RealtimeError(Exception):
    """A client event that cannot be carried out; becomes an `error` event (never closes the session)."""

    def __init__(self, code: str, message: str, *, param: str | None = None, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """`server_vad` (None = the client commits turns itself)."""

    silence_duration_ms: int | None = None
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(slots=True)
class SessionSettings:
    instructions: str
    output_modalities: tuple[str, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    voice: str = "default"


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    instructions: str | None
    output_modalities: tuple[str, ...] | None
    turn_detection: TurnDetection | None | bool  # False: not given
    unsupported: tuple[str, ...]  # dotted paths of fields accepted and ignored


@dataclass(frozen=True, slots=True)
class AudioAppend:
    pcm: bytes  # PCM16 LE, 24 kHz


@dataclass(frozen=True, slots=True)
class AudioCommit:
    pass


@dataclass(frozen=True, slots=True)
class AudioClear:
    pass


@dataclass(frozen=True, slots=True)
class UserText:
    text: str
    item_id: str | None


@dataclass(frozen=True, slots=True)
class ResponseCreate:
    output_modalities: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class ResponseCancel:
    pass


@dataclass(frozen=True, slots=True)
class ItemTruncate:
    item_id: str
    content_index: int
    audio_end_ms: int


ClientEvent = (
    SessionUpdate | AudioAppend | AudioCommit | AudioClear | UserText | ResponseCreate | ResponseCancel | ItemTruncate
)

_SESSION_KNOWN = {"type", "instructions", "output_modalities", "audio", "model"}
_MODALITIES = {("audio",), ("text",), ("text", "audio"), ("audio", "text")}


def parse(data: str) -> tuple[ClientEvent, str | None]:
    """One client event and its `event_id` (or a `RealtimeError`)."""
    try:
        msg = json.loads(data)
    except (json.JSONDecodeError, RecursionError):
        raise RealtimeError("invalid_json", "The event is not valid JSON.") from None
    if not isinstance(msg, dict):
        raise RealtimeError("invalid_event", "An event must be a JSON object.")
    event_id = msg.get("event_id") if isinstance(msg.get("event_id"), str) else None
    kind = msg.get("type")
    try:
        return _parse(kind, msg), event_id
    except RealtimeError as exc:
        exc.event_id = event_id
        raise


def _parse(kind: object, msg: dict[str, Any]) -> ClientEvent:
    match kind:
        case "input_audio_buffer.append":
            audio = msg.get("audio")
            if not isinstance(audio, str):
                raise RealtimeError("invalid_value", "`audio` must be a base64 string.", param="audio")
            try:
                pcm = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                raise RealtimeError("invalid_value", "`audio` is not valid base64.", param="audio") from None
            if len(pcm) % 2:
                raise RealtimeError("invalid_value", "`audio` is not whole PCM16 samples.", param="audio")
            return AudioAppend(pcm)
        case "input_audio_buffer.commit":
            return AudioCommit()
        case "input_audio_buffer.clear":
            return AudioClear()
        case "session.update":
            return _parse_session(msg.get("session"))
        case "conversation.item.create":
            return _parse_item(msg.get("item"))
        case "response.create":
            response = msg.get("response")
            if response is not None and not isinstance(response, dict):
                raise RealtimeError("invalid_value", "`response` must be an object.", param="response")
            modalities = None if response is None else response.get("output_modalities")
            return ResponseCreate(_modalities(modalities, "response.output_modalities") if modalities else None)
        case "response.cancel":
            return ResponseCancel()
        case "conversation.item.truncate":
            item_id, index, end = msg.get("item_id"), msg.get("content_index", 0), msg.get("audio_end_ms")
            if not isinstance(item_id, str) or not _int(index) or not _int(end) or end < 0:
                raise RealtimeError(
                    "invalid_value", "`item_id` (string) and `audio_end_ms` (integer >= 0) are required."
                )
            return ItemTruncate(item_id, index, end)
        case str():
            raise RealtimeError("invalid_event", f"Event type {kind[:64]!r} is not supported.", param="type")
    raise RealtimeError("invalid_event", "An event needs a string `type`.", param="type")


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _modalities(value: object, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or tuple(value) not in _MODALITIES:
        raise RealtimeError("invalid_value", f'`{param}` must be ["audio"] or ["text"].', param=param)
    return ("text",) if tuple(value) == ("text",) else ("audio",)


def _parse_session(session: object) -> SessionUpdate:
    if not isinstance(session, dict):
        raise RealtimeError("invalid_value", "`session` must be an object.", param="session")
    if session.get("type", "realtime") != "realtime":
        raise RealtimeError(
            "invalid_value", "Only `realtime` sessions are supported (not transcription).", param="session.type"
        )
    unsupported = [f"session.{k}" for k in session if k not in _SESSION_KNOWN]
    instructions = session.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RealtimeError("invalid_value", "`instructions` must be a string.", param="session.instructions")
    modalities = session.get("output_modalities")
    detection: TurnDetection | None | bool = False
    audio = session.get("audio") or {}
    if not isinstance(audio, dict):
        raise RealtimeError("invalid_value", "`audio` must be an object.", param="session.audio")
    for side in ("input", "output"):
        part = audio.get(side) or {}
        if not isinstance(part, dict):
            raise RealtimeError("invalid_value", f"`audio.{side}` must be an object.", param=f"session.audio.{side}")
        fmt = part.get("format")
        if fmt is not None and (
            not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm" or fmt.get("rate", AUDIO_RATE) != AUDIO_RATE
        ):
            raise RealtimeError(
                "invalid_value",
                "Only 24 kHz PCM16 audio ({type: audio/pcm, rate: 24000}) is supported.",
                param=f"session.audio.{side}.format",
            )
        known = {"format", "turn_detection", "transcription"} if side == "input" else {"format", "voice"}
        unsupported += [f"session.audio.{side}.{k}" for k in part if k not in known]
        if side == "input" and "turn_detection" in part:
            detection = _parse_detection(part["turn_detection"], unsupported)
    return SessionUpdate(
        instructions,
        _modalities(modalities, "session.output_modalities") if modalities is not None else None,
        detection,
        tuple(unsupported),
    )


def _parse_detection(td: object, unsupported: list[str]) -> TurnDetection | None:
    if td is None:
        return None
    if not isinstance(td, dict) or td.get("type") not in ("server_vad", "semantic_vad"):
        raise RealtimeError(
            "invalid_value",
            "`turn_detection` must be null or {type: server_vad, ...}.",
            param="session.audio.input.turn_detection",
        )
    if td["type"] == "semantic_vad":  # duplexd's endpointer already weighs how complete the words are
        unsupported.append("session.audio.input.turn_detection.type=semantic_vad (server_vad used)")
    silence = td.get("silence_duration_ms")
    if silence is not None and (not _int(silence) or not 0 <= silence <= 10_000):
        raise RealtimeError(
            "invalid_value",
            "`silence_duration_ms` must be an integer in [0, 10000].",
            param="session.audio.input.turn_detection.silence_duration_ms",
        )
    for key in td:
        if key not in ("type", "silence_duration_ms", "create_response", "interrupt_response"):
            unsupported.append(f"session.audio.input.turn_detection.{key}")
    return TurnDetection(
        silence_duration_ms=silence,
        create_response=bool(td.get("create_response", True)),
        interrupt_response=bool(td.get("interrupt_response", True)),
    )


def _parse_item(item: object) -> UserText:
    if not isinstance(item, dict) or item.get("type") != "message" or item.get("role") != "user":
        raise RealtimeError(
            "invalid_value", "Only user messages can be created (type message, role user).", param="item"
        )
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("invalid_value", "`item.content` must be a non-empty list.", param="item.content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(part.get("text"), str):
            raise RealtimeError(
                "invalid_value", "Only `input_text` content is supported in items.", param="item.content"
            )
        texts.append(part["text"])
    item_id = item.get("id") if isinstance(item.get("id"), str) else None
    return UserText(" ".join(texts), item_id)


# -- server events ----------------------------------------------------------------------------------------


class Ids:
    """Event, item and response ids of one session (`event_1`, `item_1`, ...)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._counter = itertools.count(1)

    def new(self, prefix: str) -> str:
        return f"{prefix}_{next(self._counter)}"


def session_object(session_id: str, s: SessionSettings) -> dict[str, Any]:
    td = s.turn_detection
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": MODEL_NAME,
        "output_modalities": list(s.output_modalities),
        "instructions": s.instructions,
        "tools": [],
        "tool_choice": "auto",
        "max_output_tokens": "inf",
        "audio": {
            "input": {
                "format": AUDIO_FORMAT,
                "transcription": {"model": "whisper-tiny.en"},
                "noise_reduction": None,
                "turn_detection": None
                if td is None
                else {
                    "type": "server_vad",
                    "silence_duration_ms": td.silence_duration_ms,
                    "create_response": td.create_response,
                    "interrupt_response": td.interrupt_response,
                },
            },
            "output": {"format": AUDIO_FORMAT, "voice": s.voice, "speed": 1.0},
        },
    }


def error_event(ids: Ids, exc: RealtimeError, kind: str = "invalid_request_error") -> dict[str, Any]:
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
