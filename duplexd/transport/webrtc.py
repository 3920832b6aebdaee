"""WebRTC calls: OpenAI's `/v1/realtime/calls` flow, on the same session core as `/v1/realtime`.

    POST /v1/realtime/calls                   an SDP offer (`application/sdp`, or a multipart form with
                                              `sdp` and `session`) -> 201, the SDP answer, `Location` the call
    POST /v1/realtime/calls/{call_id}/hangup  ends the call
    POST /v1/realtime/client_secrets          -> {"value": "ek_...", "expires_at", "session"}: a short-lived
                                              key for one browser to place calls with (and its settings)

A call is a `Connection` whose codec is `WebRtcCodec` and whose shell is `RtcCall`. The codec is the Realtime
one: the same JSON events, on the `oai-events` data channel, except that reply audio goes out on the call's
audio track instead of `response.output_audio.delta` events, and that the track (`Speaker`) plays it in real
time and reports what it played, as a native client does: pacing, barge-in (the reply's audio stops where
the user heard it), pause and resume are the server's own. The microphone's Opus track comes in at 48 kHz and
is resampled to the Realtime 24 kHz stream the session takes.

aiortc does the media: Opus is decoded on its receiver's thread and encoded in the loop's executor; the
event loop moves 20 ms frames. ICE gathers host candidates only (`iceServers=[]`: no STUN server to reach).
Every queue is bounded: the microphone's frames (`MIC_FRAMES`, oldest dropped), the data channel's events
(`INBOX_EVENTS`, then the call ends), the track's audio (the pacer keeps it within `audio_lead_ms`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from email.parser import BytesParser
from email.policy import HTTP
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from duplexd.events import Event, ReplyDone, ReplyInterrupted, ReplyPaused, ReplyResumed
from duplexd.streaming.audio import StreamResampler
from duplexd.transport import protocol
from duplexd.transport import realtime as rt
from duplexd.transport.connection import Connection
from duplexd.transport.realtime_out import VadDefaults, session_object
from duplexd.transport.realtime_session import RealtimeCodec
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

if TYPE_CHECKING:
    from duplexd.transport.server import Server

log = logging.getLogger(__name__)

EVENTS_LABEL = "oai-events"  # the data channel OpenAI's clients open for the JSON events
TOKENS_LABEL = "eloquent"  # duplexd's: an unordered, unreliable channel for the reply tokens as Eloquent packets
FRAME_MS = 20
MIC_FRAMES = 50  # microphone frames waiting for the session (1 s): beyond, the oldest is dropped
INBOX_EVENTS = 256  # client events waiting to be applied: beyond, the call ends (a client flooding it)
CHANNEL_HIGH_BYTES = 1 << 20  # the data channel's own buffer: the sender waits above this
MAX_CALLS = 1024  # calls kept at once (each is also a session, which admission bounds first)
MAX_SECRETS = 1024  # client secrets kept until they expire
SECRET_TTL_S = 600  # OpenAI's default; a request may ask for 10 s to 2 h
CALL_SETUP_S = 30.0  # an answered call whose peer never connects is ended after this


class CallError(Exception):
    """A request to place a call that cannot be met: the HTTP status, an error code and a readable message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


# -- the reply's audio track --------------------------------------------------------------------------


