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
