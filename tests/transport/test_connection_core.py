"""The connection core without a socket: messages in with their time (`receive`), messages out
(`data_to_send`), how it wants its socket closed (`close`), the link lost and taken over by a resume.

A real `Server` with the real models (its VAD and ASR workers running, no port opened), real speech."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from duplexd.clients.clips import load
from duplexd.config import ServerConfig
from duplexd.transport.connection import Connection
from duplexd.transport.native import NativeCodec
from duplexd.transport.outbox import CLOSE_POLICY, CLOSE_PROTOCOL_ERROR, CLOSE_TRY_AGAIN_LATER, CLOSE_WILL_RESUME
from duplexd.transport.protocol import SessionResume, encode_audio_frame
from duplexd.transport.realtime_session import RealtimeCodec
from duplexd.transport.server import Server

START = json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000, "dialog": False})
FRAME = 320  # 20 ms at 16 kHz


@pytest.fixture
async def server(engines: object) -> AsyncIterator[Server]:
    """A server whose VAD and ASR workers run, with no port: its connections are driven by hand."""
    config = ServerConfig()
    config = dataclasses.replace(config, transport=dataclasses.replace(config.transport, outbound_queue=64))
    srv = Server(config, engines)  # type: ignore[arg-type]
    workers = [asyncio.create_task(srv.vad.run()), asyncio.create_task(srv.asr.run())]
    yield srv
    for conn in list(srv.handles.values()):
        conn.release()
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)


def sent(conn: Connection) -> list[dict[str, Any]]:
    return [json.loads(m) for m in conn.data_to_send() if isinstance(m, str)]


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))


async def started(server: Server, now: float = 100.0) -> tuple[Connection, dict[str, Any]]:
    conn = Connection(server, NativeCodec, now)
    assert not await conn.receive(START, now)
    (reply,) = sent(conn)
    assert reply["type"] == "session.started"
    return conn, reply


async def test_speech_in_transcripts_out_and_a_goodbye_with_no_socket(server: Server, clips: list) -> None:
    clip = next(c for c in clips if c.text and c.duration_s < 12)
    pcm = load(clip.path).tobytes()
    conn, _ = await started(server)
    out: list[dict[str, Any]] = []
    now = 100.0
    for seq, at in enumerate(range(0, len(pcm), 2 * FRAME), start=1):
        now += 0.02  # (the time a frame arrives is the caller's: here, real time)
        assert not await conn.receive(encode_audio_frame(seq, pcm[at : at + 2 * FRAME]), now)
        out += sent(conn)
    assert await conn.receive(json.dumps({"type": "session.end"}), now + 0.1)  # reading is over
    out += sent(conn)
    kinds = [m["type"] for m in out]
    assert kinds[-1] == "session.ended" and conn.close is None
    assert "vad.speech_started" in kinds and "frame.ack" in kinds
    heard = " ".join(m["text"] for m in out if m["type"] == "transcript.final")
    assert len(words(heard) & words(clip.text)) >= len(words(clip.text)) // 2, (heard, clip.text)
    numbered = [m["n"] for m in out if "n" in m]
    assert numbered == list(range(2, len(numbered) + 2))  # (n 1: session.started; frame.ack is not numbered)


async def test_a_dropped_link_is_taken_over_by_a_resume_with_what_was_queued_meanwhile(server: Server) -> None:
    conn, reply = await started(server)
    conn.link_lost(None, 101.0)  # no closing handshake: the session waits for a resume
    assert not conn.attached and server.handles[reply["session_id"]] is conn
    conn.send({"type": "transcript.partial", "utterance": 0, "text": "meanwhile", "words": []})

    resuming = Connection(server, NativeCodec, 102.0)
    msg = {
        "type": "session.resume",
        "version": 1,
        "session_id": reply["session_id"],
        "resume_token": reply["resume"]["token"],
        "token_seq": 0,
        "audio_ms": 0.0,
        "event_seq": 1,  # (it had the session.started)
    }
    assert await resuming.receive(json.dumps(msg), 102.0)  # this connection's reading is over: handed over
    assert resuming.resume is not None
    target, resume = resuming.resume
    assert target is conn
    target.take_over(resume, 102.0)
    first, then = sent(target)
    assert first["type"] == "session.resumed" and first["events_lost"] == 0
    assert then["type"] == "transcript.partial" and then["text"] == "meanwhile" and then["n"] == 2
    assert target.attached and target.close is None


async def test_a_resume_that_asks_for_more_than_was_sent_is_refused_and_sends_nothing_else(server: Server) -> None:
    conn, reply = await started(server)
    conn.link_lost(CLOSE_WILL_RESUME, 101.0)
    conn.send({"type": "transcript.partial", "utterance": 0, "text": "meanwhile", "words": []})
    msg = {
        "version": 1,
        "session_id": reply["session_id"],
        "resume_token": reply["resume"]["token"],
        "token_seq": 5,  # more tokens than were ever sent
        "audio_ms": 0.0,
    }
    conn.take_over(SessionResume(**msg), 102.0)
    close = conn.close
    assert close is not None and close.code == CLOSE_POLICY and not close.flush and conn.urgent.is_set()
    (refused,) = [json.loads(m) for m in close.final]
    assert refused["type"] == "error" and refused["code"] == "resume_refused"


async def test_a_client_that_does_not_read_is_closed_at_once_not_buffered(server: Server) -> None:
    conn, _ = await started(server)
    for i in range(server.config.transport.outbound_queue + 1):  # nothing is taken: the client reads nothing
        conn.send({"type": "transcript.partial", "utterance": 0, "text": f"w{i}", "words": []})
    assert conn.close is not None and conn.close.reason == "slow_consumer" and conn.urgent.is_set()
    assert len(conn.outbox) == server.config.transport.outbound_queue  # (bounded: the last one was not kept)
    conn.link_lost(None, 101.0)
    assert not server.handles  # a slow client's session is not kept for a resume


async def test_audio_before_start_is_a_fatal_protocol_error_written_before_the_close(server: Server) -> None:
    conn = Connection(server, NativeCodec, 100.0)
    assert await conn.receive(encode_audio_frame(1, bytes(2 * FRAME)), 100.0)
    (error,) = sent(conn)
    assert error["type"] == "error" and error["code"] == "not_started"
    assert conn.close is not None and conn.close.code == CLOSE_PROTOCOL_ERROR and conn.close.flush


async def test_an_idle_client_gets_an_error_then_a_close(server: Server) -> None:
    conn, _ = await started(server)
    conn.timed_out(30.0)
    (error,) = sent(conn)
    assert error["type"] == "error" and error["code"] == "idle_timeout"
    assert conn.close is not None and conn.close.code == CLOSE_POLICY and conn.ended


async def test_a_realtime_session_on_a_full_server_gets_one_error_then_1013(server: Server) -> None:
    server.draining = True  # (admits nobody, as a full server)
    conn = Connection(server, RealtimeCodec, 100.0)
    await conn.open(100.0)
    (error,) = sent(conn)
    assert error["type"] == "error" and error["error"]["code"] == "overloaded"
    assert conn.close is not None and conn.close.code == CLOSE_TRY_AGAIN_LATER and conn.close.flush and conn.ended
    assert not server.handles