class Speaker(MediaStreamTrack):
    """The call's outgoing audio: the reply audio the session sends, played in real time in 20 ms frames
    (silence when there is none), as the client's loudspeaker would. It reports each frame it plays
    (`on_played`: samples of the reply stream played so far), and whose audio starts and stops playing
    (`on_buffer`: "started" / "stopped", response id)."""

    kind = "audio"

    def __init__(
        self,
        on_played: Any,
        on_buffer: Any,
        capacity: int,
        rate: int = OUTPUT_SAMPLE_RATE,
    ) -> None:
        super().__init__()
        self.rate = rate
        self.frame = rate * FRAME_MS // 1000
        self.capacity = capacity  # samples queued at most (the pacer keeps within `audio_lead_ms` of this)
        self._queue: deque[tuple[str | None, np.ndarray]] = deque()
        self._queued = 0
        self.received = 0  # samples of reply audio handed to the track: the stream's `sent`
        self.played = 0  # ... and played (skipped, for a stopped reply)
        self.dropped = 0  # samples dropped past `capacity` (never, while the pacer keeps its lead)
        self.paused = False
        self.playing: str | None = None  # the response whose audio is playing
        self._finished: str | None = None  # the last response whose audio is all here
        self._on_played, self._on_buffer = on_played, on_buffer
        self._start: float | None = None
        self._pts = 0

    def push(self, pcm: bytes, response_id: str | None) -> None:
        samples = np.frombuffer(pcm, "<i2")
        self.received += len(samples)
        while self._queue and self._queued + len(samples) > self.capacity:
            _, old = self._queue.popleft()
            self._queued -= len(old)
            self.dropped += len(old)
            self.played += len(old)
        self._queue.append((response_id, samples))
        self._queued += len(samples)

    def finish(self, response_id: str | None) -> None:
        """All of this response's audio has been pushed."""
        self._finished = response_id

    def cut(self) -> str | None:
        """The reply stopped: drop what was not played, and jump to the end of what was received (as a
        client does). Returns the response whose audio was cut, if any was playing or queued."""
        cut = self.playing if self.playing is not None else (self._queue[0][0] if self._queue else None)
        self._queue.clear()
        self._queued = 0
        self.played = self.received
        self.paused = False
        self.playing = None
        return cut

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            due = self._start + self._pts / self.rate
            if due > now:
                await asyncio.sleep(due - now)
                now = time.monotonic()
        out = np.zeros(self.frame, "<i2")
        taken = 0
        while taken < self.frame and self._queue and not self.paused:
            rid, chunk = self._queue[0]
            if rid != self.playing:
                self.playing = rid
                self._on_buffer("started", rid)
            n = min(self.frame - taken, len(chunk))
            out[taken : taken + n] = chunk[:n]
            taken += n
            if n == len(chunk):
                self._queue.popleft()
            else:
                self._queue[0] = (rid, chunk[n:])
        self._queued -= taken
        if taken:
            self.played += taken
            self._on_played(self.played, now)
        if not self._queue and self.playing is not None and self.playing == self._finished:
            self._on_buffer("stopped", self.playing)
            self.playing = None
        frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self.rate)
        self._pts += self.frame
        return frame


# -- the codec -----------------------------------------------------------------------------------------


class WebRtcCodec(RealtimeCodec):
    """The Realtime codec of a WebRTC call: reply audio goes to the call's `Speaker`, which plays it and
    reports what it played; `output_audio_buffer.started` / `.stopped` / `.cleared` say so on the events
    channel, as OpenAI's server does for WebRTC clients."""

    def __init__(self, conn: Connection, initial: rt.SessionUpdate | None = None) -> None:
        super().__init__(conn)
        self._initial = initial
        self._clearing = False  # `output_audio_buffer.clear`: the base codec says `cleared` itself
        t = conn.server.config.transport
        lead = OUTPUT_SAMPLE_RATE * t.audio_lead_ms // 1000
        self.speaker = Speaker(self._played, self._buffer_event, capacity=2 * lead + OUTPUT_SAMPLE_RATE)

    def started(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]:
        if self._initial is not None:  # (the call's `session`: in effect from `session.created` on)
            self._apply(self._initial)
        return super().started(msg, dialog)

    async def mic(self, pcm: bytes, now: float) -> None:
        """24 kHz PCM16 from the call's microphone track (it comes in real time: not rate limited)."""
        if self.conn.session is not None:
            await self._append(pcm, now, limited=False)

    async def _handle_event(self, event: rt.ClientEvent, event_id: str | None, now: float) -> None:
        self._clearing = isinstance(event, rt.OutputAudioClear)
        try:
            await super()._handle_event(event, event_id, now)
        finally:
            self._clearing = False

    def event(self, event: Event) -> None:
        r = self.out.response
        rid = r.id if r is not None else None
        match event:
            case ReplyPaused():
                self.speaker.paused = True
            case ReplyResumed():
                self.speaker.paused = False
            case ReplyInterrupted():
                cut = self.speaker.cut()
                super().event(event)
                if cut is not None and not self._clearing:
                    self._ev("output_audio_buffer.cleared", response_id=cut)
                return
            case ReplyDone():
                super().event(event)
                self.speaker.finish(rid)
                return
        super().event(event)

    def token(self, reply: int, text: str) -> None:
        """The transcript delta on the events channel; with the `eloquent` channel open, the token also goes
        there as Eloquent packets, and the delta carries its `token_seq` (the client merges the two by it)."""
        events = self.out.token(reply, text)
        if events and self.conn.tokens.redundant:
            events = [{**events[0], "token_seq": self.conn.tokens.push(reply, text)}]
        self._send_all(events)

    def audio(self, seq: int, pcm: bytes) -> None:
        r = self.out.response
        self.speaker.push(pcm, r.id if r is not None else None)
        self._send_all(self.out.audio(pcm, delta=False))

    def _played(self, samples: int, now: float) -> None:
        if self.conn.session is not None:
            self.conn.played(samples, now)
            self.tick(now)

    def _buffer_event(self, kind: str, response_id: str | None) -> None:
        if response_id is not None and self.conn.session is not None:
            self._ev(f"output_audio_buffer.{kind}", response_id=response_id)


