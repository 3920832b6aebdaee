"""SIGTERM drains: a real `duplexd serve` process stops admitting, lets the reply in progress finish, then
closes its sessions with 1001 and a `shutting_down` error, and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from duplexd.bench import scenarios as sc
from duplexd.bench.server import child_process, free_port, health
from duplexd.clients.stream import SessionRefused, StreamClient

pytestmark = pytest.mark.slow

SILENCE = np.zeros(320, "<i2").tobytes()


def ready_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_sigterm_lets_the_reply_finish_then_closes_with_1001(clip_by_name) -> None:
    port = free_port()
    env = {**os.environ, "DUPLEXD_SECURITY__DRAIN_TIMEOUT_S": "60"}
    cmd = [sys.executable, "-m", "duplexd", "serve", "--port", str(port)]
    with child_process(cmd, name="duplexd serve", up=lambda: health(port), env=env) as proc:
        client = await StreamClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
        await client.start(sc.RATE, dialog=True)
        question = np.concatenate([sc.silence(0.3), sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)])
        events: list[dict] = []
        terminated = asyncio.Event()

        async def mic() -> None:
            t0 = time.monotonic()
            for i, at in enumerate(range(0, len(question), 320)):
                await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))
                await client.send_pcm(question[at : at + 320].astype("<i2").tobytes())
            while not terminated.is_set():
                await client.send_pcm(SILENCE)
                await asyncio.sleep(0.02)

        async def receive() -> None:
            async for raw in client.ws:
                if isinstance(raw, str):
                    events.append(json.loads(raw))
                    if events[-1]["type"] == "reply.delta" and not terminated.is_set():
                        proc.send_signal(signal.SIGTERM)  # mid-reply
                        terminated.set()

        async with asyncio.TaskGroup() as tg:
            talking = tg.create_task(mic())
            listening = tg.create_task(receive())
            await asyncio.wait_for(terminated.wait(), 90)
            for _ in range(50):  # the server says it is not ready any more, and refuses new sessions
                if await asyncio.to_thread(ready_status, port) == 503:
                    break
                await asyncio.sleep(0.1)
            assert await asyncio.to_thread(ready_status, port) == 503
            late = await StreamClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
            with pytest.raises(SessionRefused) as refused:
                await late.start(sc.RATE, dialog=True)
            assert refused.value.reply["code"] == "overloaded"
            await late.close()
            await asyncio.wait_for(listening, 90)
            talking.cancel()
        kinds = [e["type"] for e in events]
        assert "reply.done" in kinds and "reply.interrupted" not in kinds, kinds  # the reply finished
        assert events[-1]["type"] == "error" and events[-1]["code"] == "shutting_down", events[-1]
        assert kinds.index("reply.done") < len(kinds) - 1
        assert client.ws.close_code == 1001
        assert await asyncio.to_thread(proc.wait, 30) == 0
