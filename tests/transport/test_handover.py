"""The resume handover without sockets: what a resuming connection sends, in which order."""

from __future__ import annotations

import json

from duplexd.transport import protocol
from duplexd.transport.packetizer import Eloquent, SenderConfig
from duplexd.transport.resume import EventLog, SentAudio, hand_over, refusal

SR = 24_000


def frame(seq: int, n: int = 480) -> bytes:
    return bytes(2 * n)


def setup() -> tuple[Eloquent, SentAudio, EventLog]:
    tokens = Eloquent(SenderConfig())
    tokens.add(1, ["Paris", " is", " the", " capital."])  # tokens 1..4
    audio = SentAudio(10 * SR)
    for seq in range(1, 6):  # five 20 ms frames: 100 ms
        audio.sent(seq, frame(seq))
    events = EventLog(max_events=16)
    return tokens, audio, events


def request(token_seq: int, audio_ms: float, event_seq: int | None = None) -> protocol.SessionResume:
    return protocol.SessionResume(1, "s1", "token", token_seq, audio_ms, event_seq)


def test_the_handover_sends_unacked_tokens_missing_audio_then_what_was_queued() -> None:
    tokens, audio, events = setup()
    queued = [
        protocol.encode_audio_frame(4, frame(4), protocol.BinaryKind.AUDIO_OUT),  # (already in `audio`)
        '{"type":"reply.delta","reply":1,"text":" capital."}',  # (goes again as a token, not twice)
        '{"type":"transcript.partial"}',
        None,
    ]
    plan = hand_over(request(2, 50.0), "s1", tokens, audio, events, queued, now=1.0)
    assert plan.resumed["token_seq"] == 3 and plan.resumed["tokens"] == [[1, " the"], [1, " capital."]]
    assert plan.resumed["audio_ms"] == 50.0 and plan.resumed["audio_lost_ms"] == 0.0
    # Audio from 50 ms: frame 3 cut in half, frame 5; frame 4 goes where it was queued.
    assert [protocol.BINARY_HEADER.unpack_from(f)[1] for f in plan.frames] == [3, 5]
    assert len(plan.frames[0]) - protocol.BINARY_HEADER.size == 480  # (240 samples of frame 3)
    assert [protocol.BINARY_HEADER.unpack_from(q)[1] for q in plan.queued if isinstance(q, bytes)] == [4]
    assert [q for q in plan.queued if isinstance(q, str)] == ['{"type":"transcript.partial"}']
    assert plan.resumed["events_lost"] is None


def test_with_an_event_position_the_events_come_from_the_log() -> None:
    tokens, audio, events = setup()
    sent = [events.add({"type": "x", "i": i}) for i in range(3)]
    plan = hand_over(request(4, 100.0, event_seq=1), "s1", tokens, audio, events, [sent[2]], now=1.0)
    assert plan.queued == sent[1:]  # (from the log, not the queue: nothing twice)
    assert [json.loads(q)["n"] for q in plan.queued] == [2, 3] and plan.resumed["events_lost"] == 0


def test_a_position_past_what_was_sent_is_refused_and_nothing_is_acked() -> None:
    tokens, audio, _ = setup()
    assert "past what was sent" in (refusal(request(9, 0.0), tokens, audio) or "")
    assert "past what was sent" in (refusal(request(0, 500.0), tokens, audio) or "")
    assert refusal(request(4, 100.0), tokens, audio) is None
    assert len(tokens.buffer.items) == 4
