"""Hypothesis-generated garbage on both endpoints of a real server, while a bystander converses: no
connection ends uncleanly, the server logs no error, and the bystander's session is served throughout.
(`duplexd bench chaos` sends 10,000+ of them.)"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import numpy as np
import pytest
from websockets.asyncio.client import connect

from duplexd.bench.chaos import corpus, fuzz
from duplexd.config import AdmissionConfig, SecurityConfig, ServerConfig, TransportConfig
from duplexd.transport.protocol import encode_audio_frame

pytestmark = pytest.mark.slow

SILENCE = np.zeros(320, "<i2").tobytes()


async def test_fuzzed_messages_on_both_endpoints_crash_nothing_and_spare_a_bystander(make_server, caplog) -> None:
    caplog.set_level(logging.WARNING)
    # Fuzzing the handlers, not the admission controller (garbage audio makes lag, and a controller that
    # cuts the limit would refuse the rest of the corpus at the handshake), nor the per-address limit (every
    # fuzz client is on 127.0.0.1, and sessions still finishing count).
    # A fuzzed native connection that drops without a closing handshake (its close timed out on a loaded
    # machine) leaves its session detached, kept for a resume for `resume_grace_s` (30 s by default): it
    # counts as open until then. 2 s here, so the check below sees every session end.
    security = SecurityConfig(audio_burst_s=0, max_connections_per_ip=100_000)
    transport = TransportConfig(resume_grace_s=2.0)
    config = ServerConfig(security=security, admission=AdmissionConfig(enabled=False), transport=transport)
    srv = await make_server(config)
    acks: list[dict] = []
    sent: list[int] = []
    stop = asyncio.Event()

    async def bystander() -> None:
        async with connect(srv.url) as ws:
            await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000, "dialog": False}))
            await ws.recv()

            async def listen() -> None:
                async for raw in ws:
                    if isinstance(raw, str) and (event := json.loads(raw))["type"] == "frame.ack":
                        acks.append(event)

            async with asyncio.TaskGroup() as tg:
                listener = tg.create_task(listen())
                seq = 0
                while not stop.is_set():
                    seq += 1
                    await ws.send(encode_audio_frame(seq, SILENCE))
                    await asyncio.sleep(0.02)
                sent.append(seq)
                await ws.send(json.dumps({"type": "session.end"}))
                await listener

    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(bystander())
        await asyncio.sleep(0.5)
        results = {
            path: await fuzz(srv.url.replace("/v1/stream", path), corpus(endpoint, 40))
            for endpoint, path in (("stream", "/v1/stream"), ("realtime", "/v1/realtime"))
        }
        await asyncio.sleep(0.5)
        stop.set()
        await watcher

    for path, r in results.items():
        assert r.crashes == 0 and r.connections == 40, (path, r)
        assert r.messages >= 100, (path, r)  # (of ~195: a connection the server closes early sends no more)
    server_errors = [
        r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("duplexd", "websockets.server"))
    ]
    assert not server_errors, [r.getMessage() for r in server_errors]
    # The bystander was served throughout: an ack for every 100 ms of its audio. (How fast is the bench's
    # business, not a test's: a loaded 2-core machine can delay a frame past its deadline.)
    (frames,) = sent
    assert acks and acks[-1]["seq"] >= frames - 5 and len(acks) >= frames // 5 - 1, (frames, acks)
    # Every fuzzed session is closed: the server ends them as their sockets go, asynchronously (and a
    # dropped one after its resume grace), so some may still be open when the last client has gone; a leak
    # never reaches 0.
    deadline = time.monotonic() + 15
    while (health := srv.server.health())["sessions"]:
        assert time.monotonic() < deadline, health
        await asyncio.sleep(0.1)
    assert health["status"] == "ok"
