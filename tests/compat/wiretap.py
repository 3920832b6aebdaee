"""What the voice-agent frameworks and duplexd say to each other: a WebSocket relay between the two that records
every message, so the tests read the real wire, whatever the framework does with it (shared by tests/compat)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import soxr
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

TRACE_ENV = "DUPLEXD_WIRE_TRACE"  # a folder: each session's wire trace is written there as <session>.jsonl
RATE_HZ = 24000  # the OpenAI Realtime protocol's PCM16 rate, which both frameworks use
# OpenAI's service answers a `response.cancel` that finds nothing to cancel with this error too, and both frameworks
# expect it (pipecat logs it at debug level; LiveKit drops errors whose message starts "Cancellation failed"): they
# send a cancel on every barge-in, racing the server's own. Every other error event fails a test.
EXPECTED_ERRORS = {"response_cancel_not_active"}
AUDIO_FIELDS = {"input_audio_buffer.append": "audio", "response.output_audio.delta": "delta"}


@dataclass(frozen=True, slots=True)
class Message:
    t_s: float  # since the relay accepted the client
    sender: Literal["client", "server"]
    event: dict  # base64 audio replaced by its size in bytes

    @property
    def type(self) -> str:
        return self.event.get("type", "?")


class WireTap:
    """Listens on port 0 and relays each client's WebSocket to duplexd's `/v1/...` at `upstream_port`, same path,
    query and `Authorization`; every text message both ways is parsed and kept in `messages`, in order."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.messages: list[Message] = []
        self.port = 0
        self.closed = False  # the (last) relayed connection has ended
        self._t0 = 0.0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[WireTap]:
        async with serve(self._relay, "127.0.0.1", 0, max_size=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            yield self

    async def _relay(self, client: ServerConnection) -> None:
        self._t0 = time.monotonic()
        self.closed = False
        headers = {k: v for k, v in client.request.headers.raw_items() if k.lower() == "authorization"}
        url = f"ws://127.0.0.1:{self.upstream_port}{client.request.path}"
        try:
            async with connect(url, additional_headers=headers, max_size=None) as upstream:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._pump(client, upstream, "client"))
                    tg.create_task(self._pump(upstream, client, "server"))
        finally:
            self.closed = True

    async def _pump(self, src, dst, sender: Literal["client", "server"]) -> None:
        try:
            async for raw in src:
                if isinstance(raw, str):
                    self.messages.append(Message(time.monotonic() - self._t0, sender, _without_audio(json.loads(raw))))
                await dst.send(raw)
        except ConnectionClosed:
            pass
        finally:
            await dst.close()

    def of(self, kind: str, sender: str = "server") -> list[dict]:
        return [m.event for m in self.messages if m.sender == sender and m.type == kind]

    def kinds(self, sender: str = "server") -> list[str]:
        return [m.type for m in self.messages if m.sender == sender]

    def errors(self) -> list[dict]:
        """The error events a client would not get from OpenAI's service in the same place."""
        return [e for e in self.of("error") if e["error"].get("code") not in EXPECTED_ERRORS]

    def audio_bytes(self) -> dict[str, int]:
        """Reply audio sent, in bytes, by response id."""
        sent: dict[str, int] = {}
        for e in self.of("response.output_audio.delta"):
            sent[e["response_id"]] = sent.get(e["response_id"], 0) + e["delta"]
        return sent

    def check_replies_heard(self, done: list[dict]) -> dict[str, int]:
        """Every reply of `done` (the `response.done` responses) was heard: a completed one has words and at
        least half a second of audio, a cut one (whatever its words) some audio. Returns `audio_bytes()`."""
        sent = self.audio_bytes()
        for r in done:
            if r["status"] == "completed":
                assert r["output"][0]["content"][0]["transcript"].strip(), r
                assert sent[r["id"]] > RATE_HZ * 2 * 0.5, r["id"]
            else:
                assert sent[r["id"]] > 0, r["id"]
        return sent

    async def wait_for(self, kind: str, count: int = 1, timeout_s: float = 60.0) -> dict:
        """The `count`-th server event of this kind, once it has come; fails at once on an `error` event (the
        frameworks take one as the end of the session) or when the connection has closed."""
        deadline = time.monotonic() + timeout_s
        while len(found := self.of(kind)) < count:
            assert not self.errors(), f"error event before {count}x {kind}: {self.summary()}"
            assert not self.closed, f"connection closed before {count}x {kind}: {self.summary()}"
            assert time.monotonic() < deadline, f"no {count}x {kind} within {timeout_s} s: {self.summary()}"
            await asyncio.sleep(0.02)
        return found[count - 1]

    def summary(self) -> list[str]:
        """The conversation without audio, one short line per message (a run of one kind as one line), for
        assertion messages."""
        lines: list[str] = []
        for m in self.messages:
            line = _line(m)
            if not line:
                continue
            if lines and lines[-1].split(" ", 1)[1].split(" x")[0] == line.split(" ", 1)[1]:
                head, _, n = lines[-1].partition(" x")
                lines[-1] = f"{head} x{int(n or 1) + 1}"
            else:
                lines.append(line)
        return lines

    def write_trace(self, name: str) -> Path | None:
        """If `DUPLEXD_WIRE_TRACE` names a folder, write the whole trace there as `<name>.jsonl`, one message a line
        (audio folded: between two other messages, one line per sender's audio with its count, bytes and peak)."""
        folder = os.environ.get(TRACE_ENV)
        if not folder:
            return None
        path = Path(folder) / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as fh:
            fh.write(json.dumps({"session": name, "messages": len(self.messages)}) + "\n")
            for row in _folded(self.messages):
                fh.write(json.dumps(row) + "\n")
        return path


