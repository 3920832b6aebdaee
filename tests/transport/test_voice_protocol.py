"""The conversation's wire messages against a real server: bad playback reports, cancel without a reply,
audio after the end, and transcription-only sessions; none disturbs the server or other sessions."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from websockets.asyncio.client import connect
from wire import speak

from duplexd.bench import scenarios as sc
from duplexd.clients.stream import stream_pcm
from duplexd.transport.protocol import encode_audio_frame

pytestmark = pytest.mark.slow

SILENCE_20MS = np.zeros(320, "<i2").tobytes()


async def _next_of(ws, kind: str) -> dict:
    while True:
        msg = await asyncio.wait_for(ws.recv(), 10)
        if isinstance(msg, str) and (event := json.loads(msg))["type"] == kind:
            return event


async def test_bad_playback_and_cancel_are_typed_errors(make_server) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000}))
        started = await _next_of(ws, "session.started")
        assert started["dialog"] is True and started["output"]["sample_rate"] == 24000
        await ws.send(json.dumps({"type": "playback", "played_ms": 50.0}))  # no audio was sent yet
        assert (await _next_of(ws, "error"))["code"] == "bad_playback"
        await ws.send(json.dumps({"type": "playback", "played_ms": -1}))
        assert (await _next_of(ws, "error"))["code"] == "bad_playback"
        await ws.send(json.dumps({"type": "playback", "played_ms": "soon"}))
        assert (await _next_of(ws, "error"))["code"] == "bad_playback"
        await ws.send(json.dumps({"type": "playback", "played_ms": 0}))  # in range: accepted silently
        await ws.send(json.dumps({"type": "reply.cancel"}))
        err = await _next_of(ws, "error")
        assert err["code"] == "no_reply"
        # The session is still alive: audio is acked.
        for seq in range(1, 11):
            await ws.send(encode_audio_frame(seq, SILENCE_20MS))
        assert (await _next_of(ws, "frame.ack"))["seq"] >= 5
        await ws.send(json.dumps({"type": "session.end"}))
        await _next_of(ws, "session.ended")


async def test_audio_after_session_end_is_ignored(make_server) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000}))
        await _next_of(ws, "session.started")
        await ws.send(json.dumps({"type": "session.end"}))
        for seq in range(1, 50):
            await ws.send(encode_audio_frame(seq, SILENCE_20MS))
        await ws.send(json.dumps({"type": "reply.cancel"}))
        await _next_of(ws, "session.ended")
        await ws.wait_closed()
        assert ws.close_code == 1000
    health = srv.server.health()
    assert health["status"] == "ok" and health["sessions"] == 0


async def test_transcription_only_sessions_get_no_turns(make_server, clip_by_name) -> None:
    srv = await make_server()
    audio = np.concatenate([sc.silence(0.3), sc.load(clip_by_name["clip14_sb_spk2_snt2.wav"].path), sc.silence(2)])
    result = await stream_pcm(srv.url, audio, sc.RATE)
    kinds = {r.event["type"] for r in result.events}
    assert "transcript.final" in kinds and result.events[0].event["dialog"] is False
    assert not kinds & {"turn.ended", "reply.started", "reply.delta", "reply.done"}


async def test_session_end_during_a_reply_ends_the_reply_first(make_server, clip_by_name) -> None:
    """`session.end` while the server is answering: the reply ends with `reply.interrupted` (reason
    `session_end`) before `session.ended`, never in silence."""
    srv = await make_server()
    audio = np.concatenate([sc.silence(0.3), sc.load(clip_by_name["clip14_sb_spk2_snt2.wav"].path), sc.silence(3)])
    pcm = audio.astype("<i2").tobytes()
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": sc.RATE}))
        await _next_of(ws, "session.started")
        events = await speak(ws, pcm, "reply.started", timeout_s=30)
        reply = events[-1]["reply"]
        await ws.send(json.dumps({"type": "session.end"}))
        tail = []
        while not tail or tail[-1]["type"] != "session.ended":
            msg = await asyncio.wait_for(ws.recv(), 30)
            if isinstance(msg, str):
                tail.append(json.loads(msg))
    ends = [e for e in tail if e["type"] in ("reply.interrupted", "reply.done") and e["reply"] == reply]
    assert len(ends) == 1, [e["type"] for e in tail]
    if ends[0]["type"] == "reply.interrupted":
        assert ends[0]["reason"] == "session_end"
