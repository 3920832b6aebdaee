"""Wire protocol v1 (docs/protocol.md): parsing client messages, encoding server events.

Pure: bytes/str in, typed messages out, or a `ProtocolError` naming what is wrong.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

from duplexd import events as ev
from duplexd.errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})


class ClientType(StrEnum):
    SESSION_START = "session.start"
    SESSION_END = "session.end"
    PLAYBACK = "playback"
    REPLY_CANCEL = "reply.cancel"
    ACK = "ack"
    SESSION_RESUME = "session.resume"
    SESSION_UPDATE = "session.update"
    USER_TEXT = "user.text"


class ServerType(StrEnum):
    SESSION_STARTED = "session.started"
    SESSION_ENDED = "session.ended"
    SESSION_RESUMED = "session.resumed"
    SESSION_UPDATED = "session.updated"
    FRAME_ACK = "frame.ack"
    SPEECH_STARTED = "vad.speech_started"
    SPEECH_STOPPED = "vad.speech_stopped"
    TRANSCRIPT_PARTIAL = "transcript.partial"
    TRANSCRIPT_FINAL = "transcript.final"
    TURN_ENDED = "turn.ended"
    TURN_CONTINUED = "turn.continued"
    REPLY_STARTED = "reply.started"
    REPLY_SPECULATION = "reply.speculation"
    REPLY_RELAYED = "reply.relayed"
    REPLY_TOOL = "reply.tool"
    REPLY_DELTA = "reply.delta"
    REPLY_DONE = "reply.done"
    REPLY_PAUSED = "reply.paused"
    REPLY_RESUMED = "reply.resumed"
    REPLY_INTERRUPTED = "reply.interrupted"
    ERROR = "error"


class BinaryKind(IntEnum):
    """First byte of every binary message."""

    AUDIO_IN = 1  # client -> server: PCM16 LE mono at the session's sample rate
    AUDIO_OUT = 2  # server -> client: reply audio, PCM16 LE mono at OUTPUT_SAMPLE_RATE


# kind (u8), 3 reserved zero bytes, sequence number (u32 LE); 8 bytes keep the PCM16 payload aligned.
BINARY_HEADER = struct.Struct("<B3xI")


@dataclass(frozen=True, slots=True)
class SessionStart:
    version: int
    sample_rate: int
    dialog: bool = True
    datagram: bool = False  # also send reply tokens over the UDP datagram path


@dataclass(frozen=True, slots=True)
class SessionResume:
    """First message of a new connection that continues a session whose connection dropped."""

    version: int
    session_id: str
    resume_token: str
    token_seq: int  # the client has rendered every reply token up to this one
    audio_ms: float  # ... and received this much of the output audio stream
    event_seq: int | None = None  # ... and every event up to this `n` (None: replay none)


@dataclass(frozen=True, slots=True)
class TokenAck:
    token_seq: int | None  # every reply token up to this one has been rendered
    event_seq: int | None = None  # every event up to this `n` has been received


@dataclass(frozen=True, slots=True)
class SessionEnd:
    pass


@dataclass(frozen=True, slots=True)
class Playback:
    played_ms: float


@dataclass(frozen=True, slots=True)
class ReplyCancel:
    pass


@dataclass(frozen=True, slots=True)
class SessionUpdate:
    """New settings for the rest of the session (None: unchanged)."""

    instructions: str | None = None  # the LLM's system prompt
    voice: bool | None = None  # replies are spoken (False: text only)


@dataclass(frozen=True, slots=True)
class UserText:
    """A typed user turn: answered at once, as a spoken turn that ended would be."""

    text: str


@dataclass(frozen=True, slots=True)
class AudioFrame:
    seq: int
    pcm: bytes  # PCM16 LE mono, an even number of bytes, at least one sample


TextMessage = SessionStart | SessionResume | SessionEnd | Playback | ReplyCancel | TokenAck | SessionUpdate | UserText
MAX_TEXT_CHARS = 4000  # a typed turn
MAX_INSTRUCTIONS_CHARS = 16000  # a system prompt (the LLM's window holds less: the engine keeps its start)
ClientMessage = TextMessage | AudioFrame


@dataclass(frozen=True, slots=True)
class Limits:
    min_sample_rate: int
    max_sample_rate: int
    max_frame_ms: int
    max_message_bytes: int


def parse_text(data: str, limits: Limits) -> TextMessage:
    try:
        msg = json.loads(data)
    except (json.JSONDecodeError, RecursionError):
        raise ProtocolError(ErrorCode.BAD_JSON, "message is not valid JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "message must be a JSON object")
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "message needs a string 'type'")
    if kind == ClientType.SESSION_START:
        return _parse_start(msg, limits)
    if kind == ClientType.SESSION_END:
        return SessionEnd()
    if kind == ClientType.PLAYBACK:
        played = msg.get("played_ms")
        if not isinstance(played, int | float) or isinstance(played, bool) or not math.isfinite(played):
            raise ProtocolError(ErrorCode.BAD_PLAYBACK, "playback.played_ms must be a finite number (ms)")
        return Playback(float(played))
    if kind == ClientType.REPLY_CANCEL:
        return ReplyCancel()
    if kind == ClientType.ACK:
        seq, events = msg.get("token_seq"), msg.get("event_seq")
        if (seq is None and events is None) or any(v is not None and not _is_count(v) for v in (seq, events)):
            raise ProtocolError(ErrorCode.BAD_ACK, "ack needs token_seq and/or event_seq, non-negative integers")
        return TokenAck(seq, events)
    if kind == ClientType.SESSION_RESUME:
        return _parse_resume(msg)
    if kind == ClientType.USER_TEXT:
        text = msg.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT_CHARS:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"user.text.text must be a non-empty string of at most {MAX_TEXT_CHARS} characters",
            )
        return UserText(text.strip())
    if kind == ClientType.SESSION_UPDATE:
        return _parse_update(msg)
    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind[:64]!r}")


def _parse_start(msg: dict[str, Any], limits: Limits) -> SessionStart:
    version = msg.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported (supported: {sorted(SUPPORTED_VERSIONS)})",
            fatal=True,
        )
    rate = msg.get("sample_rate")
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise ProtocolError(ErrorCode.BAD_SAMPLE_RATE, "sample_rate must be an integer (Hz)", fatal=True)
    if not limits.min_sample_rate <= rate <= limits.max_sample_rate:
        raise ProtocolError(
            ErrorCode.BAD_SAMPLE_RATE,
            f"sample_rate {rate} Hz is outside [{limits.min_sample_rate}, {limits.max_sample_rate}]",
            fatal=True,
        )
    dialog, datagram = msg.get("dialog", True), msg.get("datagram", False)
    if not isinstance(dialog, bool) or not isinstance(datagram, bool):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, "session.start.dialog and .datagram must be true or false", fatal=True
        )
    return SessionStart(version=version, sample_rate=rate, dialog=dialog, datagram=datagram)


def _parse_update(msg: dict[str, Any]) -> SessionUpdate:
    instructions, voice = msg.get("instructions"), msg.get("voice")
    if instructions is not None and (not isinstance(instructions, str) or len(instructions) > MAX_INSTRUCTIONS_CHARS):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE,
            f"session.update.instructions must be a string of at most {MAX_INSTRUCTIONS_CHARS} characters",
        )
    if voice is not None and not isinstance(voice, bool):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "session.update.voice must be true or false")
    return SessionUpdate(instructions, voice)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53


def _parse_resume(msg: dict[str, Any]) -> SessionResume:
    version = msg.get("version", PROTOCOL_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version!r} is not supported", fatal=True)
    sid, token, seq, audio_ms = (msg.get(k) for k in ("session_id", "resume_token", "token_seq", "audio_ms"))
    if not isinstance(sid, str) or not isinstance(token, str) or len(sid) > 128 or len(token) > 256:
        raise ProtocolError(
            ErrorCode.RESUME_REFUSED, "session.resume needs string session_id and resume_token", fatal=True
        )
    if not _is_count(seq):
        raise ProtocolError(ErrorCode.RESUME_REFUSED, "session.resume.token_seq must be an integer >= 0", fatal=True)
    if not isinstance(audio_ms, int | float) or isinstance(audio_ms, bool) or not 0 <= audio_ms < math.inf:
        raise ProtocolError(ErrorCode.RESUME_REFUSED, "session.resume.audio_ms must be a number >= 0", fatal=True)
    events = msg.get("event_seq")
    if events is not None and not _is_count(events):
        raise ProtocolError(ErrorCode.RESUME_REFUSED, "session.resume.event_seq must be an integer >= 0", fatal=True)
    return SessionResume(version, sid, token, seq, float(audio_ms), events)


def _split_binary(data: bytes, expected: BinaryKind) -> tuple[int, bytes]:
    """(seq, payload) of a binary message of kind `expected`, or a `bad_frame` error."""
    if len(data) < BINARY_HEADER.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"binary message shorter than its {BINARY_HEADER.size}-byte header")
    kind, seq = BINARY_HEADER.unpack_from(data)
    if kind != expected:
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"binary message kind {kind}, expected {int(expected)} ({expected.name})"
        )
    return seq, data[BINARY_HEADER.size :]


def parse_binary(data: bytes, sample_rate: int, limits: Limits) -> AudioFrame:
    seq, pcm = _split_binary(data, BinaryKind.AUDIO_IN)
    if not pcm or len(pcm) % 2:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"audio payload of {len(pcm)} bytes is not whole PCM16 samples")
    max_samples = sample_rate * limits.max_frame_ms // 1000
    if len(pcm) // 2 > max_samples:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LONG,
            f"audio frame of {len(pcm) // 2} samples exceeds max_frame_ms={limits.max_frame_ms}",
        )
    return AudioFrame(seq=seq, pcm=bytes(pcm))


def encode_audio_frame(seq: int, pcm: bytes, kind: BinaryKind = BinaryKind.AUDIO_IN) -> bytes:
    return BINARY_HEADER.pack(kind, seq & 0xFFFFFFFF) + pcm


def parse_audio_out(data: bytes) -> AudioFrame:
    """A server's reply-audio frame (for clients)."""
    seq, pcm = _split_binary(data, BinaryKind.AUDIO_OUT)
    return AudioFrame(seq=seq, pcm=bytes(pcm))


