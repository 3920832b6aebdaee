"""The OpenAI Realtime protocol (GA, as the official `openai` package models it) on duplexd's session core.

Pure: client events in (JSON text) -> typed messages, or a `RealtimeError` shaped like OpenAI's `error`
event (the server events are built by `transport.realtime_out`). `transport.realtime_session` is the shell
that maps them onto the same `Session` + `Conversation` + workers as the native protocol (docs/protocol.md,
"OpenAI Realtime").

Errors only where OpenAI errors: every field of the GA session and response objects is accepted. Those that
map onto duplexd are honoured; the others are listed in `ignored` (dotted paths, only where the value asks
for something other than what duplexd does), which the shell logs, and `session.updated` shows what is in
effect. A client that sends OpenAI's defaults (pipecat, LiveKit Agents) gets no error and no log line.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

AUDIO_RATE = 24_000
AUDIO_FORMAT = {"type": "audio/pcm", "rate": AUDIO_RATE}
MODEL_NAME = "duplexd"
MAX_METADATA_KEYS = 16  # (OpenAI's limit: 16 pairs, keys up to 64 characters, values up to 512)
MAX_INPUT_ITEMS = 256  # `response.input` items (the conversation keeps as many)

Eagerness = Literal["low", "medium", "high", "auto"]


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
    """`server_vad` or `semantic_vad` (None in `SessionSettings`: the client commits turns itself).

    `server_vad`: `threshold` (VAD speech probability), `prefix_padding_ms` (audio kept before the speech
    onset), `silence_duration_ms` (the silence that ends a turn), `idle_timeout_ms` (a response is triggered
    after this long without speech once the last response has played). `semantic_vad`: duplexd's own
    end of turn (silence weighed by the LLM's P(end of turn)), its silences set by `eagerness`. None: the
    server's configured value."""

    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    idle_timeout_ms: int | None = None
    eagerness: Eagerness = "auto"
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(slots=True)
class SessionSettings:
    instructions: str
    output_modalities: tuple[str, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    voice: str = "default"
    max_output_tokens: int | None = None  # None: "inf" (the server's own reply limit)
    tool_choice: str | dict[str, Any] = "auto"
    tools: tuple[dict[str, Any], ...] = ()  # as the client gave them (`function` and `mcp` tools)


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    instructions: str | None
    output_modalities: tuple[str, ...] | None
    turn_detection: TurnDetection | None | bool  # False: not given
    max_output_tokens: int | None | bool  # False: not given; None: "inf"
    tool_choice: str | dict[str, Any] | None
    ignored: tuple[str, ...]  # dotted paths of fields accepted and not honoured
    tools: tuple[dict[str, Any], ...] | None = None  # None: not given


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
class OutputAudioClear:
    pass


@dataclass(frozen=True, slots=True)
class ItemCreate:
    """`conversation.item.create`. A message's `role` (user, assistant, system) and words (typed text, or an
    audio part's transcript); any other item (a function call, its output) has role None and is kept as
    given. `item` is the item as it will be reported (its id still to be given when the client sent none)."""

    item: dict[str, Any]
    role: str | None
    text: str
    item_id: str | None
    previous_item_id: str | None = None  # None: after the last item; "root": before the first


@dataclass(frozen=True, slots=True)
class ResponseCreate:
    output_modalities: tuple[str, ...] | None = None
    instructions: str | None = None
    max_output_tokens: int | None | bool = False  # False: not given; None: "inf"
    metadata: dict[str, str] | None = None
    out_of_band: bool = False  # `conversation: "none"`, or `input` items: a context of its own
    input: tuple[ItemCreate | str, ...] | None = None  # the context given (items, or ids of the conversation's)
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ResponseCancel:
    response_id: str | None = None


@dataclass(frozen=True, slots=True)
class ItemTruncate:
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True, slots=True)
class ItemRetrieve:
    item_id: str


@dataclass(frozen=True, slots=True)
class ItemDelete:
    item_id: str


ClientEvent = (
    SessionUpdate
    | AudioAppend
    | AudioCommit
    | AudioClear
    | OutputAudioClear
    | ItemCreate
    | ResponseCreate
    | ResponseCancel
    | ItemTruncate
    | ItemRetrieve
    | ItemDelete
)

_MODALITIES = {("audio",), ("text",), ("text", "audio"), ("audio", "text")}
_TOOL_CHOICES = ("auto", "none", "required")
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
# Session fields that change nothing here when they hold these values (OpenAI's own defaults, or what duplexd
# does anyway); any other value is accepted and listed as ignored.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "tracing": (None, "auto"),
    "truncation": (None, "auto"),
    "include": (None, []),
    "prompt": (None,),
    "reasoning": (None,),
    "parallel_tool_calls": (None, True, False),
    "model": (),  # any: one model here
    "type": (),
}


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
        case "output_audio_buffer.clear":
            return OutputAudioClear()
        case "session.update":
            return parse_session(msg.get("session"))
        case "conversation.item.create":
            previous = msg.get("previous_item_id")
            if previous is not None and not isinstance(previous, str):
                raise RealtimeError("invalid_value", "`previous_item_id` must be a string.", param="previous_item_id")
            return _parse_item(msg.get("item"), previous)
        case "response.create":
            return _parse_response(msg.get("response"))
        case "response.cancel":
            rid = msg.get("response_id")
            return ResponseCancel(rid if isinstance(rid, str) else None)
        case "conversation.item.truncate":
            item_id, index, end = msg.get("item_id"), msg.get("content_index", 0), msg.get("audio_end_ms")
            if not isinstance(item_id, str) or not _int(index) or not _int(end) or end < 0:
                raise RealtimeError(
                    "invalid_value", "`item_id` (string) and `audio_end_ms` (integer >= 0) are required."
                )
            return ItemTruncate(item_id, index, end)
        case "conversation.item.retrieve" | "conversation.item.delete":
            item_id = msg.get("item_id")
            if not isinstance(item_id, str):
                raise RealtimeError("invalid_value", "`item_id` (string) is required.", param="item_id")
            return ItemRetrieve(item_id) if kind == "conversation.item.retrieve" else ItemDelete(item_id)
        case str():
            raise RealtimeError("invalid_event", f"Event type {kind[:64]!r} is not supported.", param="type")
    raise RealtimeError("invalid_event", "An event needs a string `type`.", param="type")


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _modalities(value: object, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or tuple(value) not in _MODALITIES:
        raise RealtimeError("invalid_value", f'`{param}` must be ["audio"] or ["text"].', param=param)
    return ("text",) if tuple(value) == ("text",) else ("audio",)


def _max_tokens(value: object, param: str) -> int | None:
    """`max_output_tokens`: an integer in [1, 4096] or "inf" (None)."""
    if value == "inf" or value is None:
        return None
    if not _int(value) or not 1 <= value <= 4096:  # type: ignore[operator]
        raise RealtimeError("invalid_value", f'`{param}` must be an integer in [1, 4096] or "inf".', param=param)
    return value  # type: ignore[return-value]


def _tool_choice(value: object, param: str) -> str | dict[str, Any] | None:
    """ "auto", "none", "required", or `{type: function, name}` / `{type: mcp, server_label, name}`."""
    if value is None:
        return None
    if value in _TOOL_CHOICES:
        return str(value)
    if isinstance(value, dict) and value.get("type") in ("function", "mcp") and isinstance(value.get("name"), str):
        return dict(value)
    raise RealtimeError(
        "invalid_value",
        '`tool_choice` must be "auto", "none", "required", or an object naming a function or MCP tool.',
        param=param,
    )


def _tools(value: object, param: str) -> tuple[dict[str, Any], ...]:
    """`tools`: `function` tools (the client runs their calls) and `mcp` tools (an MCP server's)."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RealtimeError("invalid_value", f"`tools` must be a list of at most {MAX_TOOLS} tools.", param=param)
    out = []
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            assert isinstance(tool, dict)
            if not isinstance(tool.get("name"), str) or not _TOOL_NAME.match(tool["name"]):
                raise RealtimeError(
                    "invalid_value", "A function tool's `name` must match ^[a-zA-Z0-9_-]{1,64}$.", param=f"{where}.name"
                )
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                raise RealtimeError("invalid_value", "`parameters` must be a JSON schema object.", param=where)
            if tool.get("description") is not None and not isinstance(tool["description"], str):
                raise RealtimeError("invalid_value", "`description` must be a string.", param=where)
        elif kind == "mcp":
            assert isinstance(tool, dict)
            if not isinstance(tool.get("server_label"), str) or not tool["server_label"]:
                raise RealtimeError("invalid_value", "An MCP tool needs a `server_label`.", param=where)
        else:
            raise RealtimeError("invalid_value", "A tool's `type` must be function or mcp.", param=f"{where}.type")
        out.append(dict(tool))
    return tuple(out)


def parse_session(session: object) -> SessionUpdate:
    if not isinstance(session, dict):
        raise RealtimeError("invalid_value", "`session` must be an object.", param="session")
    if session.get("type", "realtime") != "realtime":
        raise RealtimeError(
            "invalid_value", "Only `realtime` sessions are supported (not transcription).", param="session.type"
        )
    ignored: list[str] = []
    known = {"instructions", "output_modalities", "audio", "max_output_tokens", "tool_choice", "tools"}
    for key, value in session.items():
        if key not in known and (key not in _NEUTRAL or (_NEUTRAL[key] and value not in _NEUTRAL[key])):
            ignored.append(f"session.{key}")
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
        for key, value in part.items():
            path = f"session.audio.{side}.{key}"
            match side, key:
                case (_, "format") | ("input", "turn_detection") | ("input", "transcription") | ("output", "voice"):
                    pass  # (transcription: duplexd always transcribes, with its own recognizer; one voice)
                case ("input", "noise_reduction") if value is None:
                    pass
                case ("output", "speed") if value in (None, 1, 1.0):
                    pass
                case _:
                    ignored.append(path)
        if side == "input" and "turn_detection" in part:
            detection = _parse_detection(part["turn_detection"], ignored)
    max_tokens: int | None | bool = False
    if "max_output_tokens" in session:
        max_tokens = _max_tokens(session["max_output_tokens"], "session.max_output_tokens")
    return SessionUpdate(
        instructions,
        _modalities(modalities, "session.output_modalities") if modalities is not None else None,
        detection,
        max_tokens,
        _tool_choice(session.get("tool_choice"), "session.tool_choice"),
        tuple(ignored),
        _tools(session["tools"], "session.tools") if session.get("tools") is not None else None,
    )


def _parse_detection(td: object, ignored: list[str]) -> TurnDetection | None:
    if td is None:
        return None
    param = "session.audio.input.turn_detection"
    if not isinstance(td, dict) or td.get("type") not in ("server_vad", "semantic_vad"):
        raise RealtimeError(
            "invalid_value",
            "`turn_detection` must be null, {type: server_vad, ...} or {type: semantic_vad, ...}.",
            param=param,
        )
    kind = td["type"]
    fields = (
        ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")
        if kind == "server_vad"
        else ("eagerness",)
    )
    for key in td:
        if key not in ("type", "create_response", "interrupt_response", *fields):
            ignored.append(f"{param}.{key}")
    threshold = td.get("threshold") if kind == "server_vad" else None
    if threshold is not None and (not isinstance(threshold, int | float) or not 0.0 <= threshold <= 1.0):
        raise RealtimeError("invalid_value", "`threshold` must be a number in [0, 1].", param=f"{param}.threshold")
    ms: dict[str, int | None] = {}
    for key, top in (("prefix_padding_ms", 10_000), ("silence_duration_ms", 10_000), ("idle_timeout_ms", 3_600_000)):
        value = td.get(key) if kind == "server_vad" else None
        if value is not None and (not _int(value) or not 0 <= value <= top):
            raise RealtimeError("invalid_value", f"`{key}` must be an integer in [0, {top}].", param=f"{param}.{key}")
        ms[key] = value
    eagerness = td.get("eagerness") or "auto"
    if kind == "semantic_vad" and eagerness not in ("low", "medium", "high", "auto"):
        raise RealtimeError(
            "invalid_value", "`eagerness` must be low, medium, high or auto.", param=f"{param}.eagerness"
        )
    for key in ("create_response", "interrupt_response"):
        if td.get(key) is not None and not isinstance(td.get(key), bool):
            raise RealtimeError("invalid_value", f"`{key}` must be a boolean.", param=f"{param}.{key}")
    return TurnDetection(
        type=kind,
        threshold=None if threshold is None else float(threshold),
        prefix_padding_ms=ms["prefix_padding_ms"],
        silence_duration_ms=ms["silence_duration_ms"],
        idle_timeout_ms=ms["idle_timeout_ms"] or None,
        eagerness=eagerness,
        create_response=td.get("create_response") is not False,
        interrupt_response=td.get("interrupt_response") is not False,
    )


def _parse_response(response: object) -> ResponseCreate:
    if response is None:
        return ResponseCreate()
    if not isinstance(response, dict):
        raise RealtimeError("invalid_value", "`response` must be an object.", param="response")
    ignored: list[str] = []
    for key, value in response.items():
        if key in ("output_modalities", "instructions", "max_output_tokens", "metadata", "conversation", "input"):
            continue
        if key == "tool_choice":  # (a response's own tools and tool_choice: the session's apply)
            if _tool_choice(value, "response.tool_choice") not in (None, "auto"):
                ignored.append("response.tool_choice")
        elif key == "tools":
            if _tools(value, "response.tools"):
                ignored.append("response.tools")
        elif key == "audio":
            voice = value.get("output", {}).get("voice") if isinstance(value, dict) else None
            if voice is None and isinstance(value, dict) and value.get("output", {}).get("format") is None:
                continue
            ignored.append("response.audio")  # one voice, 24 kHz PCM
        elif key not in _NEUTRAL or (_NEUTRAL[key] and value not in _NEUTRAL[key]):
            ignored.append(f"response.{key}")
    modalities = response.get("output_modalities")
    instructions = response.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RealtimeError("invalid_value", "`instructions` must be a string.", param="response.instructions")
    metadata = response.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_KEYS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()
        )
    ):
        raise RealtimeError(
            "invalid_value",
            "`metadata` must map at most 16 string keys (up to 64 characters) to strings (up to 512).",
            param="response.metadata",
        )
    conversation = response.get("conversation", "auto")
    if conversation is not None and not isinstance(conversation, str):
        raise RealtimeError("invalid_value", '`conversation` must be "auto" or "none".', param="response.conversation")
    return ResponseCreate(
        output_modalities=_modalities(modalities, "response.output_modalities") if modalities else None,
        instructions=instructions,
        max_output_tokens=_max_tokens(response["max_output_tokens"], "response.max_output_tokens")
        if "max_output_tokens" in response
        else False,
        metadata=dict(metadata) if metadata is not None else None,
        out_of_band=conversation == "none" or response.get("input") is not None,
        input=_parse_input(response.get("input")),
        ignored=tuple(ignored),
    )


def _parse_input(value: object) -> tuple[ItemCreate | str, ...] | None:
    """`response.input`: items, or `item_reference`s to the conversation's items (by id)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_INPUT_ITEMS:
        raise RealtimeError(
            "invalid_value", f"`input` must be a list of at most {MAX_INPUT_ITEMS} items.", param="response.input"
        )
    out: list[ItemCreate | str] = []
    for item in value:
        if isinstance(item, dict) and item.get("type") == "item_reference":
            if not isinstance(item.get("id"), str):
                raise RealtimeError("invalid_value", "An `item_reference` needs a string `id`.", param="response.input")
            out.append(item["id"])
        else:
            out.append(_parse_item(item, None))
    return tuple(out)


# Message content parts by role, and the field that holds each part's words.
_PARTS = {
    "user": {"input_text": "text", "input_audio": "transcript", "input_image": None},
    "system": {"input_text": "text"},
    "assistant": {"output_text": "text", "output_audio": "transcript", "text": "text", "audio": "transcript"},
}


def _parse_item(item: object, previous_item_id: str | None) -> ItemCreate:
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        raise RealtimeError("invalid_value", "`item` must be an object with a string `type`.", param="item")
    item_id = item.get("id") if isinstance(item.get("id"), str) else None
    if item["type"] != "message":  # (function calls and their outputs: kept; tools come with function calling)
        return ItemCreate(dict(item), None, "", item_id, previous_item_id)
    role = item.get("role")
    if role not in _PARTS:
        raise RealtimeError("invalid_value", "`item.role` must be user, assistant or system.", param="item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise RealtimeError("invalid_value", "`item.content` must be a non-empty list.", param="item.content")
    texts, parts = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PARTS[role]:
            allowed = ", ".join(_PARTS[role])
            raise RealtimeError(
                "invalid_value", f"`item.content` of a {role} message holds {allowed} parts.", param="item.content"
            )
        assert isinstance(part, dict)
        field = _PARTS[role][kind]
        words = part.get(field) if field is not None else None
        if words is not None and not isinstance(words, str):
            raise RealtimeError("invalid_value", f"`{kind}.{field}` must be a string.", param="item.content")
        if words:
            texts.append(words)
        parts.append({k: v for k, v in part.items() if k not in ("audio", "image_url")})  # (not kept: size)
    kept = {**item, "content": parts}
    return ItemCreate(kept, role, " ".join(texts), item_id, previous_item_id)