# -- the call: the shell of a WebRTC session --------------------------------------------------------------


class RtcCall:
    """One call: its peer connection, and the session's `Connection` attached to it (the `Link` the core
    sees). It reads the events channel and the microphone track into the core, writes the core's events to
    the channel, and paces the reply audio; it ends on a hangup, a failed or closed peer connection, or when
    the core closes."""

    def __init__(self, server: Server, call_id: str, ip: str, initial: rt.SessionUpdate | None) -> None:
        self.server, self.id, self.ip = server, call_id, ip
        self.conn = Connection(server, functools.partial(WebRtcCodec, initial=initial), time.monotonic())
        codec = self.conn.codec
        assert isinstance(codec, WebRtcCodec)
        self.codec = codec
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.channel: Any = None  # the `oai-events` RTCDataChannel, once the client's arrives
        self._channel_open = asyncio.Event()
        self._drained = asyncio.Event()  # the channel's buffer fell below half of `CHANNEL_HIGH_BYTES`
        self._inbox: asyncio.Queue[str] = asyncio.Queue(INBOX_EVENTS)
        self._mic: asyncio.Queue[bytes] = asyncio.Queue(MIC_FRAMES)
        self._mic_track: Any = None
        self._mic_ready = asyncio.Event()
        self.mic_dropped = 0  # microphone frames dropped (the session fell 1 s behind the track)
        self.ended = asyncio.Event()
        self.why = ""

    # `connection.Link`

    def buffered(self) -> int:
        return int(self.channel.bufferedAmount) if self.channel is not None else 0

    def abort(self) -> None:
        self.end("aborted")

    def end(self, why: str) -> None:
        if not self.ended.is_set():
            self.why = why
            self.ended.set()

    # -- setting up ---------------------------------------------------------------------------------------

    async def start(self, offer: str) -> str:
        """Start the session and answer `offer` (the SDP answer). Raises `CallError`."""
        conn = self.conn
        conn.attach(self)
        await conn.open(time.monotonic())
        if conn.close is not None:  # overloaded, or no dialog model: the codec said why
            conn.release()
            reason = conn.close.reason or "unavailable"
            raise CallError(503, reason, f"the server cannot take a call now ({reason})")
        pc = self.pc
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
            if not any(t.kind == "audio" for t in pc.getTransceivers()):
                raise CallError(400, "invalid_offer", "the SDP offer has no audio section")
            pc.addTrack(self.codec.speaker)
            await pc.setLocalDescription(await pc.createAnswer())
        except CallError:
            await self._discard()
            raise
        except Exception as exc:  # (aiortc's parser and negotiation raise several kinds)
            await self._discard()
            raise CallError(400, "invalid_offer", f"the SDP offer was not accepted: {exc}") from None
        return pc.localDescription.sdp

    async def _discard(self) -> None:
        self.conn.release()
        await self.pc.close()

    def _on_channel(self, channel: Any) -> None:
        if channel.label == TOKENS_LABEL:
            self._open_tokens(channel)
            return
        if channel.label != EVENTS_LABEL or self.channel is not None:
            return
        self.channel = channel
        channel.bufferedAmountLowThreshold = CHANNEL_HIGH_BYTES // 2
        channel.on("bufferedamountlow", self._drained.set)
        channel.on("message", self._on_message)
        channel.on("close", lambda: self.end("events channel closed"))
        if channel.readyState == "open":
            self._channel_open.set()
        else:
            channel.on("open", self._channel_open.set)

    def _open_tokens(self, channel: Any) -> None:
        """The client's `eloquent` channel (it should be unordered with `maxRetransmits: 0`): reply tokens as
        Eloquent TOKENS payloads out, its ACK payloads in."""

        def send(payload: bytes) -> None:
            if channel.readyState == "open":
                channel.send(payload)

        def on_message(message: str | bytes) -> None:
            if isinstance(message, bytes):
                self.conn.tokens.channel_ack(message)

        channel.on("message", on_message)
        self.conn.tokens.open_channel(send)
        log.info(
            "call %s: reply tokens also as Eloquent packets (ordered %s, max retransmits %s)",
            self.id,
            channel.ordered,
            channel.maxRetransmits,
            extra={"event": "call.tokens", "call": self.id},
        )

    def _on_message(self, message: str | bytes) -> None:
        if not isinstance(message, str):
            message = message.decode("utf-8", "replace")
        try:
            self._inbox.put_nowait(message)
        except asyncio.QueueFull:
            log.warning("call %s: %d client events unapplied; ending the call", self.id, INBOX_EVENTS)
            self.end("too many events queued")

    def _on_track(self, track: Any) -> None:
        if track.kind == "audio" and self._mic_track is None:
            self._mic_track = track
            self._mic_ready.set()
            for receiver in self.pc.getReceivers():
                if receiver.track is track:
                    _no_playout_buffer(receiver)

    def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.end(f"peer connection {self.pc.connectionState}")

    # -- running ------------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the call until it ends; then end its session and close the peer connection."""
        conn = self.conn
        tasks = [
            asyncio.create_task(self._send_loop()),
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(conn.pace()),
            asyncio.create_task(self._read_mic()),
            asyncio.create_task(self._feed_mic()),
            asyncio.create_task(self._setup_deadline()),
            asyncio.create_task(conn.tokens.run()),  # (Eloquent's repeats, while a tokens channel is open)
        ]
        try:
            await self.ended.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            conn.link_lost(1000, time.monotonic())  # (no resume for a call: its session ends)
            await self.pc.close()
            log.info("call %s ended: %s", self.id, self.why, extra={"event": "call.ended", "call": self.id})

    async def _setup_deadline(self) -> None:
        await asyncio.sleep(CALL_SETUP_S)
        if self.pc.connectionState != "connected":
            self.end(f"not connected within {CALL_SETUP_S:.0f} s")

    async def _send_loop(self) -> None:
        conn = self.conn
        await self._channel_open.wait()
        while True:
            if conn.urgent.is_set():  # (a close that does not wait for the outbox: its own last words)
                assert conn.close is not None
                for msg in conn.close.final:
                    self._send(msg)
                break
            batch = conn.data_to_send()
            if not batch:
                if conn.close is not None or conn.finished:
                    break
                conn.outbox.ready.clear()
                urgent = asyncio.ensure_future(conn.urgent.wait())
                ready = asyncio.ensure_future(conn.outbox.ready.wait())
                try:
                    await asyncio.wait([urgent, ready], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    urgent.cancel()
                    ready.cancel()
                continue
            for msg in batch:
                while self.buffered() > CHANNEL_HIGH_BYTES:
                    self._drained.clear()
                    await self._drained.wait()
                self._send(msg)
        self.end(conn.close.reason if conn.close is not None else "session ended")

    def _send(self, msg: str | bytes) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(msg if isinstance(msg, str) else msg.decode())

    async def _read_loop(self) -> None:
        conn = self.conn
        while True:
            message = await self._inbox.get()
            if await conn.receive(message, time.monotonic()):
                conn.outbox.ready.set()  # (the sender writes what is left, then ends the call)
                return

    async def _read_mic(self) -> None:
        """The microphone track's frames, downmixed and resampled to 24 kHz, into a bounded queue (reading
        stays prompt whatever the session does: aiortc's own queue is not bounded)."""
        await self._mic_ready.wait()
        resampler: StreamResampler | None = None
        while True:
            try:
                frame = await self._mic_track.recv()
            except MediaStreamError:
                self.end("microphone track ended")
                return
            if resampler is None:
                resampler = StreamResampler(frame.sample_rate, rt.AUDIO_RATE)
            pcm = frame.to_ndarray()
            channels = len(frame.layout.channels)
            if frame.format.is_planar:
                mono = pcm.astype(np.float32).mean(axis=0)
            else:
                mono = pcm.reshape(-1, channels).astype(np.float32).mean(axis=1)
            out = resampler.push(mono / 32768.0)
            pcm24 = (np.clip(out, -1.0, 1.0) * 32767).astype("<i2").tobytes()
            if self._mic.full():
                self._mic.get_nowait()
                self.mic_dropped += 1
            self._mic.put_nowait(pcm24)

    async def _feed_mic(self) -> None:
        while True:
            pcm = await self._mic.get()
            if pcm:
                await self.codec.mic(pcm, time.monotonic())


def _no_playout_buffer(receiver: Any) -> bool:
    """The microphone's frames as soon as they are whole. aiortc's audio receiver holds 4 frames (80 ms)
    before it decodes one, a playout jitter buffer; the server plays nothing, and the recognizer and the
    endpointer want the audio as early as it can be had (measured: every turn ended 80 ms later). Frames
    stay in order; a frame is still released only once the next one's first packet has come. aiortc keeps
    the buffer private (pinned version; `tests/transport/test_webrtc_calls.py` checks it took)."""
    buffer = getattr(receiver, "_RTCRtpReceiver__jitter_buffer", None)
    if buffer is None or not hasattr(buffer, "_prefetch"):
        log.warning("aiortc's audio jitter buffer not found: the microphone's audio comes 80 ms later")
        return False
    buffer._prefetch = 1
    return True


# -- the calls a server has, and their keys ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientSecret:
    expires_at: float  # epoch seconds
    session: rt.SessionUpdate | None
    session_json: dict[str, Any] | None


class Calls:
    """A server's WebRTC calls (by id) and client secrets (by value), both bounded."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.active: dict[str, RtcCall] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._secrets: OrderedDict[str, ClientSecret] = OrderedDict()

    # -- client secrets

    def new_secret(self, body: bytes) -> dict[str, Any]:
        """`POST /v1/realtime/client_secrets`: a key that places calls until it expires, with the session
        settings it was given (applied to every call made with it). Raises `CallError`."""
        request = _json_object(body) if body else {}
        ttl = SECRET_TTL_S
        expires = request.get("expires_after")
        if expires is not None:
            seconds = expires.get("seconds") if isinstance(expires, dict) else None
            if not isinstance(seconds, int) or isinstance(seconds, bool) or not 10 <= seconds <= 7200:
                raise CallError(400, "invalid_value", "`expires_after.seconds` must be an integer in [10, 7200].")
            ttl = seconds
        session_json = request.get("session")
        update = _session(session_json) if session_json is not None else None
        now = time.time()
        self._forget_expired(now)
        if len(self._secrets) >= MAX_SECRETS:
            raise CallError(429, "too_many_secrets", f"{MAX_SECRETS} client secrets are live; try again later")
        value = "ek_" + secrets.token_urlsafe(24)
        secret = ClientSecret(now + ttl, update, session_json)
        self._secrets[value] = secret
        settings = rt.SessionSettings(instructions=self.server.config.dialog.system_prompt)
        shown = session_object("sess_" + secrets.token_hex(8), settings, VadDefaults.of(self.server.config))
        if update is not None:
            shown = {**shown, **{k: v for k, v in session_json.items() if k in shown}}  # type: ignore[union-attr]
        return {"value": value, "expires_at": int(secret.expires_at), "session": shown}

    def secret(self, value: str | None) -> ClientSecret | None:
        """The live client secret `value` is, if it is one."""
        if not value:
            return None
        self._forget_expired(time.time())
        return self._secrets.get(value)

    def _forget_expired(self, now: float) -> None:
        for value in [v for v, s in self._secrets.items() if s.expires_at <= now]:
            del self._secrets[value]

    # -- calls

    async def create(self, body: bytes, content_type: str, ip: str, secret: ClientSecret | None) -> tuple[str, str]:
        """`POST /v1/realtime/calls`: (call id, SDP answer). Raises `CallError`."""
        offer, session_json = _offer(body, content_type)
        update = secret.session if secret is not None else None
        if session_json is not None:
            update = _session(session_json)
        server = self.server
        if server.draining or not server.admits():
            raise CallError(503, "overloaded", f"server is full ({len(server.sessions)} sessions)")
        if len(self.active) >= MAX_CALLS:
            raise CallError(503, "overloaded", f"{MAX_CALLS} calls are in progress")
        call_id = "rtc_" + secrets.token_hex(12)
        call = RtcCall(server, call_id, ip, update)
        answer = await call.start(offer)
        self.active[call_id] = call
        server.per_ip[ip] += 1
        server.counters["calls"] += 1
        task = asyncio.get_running_loop().create_task(self._serve(call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info("call %s answered", call_id, extra={"event": "call.answered", "call": call_id})
        return call_id, answer

    async def _serve(self, call: RtcCall) -> None:
        try:
            await call.run()
        finally:
            self.active.pop(call.id, None)
            per_ip = self.server.per_ip
            per_ip[call.ip] -= 1
            if per_ip[call.ip] <= 0:
                del per_ip[call.ip]

    def hangup(self, call_id: str) -> bool:
        call = self.active.get(call_id)
        if call is None:
            return False
        call.end("hung up")
        return True

    async def close(self) -> None:
        """End every call (the server stops)."""
        for call in list(self.active.values()):
            call.end("server stopping")
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CallError(400, "invalid_json", f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CallError(400, "invalid_json", "the request body must be a JSON object")
    return value


def _session(session_json: object) -> rt.SessionUpdate:
    try:
        return rt.parse_session(session_json)
    except rt.RealtimeError as exc:
        raise CallError(400, exc.code, exc.message) from None


def _offer(body: bytes, content_type: str) -> tuple[str, dict[str, Any] | None]:
    """The SDP offer, and the session's settings when the request gave them (a multipart form)."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == "application/sdp":
        return _sdp(body), None
    if kind != "multipart/form-data":
        raise CallError(
            415, "unsupported_media_type", "send the SDP offer as application/sdp, or a multipart form (sdp, session)"
        )
    form = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    if not form.is_multipart():
        raise CallError(400, "invalid_form", "the multipart form could not be read")
    fields: dict[str, bytes] = {}
    for part in form.iter_parts():  # type: ignore[attr-defined]
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            fields[name] = payload
    if "sdp" not in fields:
        raise CallError(400, "missing_required_parameter", "the form has no `sdp` field")
    session = _json_object(fields["session"]) if "session" in fields else None
    return _sdp(fields["sdp"]), session


def _sdp(data: bytes) -> str:
    try:
        sdp = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CallError(400, "invalid_offer", "the SDP offer is not UTF-8 text") from None
    if not sdp.startswith("v=0"):
        raise CallError(400, "invalid_offer", "the SDP offer must start with `v=0`")
    return sdp
