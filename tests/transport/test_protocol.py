"""Wire protocol v1: client messages parsed (or refused with the exact error), server events encoded."""

from __future__ import annotations

import json

import pytest

from duplexd import events as ev
from duplexd.errors import ErrorCode, ProtocolError
from duplexd.transport.protocol import (
    BINARY_HEADER,
    AudioFrame,
    BinaryKind,
    Limits,
    Playback,
    ReplyCancel,
    SessionEnd,
    SessionStart,
    SessionUpdate,
    UserText,
    dumps,
    encode_audio_frame,
    encode_event,
    error_message,
    parse_audio_out,
    parse_binary,
    parse_text,
)

LIMITS = Limits(min_sample_rate=8000, max_sample_rate=48000, max_frame_ms=200, max_message_bytes=64 * 1024)


def start(**fields: object) -> str:
    return json.dumps({"type": "session.start", **fields})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (start(version=1, sample_rate=16000), SessionStart(1, 16000)),
        (start(version=1, sample_rate=8000), SessionStart(1, 8000)),
        (start(version=1, sample_rate=48000), SessionStart(1, 48000)),
        (start(version=1, sample_rate=44100, extra={"ignored": True}), SessionStart(1, 44100)),
        ('{"type": "session.end"}', SessionEnd()),
        ('  {"type":"session.end", "reason": "bye"}  ', SessionEnd()),
        (start(version=1, sample_rate=16000, dialog=False), SessionStart(1, 16000, dialog=False)),
        ('{"type": "playback", "played_ms": 1520.5}', Playback(1520.5)),
        ('{"type": "playback", "played_ms": 0}', Playback(0.0)),
        ('{"type": "reply.cancel"}', ReplyCancel()),
        ('{"type": "user.text", "text": "  Hello there. "}', UserText("Hello there.")),
        ('{"type": "session.update"}', SessionUpdate()),
        ('{"type": "session.update", "voice": false}', SessionUpdate(voice=False)),
        ('{"type": "session.update", "instructions": "Be brief.", "voice": true}', SessionUpdate("Be brief.", True)),
    ],
)
def test_parse_text(text: str, expected: object) -> None:
    assert parse_text(text, LIMITS) == expected


