"""A client that talks but stops reading: the server keeps what it holds for it bounded (the kernel's send
buffer is `transport.send_buffer_bytes`, the queue `transport.outbound_queue` messages) and closes the session
with 1008 `slow_consumer`, which the client sees once it reads again."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from duplexd.bench import scenarios as sc
from duplexd.bench.chaos import slow_reader
from duplexd.bench.server import child_process, free_port, health
from duplexd.transport.protocol import BINARY_HEADER

pytestmark = pytest.mark.slow

QUEUE = 32
FRAME_MS = 40


async def test_a_client_that_stops_reading_is_closed_with_1008_and_bounded_memory(clip_by_name) -> None:
    port = free_port()
    env = {
        **os.environ,
        "DUPLEXD_TRANSPORT__OUTBOUND_QUEUE": str(QUEUE),
        "DUPLEXD_TRANSPORT__AUDIO_FRAME_MS": str(FRAME_MS),
        "DUPLEXD_SECURITY__AUDIO_BURST_S": "0",
    }
    cmd = [sys.executable, "-m", "duplexd", "serve", "--port", str(port)]
    with child_process(cmd, name="duplexd serve", up=lambda: health(port), env=env):
        speech = sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)
        url = f"ws://127.0.0.1:{port}/v1/stream"
        result = await slow_reader(url, speech, sc.RATE, 120.0, lambda: health(port))

        assert result["closed_after_s"] is not None, result
        assert (result["close_code_seen"], result["close_reason_seen"]) == (1008, "slow_consumer")
        # Held in user space: at most the queue's messages (reply audio frames are the largest) and the
        # socket's write buffer (websockets' 32 KiB high-water mark, plus the one write that crossed it).
        audio_frame = BINARY_HEADER.size + 24_000 * FRAME_MS // 1000 * 2
        assert 0 < result["max_buffer_bytes"] <= QUEUE * audio_frame + 2 * 32 * 1024 + 64 * 1024, result
        for _ in range(50):  # and the session is gone, not held for a resume
            if health(port)["sessions"] == 0:
                break
            await asyncio.sleep(0.1)
        assert health(port)["sessions"] == 0
        assert health(port)["counters"]["slow_consumers"] == 1
