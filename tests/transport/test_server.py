"""The WebSocket/HTTP shell against a real server on port 0 with the real models: every bad-input path
gets a typed error and the right close code, and never disturbs another session."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect
from wire import START
from wire import expect_close as _expect_close
from wire import get as _get
from wire import recv_json as _recv_json

from duplexd.config import ServerConfig, TransportConfig
from duplexd.transport.protocol import BINARY_HEADER, encode_audio_frame

pytestmark = pytest.mark.slow

SILENCE_20MS = np.zeros(320, "<i2").tobytes()


async def test_http_routes(make_server) -> None:
    srv = await make_server()
    status, ctype, body = await asyncio.to_thread(_get, srv.http + "/healthz")
    assert status == 200 and ctype == "application/json"
    health = json.loads(body)
    assert health["status"] == "ok" and health["sessions"] == 0 and "whisper" in health["models"]["asr"]
    assert health["datagram"]["port"] > 0 and health["detached_sessions"] == 0
    status, ctype, body = await asyncio.to_thread(_get, srv.http + "/")
    assert status == 200 and ctype.startswith("text/html") and b"/v1/stream" in body
    status, _, _ = await asyncio.to_thread(_get, srv.http + "/nope")
    assert status == 404


async def test_session_roundtrip_and_frame_acks(make_server) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(START)
        started = await _recv_json(ws)
        assert started["type"] == "session.started" and started["version"] == 1 and started["session_id"]
        for seq in range(1, 51):  # 1 s of silence in 20 ms frames
            await ws.send(encode_audio_frame(seq, SILENCE_20MS))
        await ws.send(json.dumps({"type": "session.end"}))
        code, events = await _expect_close(ws)
    assert code == 1000
    acks = [e for e in events if e["type"] == "frame.ack"]
    # At least one ack per 100 ms of audio, in order, with measured lag.
    assert len(acks) >= 9
    assert [a["seq"] for a in acks] == sorted(a["seq"] for a in acks)
    assert all(0 <= a["lag_ms"] <= a["max_lag_ms"] + 1e-6 for a in acks)
    assert events[-1]["type"] == "session.ended"
    assert not [e for e in events if e["type"].startswith("transcript")]  # silence: no words


@pytest.mark.parametrize(
    ("first", "code", "close"),
    [
        (encode_audio_frame(1, SILENCE_20MS), "not_started", 1002),
        (json.dumps({"type": "session.start", "version": 2, "sample_rate": 16000}), "unsupported_version", 1002),
        (json.dumps({"type": "session.start", "version": 1, "sample_rate": 96000}), "bad_sample_rate", 1003),
        (json.dumps({"type": "session.start", "version": 1, "sample_rate": "16k"}), "bad_sample_rate", 1003),
    ],
)
async def test_fatal_errors_close_with_typed_error(make_server, first, code: str, close: int) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(first)
        got, events = await _expect_close(ws)
    assert got == close
    assert events == [{"type": "error", "code": code, "message": events[0]["message"], "n": 1}]


async def test_oversized_message_closes_1009(make_server) -> None:
    srv = await make_server(ServerConfig(transport=TransportConfig(max_message_bytes=4096)))
    async with connect(srv.url, max_size=None) as ws:
        await ws.send(START)
        await _recv_json(ws)
        await ws.send(b"\x01" + bytes(5000))
        code, _ = await _expect_close(ws)
    assert code == 1009


async def test_recoverable_errors_keep_the_session(make_server) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send("{not json")
        assert (await _recv_json(ws))["code"] == "bad_json"
        await ws.send(json.dumps({"type": "bogus"}))
        assert (await _recv_json(ws))["code"] == "unknown_type"
        await ws.send(START)
        assert (await _recv_json(ws))["type"] == "session.started"
        await ws.send(START)
        assert (await _recv_json(ws))["code"] == "already_started"
        await ws.send(BINARY_HEADER.pack(1, 1) + b"\x00\x01\x02")  # odd byte count
        assert (await _recv_json(ws))["code"] == "bad_frame"
        await ws.send(encode_audio_frame(1, bytes(16000 * 2)))  # 1 s in one frame > max_frame_ms
        assert (await _recv_json(ws))["code"] == "frame_too_long"
        await ws.send(encode_audio_frame(5, SILENCE_20MS))
        await ws.send(encode_audio_frame(5, SILENCE_20MS))  # duplicate sequence number
        events = []
        while not any(e.get("code") == "out_of_order" for e in events):
            events.append(await _recv_json(ws))
        await ws.send(json.dumps({"type": "session.end"}))
        code, events = await _expect_close(ws)
    assert code == 1000 and events[-1]["type"] == "session.ended"
    status, _, body = await asyncio.to_thread(_get, srv.http + "/healthz")
    assert json.loads(body)["counters"]["protocol_errors"] == 6


async def test_too_many_errors_closes_1008(make_server) -> None:
    srv = await make_server(ServerConfig(transport=TransportConfig(max_errors=3)))
    async with connect(srv.url) as ws:
        for _ in range(3):
            await ws.send("[]")
        code, events = await _expect_close(ws)
    assert code == 1008
    assert [e["code"] for e in events] == ["bad_message"] * 3 + ["too_many_errors"]


async def test_full_server_refuses_with_1013(make_server) -> None:
    srv = await make_server(ServerConfig(transport=TransportConfig(max_sessions=1)))
    async with connect(srv.url) as first:
        await first.send(START)
        assert (await _recv_json(first))["type"] == "session.started"
        async with connect(srv.url) as second:
            await second.send(START)
            code, events = await _expect_close(second)
        assert code == 1013 and events[0]["code"] == "overloaded"
        await first.send(json.dumps({"type": "session.end"}))
        code, _ = await _expect_close(first)
        assert code == 1000


async def test_vanished_client_frees_its_session_after_the_resume_grace_and_spares_others(make_server) -> None:
    srv = await make_server(ServerConfig(transport=TransportConfig(resume_grace_s=1.0)))
    survivor = await connect(srv.url)
    await survivor.send(START)
    await _recv_json(survivor)
    doomed = await connect(srv.url)
    await doomed.send(START)
    await _recv_json(doomed)
    for seq in range(1, 20):
        await doomed.send(encode_audio_frame(seq, SILENCE_20MS))
    doomed.transport.abort()  # the client vanishes without a close frame
    for _ in range(100):
        if srv.server.counters["detached"] == 1:
            break
        await asyncio.sleep(0.05)
    assert srv.server.counters["detached"] == 1 and len(srv.server.sessions) == 2  # kept for a resume
    for _ in range(100):
        if len(srv.server.sessions) == 1:
            break
        await asyncio.sleep(0.05)
    assert len(srv.server.sessions) == 1 and srv.server.counters["expired"] == 1
    for seq in range(1, 11):
        await survivor.send(encode_audio_frame(seq, SILENCE_20MS))
    await survivor.send(json.dumps({"type": "session.end"}))
    code, events = await _expect_close(survivor)
    assert code == 1000 and events[-1]["type"] == "session.ended"
    assert len(srv.server.sessions) == 0