def _words(words: tuple[ev.Word, ...]) -> list[dict[str, Any]]:
    return [{"w": w.text, "start": round(w.start_s, 3), "end": round(w.end_s, 3)} for w in words]


def encode_event(event: ev.Event) -> dict[str, Any]:
    match event:
        case ev.FrameAcked(seq=seq, lag_ms=lag, max_lag_ms=worst):
            return {"type": ServerType.FRAME_ACK, "seq": seq, "lag_ms": round(lag, 2), "max_lag_ms": round(worst, 2)}
        case ev.SpeechStarted(t_s=t):
            return {"type": ServerType.SPEECH_STARTED, "t": round(t, 3)}
        case ev.SpeechStopped(t_s=t):
            return {"type": ServerType.SPEECH_STOPPED, "t": round(t, 3)}
        case ev.TranscriptUpdated(utterance=u, committed=c):
            return {
                "type": ServerType.TRANSCRIPT_PARTIAL,
                "utterance": u,
                "text": event.text,
                "words": _words(event.shown),
                "committed": c,
            }
        case ev.UtteranceFinalized(utterance=u, words=words, continues=continues, previous=previous):
            final = {"type": ServerType.TRANSCRIPT_FINAL, "utterance": u, "text": event.text, "words": _words(words)}
            if continues is not None:
                final["continues"] = continues
            if previous is not None:
                final["previous_text"] = " ".join(w.text for w in previous)
            return final
        case ev.TurnEnded(turn=turn, text=text, eos_s=eos, silence_ms=silence, p_end=p, p_audio=pa):
            return {
                "type": ServerType.TURN_ENDED,
                "turn": turn,
                "text": text,
                "eos": round(eos, 3),
                "silence_ms": round(silence, 1),
                "p_end": None if p is None else round(p, 5),
                "p_audio": None if pa is None else round(pa, 3),
            }
        case ev.TurnContinued(turn=turn, text=text):
            return {"type": ServerType.TURN_CONTINUED, "turn": turn, "text": text}
        case ev.ReplyStarted(reply=r):
            return {"type": ServerType.REPLY_STARTED, "reply": r}
        case ev.ReplySpeculation(reply=r, drafts=drafts, hit=hit, draft_tokens=n):
            return {"type": ServerType.REPLY_SPECULATION, "reply": r, "drafts": drafts, "hit": hit, "draft_tokens": n}
        case ev.ReplyRelayed(reply=r, text=text, model=model, remote_model=remote, decided_ms=ms):
            return {
                "type": ServerType.REPLY_RELAYED,
                "reply": r,
                "text": text,
                "model": model,
                "remote_model": remote,
                "decided_ms": round(ms, 1),
            }
        case ev.ReplyToolCalled() as call:
            return {
                "type": ServerType.REPLY_TOOL,
                "reply": call.reply,
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
                "server": call.server or None,
                "output": call.output,
                "error": call.error,
                "elapsed_ms": round(call.elapsed_ms, 1),
                "early": call.early,
                "waited_ms": round(call.waited_ms, 1),
            }
        case ev.ReplyDelta(reply=r, text=text):
            return {"type": ServerType.REPLY_DELTA, "reply": r, "text": text}  # the shell adds its token_seq
        case ev.ReplyDone(reply=r, text=text, audio_ms=ms):
            return {"type": ServerType.REPLY_DONE, "reply": r, "text": text, "audio_ms": round(ms, 1)}
        case ev.ReplyPaused(reply=r, played_ms=ms):
            return {"type": ServerType.REPLY_PAUSED, "reply": r, "played_ms": round(ms, 1)}
        case ev.ReplyResumed(reply=r, paused_ms=ms):
            return {"type": ServerType.REPLY_RESUMED, "reply": r, "paused_ms": round(ms, 1)}
        case ev.ReplyInterrupted(reply=r, heard_ms=ms, heard_text=text, reason=reason, by=by):
            interrupted = {
                "type": ServerType.REPLY_INTERRUPTED,
                "reply": r,
                "heard_ms": round(ms, 1),
                "heard_text": text,
                "reason": reason,
            }
            return interrupted | ({"by": by} if reason == "barge_in" else {})
        case ev.ErrorRaised(code=code, message=message):
            return error_message(code, message)
    raise TypeError(f"no wire encoding for {type(event).__name__}")


def error_message(code: ErrorCode, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": ServerType.ERROR, "code": str(code), "message": message, **extra}


def dumps(msg: dict[str, Any]) -> str:
    return json.dumps(msg, separators=(",", ":"))