def _without_audio(event: dict) -> dict:
    """Audio as its size in bytes, and its loudest sample (`peak`: silence is 0)."""
    field = AUDIO_FIELDS.get(event.get("type", ""))
    if field and isinstance(event.get(field), str):
        pcm = np.frombuffer(base64.b64decode(event[field]), "<i2")
        return {**event, field: pcm.nbytes, "peak": int(np.abs(pcm.astype(np.int32)).max(initial=0))}
    return event


def _folded(messages: list[Message]) -> list[dict]:
    """One row per message, except audio: between two other messages, one row per sender's audio (first time,
    last time, count, bytes, loudest sample)."""
    rows: list[dict] = []
    runs: dict[tuple[str, str], dict] = {}
    for m in messages:
        if m.type not in AUDIO_FIELDS:
            runs.clear()
            rows.append({"t_s": round(m.t_s, 3), "from": m.sender, "type": m.type, "event": m.event})
            continue
        size, peak = m.event[AUDIO_FIELDS[m.type]], m.event.get("peak", 0)
        if run := runs.get((m.sender, m.type)):
            run["count"] += 1
            run["bytes"] += size
            run["peak"] = max(run["peak"], peak)
            run["until_s"] = round(m.t_s, 3)
        else:
            runs[m.sender, m.type] = {"t_s": round(m.t_s, 3), "from": m.sender, "type": m.type, "count": 1}
            runs[m.sender, m.type].update(bytes=size, peak=peak, until_s=round(m.t_s, 3))
            rows.append(runs[m.sender, m.type])
    return rows


def _line(m: Message) -> str:
    if m.type in AUDIO_FIELDS:
        return ""
    if m.type == "error":
        return f"{m.t_s:.2f} {m.sender} error {m.event.get('error')}"
    return f"{m.t_s:.2f} {m.sender} {m.type}"


def pcm24(audio16: np.ndarray) -> bytes:
    """16 kHz int16 samples as the 24 kHz PCM16 bytes the frameworks speak."""
    return (soxr.resample(audio16.astype(np.float32) / 32768, 16000, RATE_HZ) * 32767).astype("<i2").tobytes()
