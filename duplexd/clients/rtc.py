"""A Python WebRTC client of duplexd's calls (`/v1/realtime/calls`), with aiortc, as OpenAI's WebRTC guide does
it in a browser: an audio track for the microphone, an `oai-events` data channel, the SDP offer posted over
HTTP, the answer set; the reply comes back as the call's audio track and JSON events on the channel.

    client = RtcClient()
    offer = await client.offer()
    answer, call = await post_offer("http://127.0.0.1:8000/v1", offer)   # (or the openai package's
    await client.connect(answer)                                          #  client.realtime.calls.create)
    client.mic.say(pcm16_at_16k, 16000)
    await client.wait_for(lambda events: any(e["type"] == "response.done" for e in events))

The microphone (`Microphone`) plays what it is given in real time in 20 ms frames, silence otherwise; the
loudspeaker (`Loudspeaker`) keeps what the call played (48 kHz mono, bounded) with the time of each frame.

`RtcClient(tokens=True)` also opens duplexd's `eloquent` channel (unordered, no retransmissions): the reply
tokens come there as Eloquent packets too, and `tokens` renders each once, in order, from whichever of the
two channels brings it first (the events channel's deltas carry the same `token_seq`), as the datagram
client merges UDP with the WebSocket. `drop` discards that share of the channel's messages on arrival, as a
lossy network would (the events channel is not touched: it is reliable).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import soxr
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from duplexd.transport.datagram import DatagramError, decode_tokens, encode_ack
from duplexd.transport.packetizer import Packet, Receiver, Token

RATE = 48_000
FRAME = RATE // 50  # 20 ms
EVENTS_LABEL = "oai-events"
TOKENS_LABEL = "eloquent"


class Microphone(MediaStreamTrack):
    """Mono PCM16 at 48 kHz in 20 ms frames, in real time: what `say` queued, else silence."""

    kind = "audio"

    def __init__(self, max_s: float = 120.0) -> None:
        super().__init__()
        self._queue: deque[np.ndarray] = deque()
        self._queued = 0
        self._max = int(max_s * RATE)
        self._start: float | None = None
        self._pts = 0
        self.sent_speech_s = 0.0  # audio of `say` sent so far
        self.said_at: float | None = None  # monotonic time the latest `say` began going out
        self._new_say = False

    def say(self, pcm: np.ndarray, rate: int) -> None:
        """Queue int16 mono `pcm` at `rate` to be sent after what is queued."""
        audio = pcm.astype(np.float32) / 32768.0
        if rate != RATE:
            audio = soxr.resample(audio, rate, RATE)
        samples = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
        if self._queued + len(samples) > self._max:
            raise ValueError(f"more than {self._max / RATE:.0f} s of speech queued")
        self._new_say = self._new_say or not self._queue
        self._queue.append(samples)
        self._queued += len(samples)

    @property
    def speaking(self) -> bool:
        return self._queued > 0

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            due = self._start + self._pts / RATE
            if due > now:
                await asyncio.sleep(due - now)
        if self._new_say and self._queue:
            self.said_at, self._new_say = time.monotonic(), False
        out = np.zeros(FRAME, "<i2")
        taken = 0
        while taken < FRAME and self._queue:
            chunk = self._queue[0]
            n = min(FRAME - taken, len(chunk))
            out[taken : taken + n] = chunk[:n]
            taken += n
            if n == len(chunk):
                self._queue.popleft()
            else:
                self._queue[0] = chunk[n:]
        self._queued -= taken
        self.sent_speech_s += taken / RATE
        frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.pts = self._pts
        frame.time_base = Fraction(1, RATE)
        self._pts += FRAME
        return frame


class Loudspeaker:
    """What the call's audio track plays: 48 kHz mono int16 frames (at most `max_s`), each with the time it
    arrived."""

    def __init__(self, max_s: float = 120.0) -> None:
        self.frames: deque[tuple[float, np.ndarray]] = deque(maxlen=int(max_s * 50))
        self.samples = 0

    async def run(self, track: Any) -> None:
        resampler = None
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            pcm = frame.to_ndarray()
            channels = len(frame.layout.channels)
            mono = pcm.reshape(-1, channels).astype(np.float32).mean(axis=1)
            if frame.sample_rate != RATE:
                if resampler is None:
                    resampler = soxr.ResampleStream(frame.sample_rate, RATE, 1, dtype="float32")
                mono = resampler.resample_chunk(mono)
            self.frames.append((time.monotonic(), mono.astype("<i2")))
            self.samples += len(mono)

    def voiced(self, threshold: float = 300.0) -> list[float]:
        """Arrival times of the frames louder than `threshold` (RMS, int16 scale)."""
        return [t for t, pcm in self.frames if len(pcm) and _rms(pcm) > threshold]

    def audio(self, since: float = 0.0) -> np.ndarray:
        parts = [pcm for t, pcm in self.frames if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, "<i2")


def _rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float32) ** 2)))


@dataclass(slots=True)
class Rendered:
    token: Token
    at: float  # monotonic time it could be shown
    path: str  # "eloquent" or "events": the channel that brought it first


class RtcClient:
    """One call's client side: a peer connection with a microphone track and an `oai-events` channel (and,
    with `tokens`, the `eloquent` one)."""

    def __init__(self, *, tokens: bool = False, drop: float = 0.0, seed: int = 0) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # (host candidates: no STUN to reach)
        self.mic = Microphone()
        self.speaker = Loudspeaker()
        self.events: list[dict[str, Any]] = []
        self.event_times: list[float] = []
        self._changed = asyncio.Event()
        self._open = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel(EVENTS_LABEL)
        self.channel.on("open", self._open.set)
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)
        self.receiver = Receiver()
        self.tokens: list[Rendered] = []  # every reply token, once, in order
        self.dropped = 0  # `eloquent` messages discarded on arrival (`drop`)
        self.eloquent_messages = 0
        self._drop, self._random = drop, random.Random(seed)
        self.tokens_channel = None
        if tokens:
            self.tokens_channel = self.pc.createDataChannel(TOKENS_LABEL, ordered=False, maxRetransmits=0)
            self.tokens_channel.on("message", self._on_packet)

    def _on_track(self, track: Any) -> None:
        if track.kind == "audio":
            self._tasks.append(asyncio.get_running_loop().create_task(self.speaker.run(track)))

    def _on_message(self, message: str | bytes) -> None:
        event = json.loads(message)
        self.events.append(event)
        self.event_times.append(time.monotonic())
        if isinstance(seq := event.get("token_seq"), int) and event.get("delta") is not None:
            self._render(Packet(0, (Token(seq, 0, event["delta"]),)), "events")
        self._changed.set()

    def _on_packet(self, message: str | bytes) -> None:
        if not isinstance(message, bytes):
            return
        self.eloquent_messages += 1
        if self._drop and self._random.random() < self._drop:
            self.dropped += 1
            return
        try:
            packet = decode_tokens(message)
        except DatagramError:
            return
        self._render(packet, "eloquent")
        if self.tokens_channel is not None and self.tokens_channel.readyState == "open":
            self.tokens_channel.send(encode_ack(self.receiver.ack()))
        self._changed.set()

    def _render(self, packet: Packet, path: str) -> None:
        now = time.monotonic()
        self.tokens.extend(Rendered(t, now, path) for t in self.receiver.receive(packet))

    @property
    def text(self) -> str:
        """The reply tokens rendered so far, in order."""
        return "".join(r.token.text for r in self.tokens)

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, answer: str, timeout_s: float = 20.0) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        await asyncio.wait_for(self._open.wait(), timeout_s)

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def time_of(self, kind: str) -> float | None:
        """When the first event of `kind` arrived (monotonic)."""
        return next((t for e, t in zip(self.events, self.event_times, strict=True) if e["type"] == kind), None)

    async def wait_for(self, done: Callable[[list[dict[str, Any]]], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not done(self.events):
                self._changed.clear()
                await self._changed.wait()

    async def close(self) -> None:
        await self.pc.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def post_offer(
    base_url: str, offer: str, *, key: str | None = None, session: dict[str, Any] | None = None, timeout_s: float = 30
) -> tuple[str, str]:
    """POST `offer` to `{base_url}/realtime/calls` (blocking: run it in a thread): (SDP answer, call id).
    With `session`, as the multipart form OpenAI's SDK sends; else as `application/sdp`. Raises `RuntimeError`
    with the server's message for a refusal."""
    headers = {"Accept": "application/sdp"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if session is None:
        body, headers["Content-Type"] = offer.encode(), "application/sdp"
    else:
        boundary = uuid.uuid4().hex
        parts = [
            _part(boundary, "sdp", "application/sdp", offer),
            _part(boundary, "session", "application/json", json.dumps(session)),
        ]
        parts.append(f"--{boundary}--\r\n")
        body, headers["Content-Type"] = "".join(parts).encode(), f"multipart/form-data; boundary={boundary}"
    request = urllib.request.Request(base_url.rstrip("/") + "/realtime/calls", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            location = response.headers.get("Location", "")
            return response.read().decode(), location.rsplit("/", 1)[-1]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"call refused: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


def _part(boundary: str, name: str, content_type: str, value: str) -> str:
    disposition = f'Content-Disposition: form-data; name="{name}"'
    return f"--{boundary}\r\n{disposition}\r\nContent-Type: {content_type}\r\n\r\n{value}\r\n"
