"""A small Python client for the native protocol: stream a file (or any PCM) and collect the events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
import soundfile as sf
from websockets.asyncio.client import ClientConnection, connect

from duplexd.transport.protocol import PROTOCOL_VERSION, encode_audio_frame

FRAME_MS = 20


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a WAV/FLAC file as mono PCM16 at its own sample rate."""
    data, rate = sf.read(str(path), dtype="int16", always_2d=True)
    mono = data.mean(axis=1).astype(np.int16) if data.shape[1] > 1 else data[:, 0]
    return mono, int(rate)


@dataclass(slots=True)
class Received:
    t: float  # time.monotonic() on arrival
    event: dict[str, Any]


@dataclass(slots=True)
class StreamResult:
    session_id: str
    started_at: float  # monotonic time at which audio time 0 was sent
    speed: float
    events: list[Received] = field(default_factory=list)
    close_code: int | None = None

    def of_type(self, kind: str) -> list[Received]:
        return [r for r in self.events if r.event.get("type") == kind]

    @property
    def finals(self) -> list[dict[str, Any]]:
        return [r.event for r in self.of_type("transcript.final")]

    @property
    def text(self) -> str:
        return " ".join(f["text"] for f in self.finals).strip()


class SessionRefused(RuntimeError):
    """The server answered `session.start` with an error (`reply`), e.g. `overloaded` + `retry_after_ms`."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"session refused: {reply}")
        self.reply = reply


def resume_url(url: str, started: dict[str, Any]) -> str:
    """`url` with `?node=` when the session lives on a named process behind a balancer (`session.started
    .node`): the balancer routes the resume there."""
    node = started.get("node")
    if not node:
        return url
    return f"{url}{'&' if '?' in url else '?'}{urlencode({'node': node})}"


class StreamClient:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.seq = 0

    @classmethod
    async def connect(cls, url: str) -> StreamClient:
        return cls(await connect(url, max_size=2**22, open_timeout=30))

    async def start(self, sample_rate: int, **extra: Any) -> dict[str, Any]:
        await self.ws.send(
            json.dumps({"type": "session.start", "version": PROTOCOL_VERSION, "sample_rate": sample_rate, **extra})
        )
        reply = json.loads(await self.ws.recv())
        if reply.get("type") != "session.started":
            raise SessionRefused(reply)
        return reply

    @classmethod
    async def resume(
        cls,
        url: str,
        started: dict[str, Any],
        *,
        token_seq: int,
        audio_ms: float,
        seq: int,
        event_seq: int | None = None,
    ) -> tuple[StreamClient, dict[str, Any]]:
        """Continue the session `started` (its `session.started`) on a new connection, after a drop: the
        server resends the reply tokens after `token_seq` and the reply audio after `audio_ms`.
        `seq` is the last audio frame number sent before the drop; with `event_seq` (the last event `n`
        received) the server also replays every event after it. Returns the client and `session.resumed`."""
        client = cls(await connect(resume_url(url, started), max_size=2**22, open_timeout=30))
        client.seq = seq
        await client.ws.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "version": PROTOCOL_VERSION,
                    "session_id": started["session_id"],
                    "resume_token": started["resume"]["token"],
                    "token_seq": token_seq,
                    "audio_ms": audio_ms,
                    **({} if event_seq is None else {"event_seq": event_seq}),
                }
            )
        )
        reply = json.loads(await client.ws.recv())
        if reply.get("type") != "session.resumed":
            await client.close()
            raise SessionRefused(reply)
        return client, reply

    async def ack(self, token_seq: int | None = None, event_seq: int | None = None) -> None:
        """Every reply token up to `token_seq` has been rendered, every event up to `event_seq` received
        (the server may forget them)."""
        fields = {k: v for k, v in (("token_seq", token_seq), ("event_seq", event_seq)) if v is not None}
        await self.ws.send(json.dumps({"type": "ack", **fields}))

    async def send_pcm(self, pcm: bytes) -> None:
        self.seq += 1
        await self.ws.send(encode_audio_frame(self.seq, pcm))

    async def end(self) -> None:
        await self.ws.send(json.dumps({"type": "session.end"}))

    async def close(self) -> None:
        await self.ws.close()


async def stream_pcm(
    url: str,
    pcm: np.ndarray,
    sample_rate: int,
    *,
    speed: float = 1.0,
    on_event: Callable[[Received], None] | None = None,
) -> StreamResult:
    """Stream int16 mono `pcm` in 20 ms frames at `speed` x real time (transcription only: no dialog);
    return every event received."""
    client = await StreamClient.connect(url)
    try:
        started = await client.start(sample_rate, dialog=False)
        t0 = time.monotonic()
        result = StreamResult(started["session_id"], t0, speed, [Received(t0, started)])
        if on_event is not None:
            on_event(result.events[0])

        async def receive() -> None:
            async for raw in client.ws:
                if isinstance(raw, bytes):
                    continue
                got = Received(time.monotonic(), json.loads(raw))
                result.events.append(got)
                if on_event is not None:
                    on_event(got)
                if got.event.get("type") == "session.ended":
                    return

        async with asyncio.TaskGroup() as tg:
            receiver = tg.create_task(receive())
            step = sample_rate * FRAME_MS // 1000
            for i, start in enumerate(range(0, len(pcm), step)):
                due = t0 + (i * FRAME_MS / 1000) / speed
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await client.send_pcm(pcm[start : start + step].astype("<i2").tobytes())
            await client.end()
            await receiver
    finally:
        await client.close()
    result.close_code = client.ws.close_code
    return result


async def stream_file(
    url: str, path: str | Path, *, speed: float = 1.0, on_event: Callable[[Received], None] | None = None
) -> StreamResult:
    pcm, rate = read_audio(path)
    return await stream_pcm(url, pcm, rate, speed=speed, on_event=on_event)