BAD_TEXT = [
    # (text, code, fatal)
    pytest.param("", ErrorCode.BAD_JSON, False, id="empty"),
    pytest.param("{", ErrorCode.BAD_JSON, False, id="truncated"),
    pytest.param("hello", ErrorCode.BAD_JSON, False, id="not-json"),
    pytest.param("{'type': 'session.end'}", ErrorCode.BAD_JSON, False, id="single-quotes"),
    pytest.param("[" * 100_000 + "]" * 100_000, ErrorCode.BAD_JSON, False, id="nested-too-deep"),
    pytest.param('[{"type": "session.end"}]', ErrorCode.BAD_MESSAGE, False, id="array"),
    pytest.param("null", ErrorCode.BAD_MESSAGE, False, id="null"),
    pytest.param("42", ErrorCode.BAD_MESSAGE, False, id="number"),
    pytest.param('"session.end"', ErrorCode.BAD_MESSAGE, False, id="string"),
    pytest.param("{}", ErrorCode.BAD_MESSAGE, False, id="missing-type"),
    pytest.param('{"type": 1}', ErrorCode.BAD_MESSAGE, False, id="type-number"),
    pytest.param('{"type": null}', ErrorCode.BAD_MESSAGE, False, id="type-null"),
    pytest.param('{"type": ["session.end"]}', ErrorCode.BAD_MESSAGE, False, id="type-list"),
    pytest.param('{"type": "session.restart"}', ErrorCode.UNKNOWN_TYPE, False, id="unknown-type"),
    pytest.param('{"type": "SESSION.END"}', ErrorCode.UNKNOWN_TYPE, False, id="type-is-case-sensitive"),
    pytest.param('{"type": ""}', ErrorCode.UNKNOWN_TYPE, False, id="empty-type"),
    pytest.param(start(sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-missing"),
    pytest.param(start(version=0, sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-0"),
    pytest.param(start(version=2, sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-2"),
    pytest.param(start(version="1", sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-string"),
    pytest.param(start(version=True, sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-true"),
    pytest.param(start(version=1.0, sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-float"),
    pytest.param(start(version=None, sample_rate=16000), ErrorCode.UNSUPPORTED_VERSION, True, id="version-null"),
    pytest.param(start(version=1), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-missing"),
    pytest.param(start(version=1, sample_rate="16000"), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-string"),
    pytest.param(start(version=1, sample_rate=16000.0), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-float"),
    pytest.param(start(version=1, sample_rate=True), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-bool"),
    pytest.param(start(version=1, sample_rate=None), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-null"),
    pytest.param(start(version=1, sample_rate=7999), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-too-low"),
    pytest.param(start(version=1, sample_rate=48001), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-too-high"),
    pytest.param(start(version=1, sample_rate=0), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-zero"),
    pytest.param(start(version=1, sample_rate=-16000), ErrorCode.BAD_SAMPLE_RATE, True, id="rate-negative"),
    pytest.param(start(version=2, sample_rate="x"), ErrorCode.UNSUPPORTED_VERSION, True, id="version-checked-first"),
    pytest.param(start(version=1, sample_rate=16000, dialog="yes"), ErrorCode.BAD_MESSAGE, True, id="dialog-string"),
    pytest.param('{"type": "playback"}', ErrorCode.BAD_PLAYBACK, False, id="playback-missing"),
    pytest.param('{"type": "playback", "played_ms": "5"}', ErrorCode.BAD_PLAYBACK, False, id="playback-string"),
    pytest.param('{"type": "playback", "played_ms": true}', ErrorCode.BAD_PLAYBACK, False, id="playback-bool"),
    pytest.param('{"type": "playback", "played_ms": NaN}', ErrorCode.BAD_PLAYBACK, False, id="playback-nan"),
    pytest.param('{"type": "playback", "played_ms": Infinity}', ErrorCode.BAD_PLAYBACK, False, id="playback-inf"),
    pytest.param('{"type": "user.text"}', ErrorCode.BAD_MESSAGE, False, id="text-missing"),
    pytest.param('{"type": "user.text", "text": " "}', ErrorCode.BAD_MESSAGE, False, id="text-blank"),
    pytest.param('{"type": "user.text", "text": ["hi"]}', ErrorCode.BAD_MESSAGE, False, id="text-list"),
    pytest.param(json.dumps({"type": "user.text", "text": "x" * 4001}), ErrorCode.BAD_MESSAGE, False, id="text-long"),
    pytest.param('{"type": "session.update", "voice": 1}', ErrorCode.BAD_MESSAGE, False, id="voice-number"),
    pytest.param('{"type": "session.update", "instructions": 7}', ErrorCode.BAD_MESSAGE, False, id="prompt-number"),
]


@pytest.mark.parametrize(("text", "code", "fatal"), BAD_TEXT)
def test_parse_text_refuses(text: str, code: ErrorCode, fatal: bool) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_text(text, LIMITS)
    assert info.value.code == code
    assert info.value.fatal is fatal
    assert info.value.message == str(info.value)
    assert info.value.message


def test_unknown_type_message_is_bounded() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_text(json.dumps({"type": "x" * 10_000}), LIMITS)
    assert len(info.value.message) < 200


def test_sample_rate_limits_come_from_the_limits() -> None:
    narrow = Limits(min_sample_rate=16000, max_sample_rate=16000, max_frame_ms=200, max_message_bytes=65536)
    assert parse_text(start(version=1, sample_rate=16000), narrow) == SessionStart(1, 16000)
    with pytest.raises(ProtocolError) as info:
        parse_text(start(version=1, sample_rate=8000), narrow)
    assert info.value.code == ErrorCode.BAD_SAMPLE_RATE


def pcm(samples: int) -> bytes:
    return bytes(range(256)) * (2 * samples // 256) + bytes(2 * samples % 256)


BAD_BINARY = [
    # (data, sample_rate, code)
    pytest.param(b"", 16000, ErrorCode.BAD_FRAME, id="empty"),
    pytest.param(b"\x01\x00\x00\x00\x00\x00\x00", 16000, ErrorCode.BAD_FRAME, id="shorter-than-header"),
    pytest.param(b"\x02\x00\x00\x00\x00\x00\x00\x00" + pcm(320), 16000, ErrorCode.BAD_FRAME, id="unknown-kind"),
    pytest.param(b"\x00\x00\x00\x00\x00\x00\x00\x00" + pcm(320), 16000, ErrorCode.BAD_FRAME, id="kind-zero"),
    pytest.param(encode_audio_frame(0, b""), 16000, ErrorCode.BAD_FRAME, id="empty-payload"),
    pytest.param(encode_audio_frame(0, b"\x01"), 16000, ErrorCode.BAD_FRAME, id="one-byte"),
    pytest.param(encode_audio_frame(0, pcm(320) + b"\x01"), 16000, ErrorCode.BAD_FRAME, id="odd-byte-count"),
    pytest.param(encode_audio_frame(0, pcm(3201)), 16000, ErrorCode.FRAME_TOO_LONG, id="201ms-at-16k"),
    pytest.param(encode_audio_frame(0, pcm(1601)), 8000, ErrorCode.FRAME_TOO_LONG, id="201ms-at-8k"),
    pytest.param(encode_audio_frame(0, pcm(9601)), 48000, ErrorCode.FRAME_TOO_LONG, id="201ms-at-48k"),
    pytest.param(encode_audio_frame(0, pcm(8821)), 44100, ErrorCode.FRAME_TOO_LONG, id="over-200ms-at-44.1k"),
]


@pytest.mark.parametrize(("data", "rate", "code"), BAD_BINARY)
def test_parse_binary_refuses(data: bytes, rate: int, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_binary(data, rate, LIMITS)
    assert info.value.code == code
    assert info.value.fatal is False  # one bad frame is dropped, the session goes on


@pytest.mark.parametrize(
    ("seq", "samples", "rate"),
    [(0, 1, 16000), (1, 320, 16000), (2**32 - 1, 3200, 16000), (7, 1600, 8000), (9, 9600, 48000), (3, 8820, 44100)],
)
def test_audio_frame_round_trip(seq: int, samples: int, rate: int) -> None:
    payload = pcm(samples)
    data = encode_audio_frame(seq, payload)
    assert len(data) == BINARY_HEADER.size + len(payload) == 8 + 2 * samples
    assert data[:4] == b"\x01\x00\x00\x00"
    assert data[4:8] == seq.to_bytes(4, "little")
    frame = parse_binary(data, rate, LIMITS)
    assert frame == AudioFrame(seq=seq, pcm=payload)
    assert type(frame.pcm) is bytes


def test_parse_binary_accepts_memoryview_and_copies() -> None:
    buf = bytearray(encode_audio_frame(5, pcm(10)))
    frame = parse_binary(memoryview(buf), 16000, LIMITS)
    buf[8:] = bytes(20)
    assert frame.pcm == pcm(10)


def test_encode_audio_frame_wraps_seq_to_32_bits() -> None:
    assert parse_binary(encode_audio_frame(2**32 + 5, pcm(4)), 16000, LIMITS).seq == 5


W1, W2 = ev.Word("hello", 0.12345, 0.5), ev.Word("world", 0.6, 1.0004)
WORDS = [{"w": "hello", "start": 0.123, "end": 0.5}, {"w": "world", "start": 0.6, "end": 1.0}]

ENCODED = [
    (
        ev.FrameAcked(seq=7, lag_ms=12.3456, max_lag_ms=40.001),
        {"type": "frame.ack", "seq": 7, "lag_ms": 12.35, "max_lag_ms": 40.0},
    ),
    (ev.SpeechStarted(t_s=1.23456), {"type": "vad.speech_started", "t": 1.235}),
    (ev.SpeechStopped(t_s=2.0), {"type": "vad.speech_stopped", "t": 2.0}),
    (
        ev.TranscriptUpdated(utterance=3, words=(W1, W2), committed=1),
        {"type": "transcript.partial", "utterance": 3, "text": "hello world", "words": WORDS, "committed": 1},
    ),
    (
        ev.UtteranceFinalized(utterance=3, words=(W1, W2)),
        {"type": "transcript.final", "utterance": 3, "text": "hello world", "words": WORDS},
    ),
    (
        ev.UtteranceFinalized(utterance=4, words=(W2,), continues=3, previous=(W1,)),
        {
            "type": "transcript.final",
            "utterance": 4,
            "text": "world",
            "words": WORDS[1:],
            "continues": 3,
            "previous_text": "hello",
        },
    ),
    (
        ev.TurnEnded(turn=2, text="What time is it?", eos_s=3.2104, silence_ms=412.04, p_end=0.123456, p_audio=0.97123),
        {
            "type": "turn.ended",
            "turn": 2,
            "text": "What time is it?",
            "eos": 3.21,
            "silence_ms": 412.0,
            "p_end": 0.12346,
            "p_audio": 0.971,
        },
    ),
    (
        ev.TurnContinued(turn=2, text="The frosty air passed."),
        {"type": "turn.continued", "turn": 2, "text": "The frosty air passed."},
    ),
    (ev.ReplyStarted(reply=2), {"type": "reply.started", "reply": 2}),
    (
        ev.ReplySpeculation(reply=2, drafts=2, hit=True, draft_tokens=16),
        {"type": "reply.speculation", "reply": 2, "drafts": 2, "hit": True, "draft_tokens": 16},
    ),
    (
        ev.ReplyRelayed(reply=2, text="It is", model="smollm2", remote_model="big", decided_ms=81.26),
        {
            "type": "reply.relayed",
            "reply": 2,
            "text": "It is",
            "model": "smollm2",
            "remote_model": "big",
            "decided_ms": 81.3,
        },
    ),
    (
        ev.ReplyToolCalled(
            reply=2,
            call_id="call_1",
            name="lookup_order",
            arguments='{"order_id": "7"}',
            server="orders",
            output="Order 7 is shipped.",
            elapsed_ms=301.26,
            early=True,
        ),
        {
            "type": "reply.tool",
            "reply": 2,
            "call_id": "call_1",
            "name": "lookup_order",
            "arguments": '{"order_id": "7"}',
            "server": "orders",
            "output": "Order 7 is shipped.",
            "error": False,
            "elapsed_ms": 301.3,
            "early": True,
            "waited_ms": 0.0,
        },
    ),
    (
        ev.ReplyToolCalled(reply=3, call_id="c", name="get_weather", arguments="{}"),
        {
            "type": "reply.tool",
            "reply": 3,
            "call_id": "c",
            "name": "get_weather",
            "arguments": "{}",
            "server": None,
            "output": None,
            "error": False,
            "elapsed_ms": 0.0,
            "early": False,
            "waited_ms": 0.0,
        },
    ),
    (ev.ReplyDelta(reply=2, text=" It is"), {"type": "reply.delta", "reply": 2, "text": " It is"}),
    (
        ev.ReplyDone(reply=2, text="It is noon.", audio_ms=1234.56),
        {"type": "reply.done", "reply": 2, "text": "It is noon.", "audio_ms": 1234.6},
    ),
    (ev.ReplyPaused(reply=2, played_ms=812.04), {"type": "reply.paused", "reply": 2, "played_ms": 812.0}),
    (ev.ReplyResumed(reply=2, paused_ms=700.06), {"type": "reply.resumed", "reply": 2, "paused_ms": 700.1}),
    (
        ev.ReplyInterrupted(reply=2, heard_ms=500.04, heard_text="It", reason="barge_in", by="no wait"),
        {
            "type": "reply.interrupted",
            "reply": 2,
            "heard_ms": 500.0,
            "heard_text": "It",
            "reason": "barge_in",
            "by": "no wait",
        },
    ),
    (
        ev.ReplyInterrupted(reply=2, heard_ms=0.0, heard_text="", reason="cancel"),
        {"type": "reply.interrupted", "reply": 2, "heard_ms": 0.0, "heard_text": "", "reason": "cancel"},
    ),
    (
        ev.ErrorRaised(ErrorCode.ASR_BEHIND, "recognizer fell behind"),
        {"type": "error", "code": "asr_behind", "message": "recognizer fell behind"},
    ),
]


@pytest.mark.parametrize(("event", "expected"), [pytest.param(e, m, id=m["type"]) for e, m in ENCODED])
def test_encode_event(event: ev.Event, expected: dict[str, object]) -> None:
    msg = encode_event(event)
    assert msg == expected
    assert json.loads(dumps(msg)) == expected  # plain JSON on the wire


def test_every_event_type_has_an_encoding() -> None:
    event_types = set(ev.Event.__args__)
    assert {type(e) for e, _ in ENCODED} == event_types


def test_non_events_are_not_encoded() -> None:
    with pytest.raises(TypeError):
        encode_event(ev.Word("x", 0.0, 1.0))  # type: ignore[arg-type]


def test_error_message() -> None:
    assert error_message(ErrorCode.OUT_OF_ORDER, "late") == {"type": "error", "code": "out_of_order", "message": "late"}
    assert dumps({"a": 1, "b": [1, 2]}) == '{"a":1,"b":[1,2]}'


def test_audio_out_frames_round_trip_and_are_told_apart() -> None:
    pcm = bytes(range(8)) * 2
    frame = encode_audio_frame(7, pcm, BinaryKind.AUDIO_OUT)
    assert parse_audio_out(frame) == AudioFrame(7, pcm)
    with pytest.raises(ProtocolError):
        parse_audio_out(encode_audio_frame(7, pcm))  # audio in is not audio out
    with pytest.raises(ProtocolError) as info:
        parse_binary(frame, 16000, LIMITS)  # nor is audio out accepted as audio in
    assert info.value.code == ErrorCode.BAD_FRAME
