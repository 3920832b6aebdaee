"""Helpers for talking to a real server over HTTP and the WebSocket (shared by the transport tests)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from websockets.exceptions import ConnectionClosed

START = json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000})


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


async def recv_json(ws) -> dict:
    while True:
        msg = await asyncio.wait_for(ws.recv(), 10)
        if isinstance(msg, str):
            return json.loads(msg)


async def expect_close(ws) -> tuple[int, list[dict]]:
    """Read until the server closes; returns the close code and the JSON events before it."""
    events = []
    try:
        while True:
            msg = await asyncio.wait_for(ws.recv(), 10)
            if isinstance(msg, str):
                events.append(json.loads(msg))
    except ConnectionClosed:
        pass
    return ws.close_code, events


async def speak(ws, pcm: bytes, until: str, *, keep_talking: bool = False, timeout_s: float = 60.0) -> list[dict]:
    """Send `pcm` (PCM16 at 16 kHz) in 20 ms frames at real-time pace, as a microphone, while reading the
    server's JSON events; return them once one of type `until` has come (the audio stops there, unless
    `keep_talking`: then all of it is sent first)."""
    from duplexd.transport.protocol import encode_audio_frame

    events: list[dict] = []

    async def read() -> None:
        while not events or events[-1]["type"] != until:
            msg = await ws.recv()
            if isinstance(msg, str):
                events.append(json.loads(msg))

    reading = asyncio.create_task(read())
    frame_bytes = 320 * 2
    for seq, at in enumerate(range(0, len(pcm), frame_bytes), start=1):
        if reading.done() and not keep_talking:
            break
        await ws.send(encode_audio_frame(seq, pcm[at : at + frame_bytes]))
        await asyncio.sleep(0.02)
    await asyncio.wait_for(reading, timeout_s)
    return events
