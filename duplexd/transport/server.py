"""The WebSocket + HTTP shell. It moves bytes and events; the session core decides, the workers compute.

Routes on one port: `/v1/stream` (WebSocket, native protocol v1), `GET /healthz`, `GET /` (web client).
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import time
import uuid
from importlib import resources
from typing import Any

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from duplexd import __version__
from duplexd.asr.engine import AsrEngine
from duplexd.asr.vad import SileroVad
from duplexd.config import ServerConfig
from duplexd.errors import ErrorCode, Overloaded, ProtocolError
from duplexd.scheduler.workers import AsrScheduler, VadWorker
from duplexd.streaming.events import Event
from duplexd.streaming.session import Session
from duplexd.transport import protocol
from duplexd.transport.protocol import Limits, ServerType

log = logging.getLogger(__name__)

STREAM_PATH = "/v1/stream"

# RFC 6455 close codes.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN_LATER = 1013

_FATAL_CLOSE = {
    ErrorCode.UNSUPPORTED_VERSION: CLOSE_PROTOCOL_ERROR,
    ErrorCode.NOT_STARTED: CLOSE_PROTOCOL_ERROR,
    ErrorCode.BAD_SAMPLE_RATE: CLOSE_UNSUPPORTED_DATA,
    ErrorCode.TOO_MANY_ERRORS: CLOSE_POLICY,
}


class _Closing(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Server:
    def __init__(self, config: ServerConfig, vad: SileroVad, asr: AsrEngine) -> None:
        self.config = config
        t = config.transport
        self.limits = Limits(t.min_sample_rate, t.max_sample_rate, t.max_frame_ms, t.max_message_bytes)
        self.vad = VadWorker(vad, max_pending=4 * t.max_sessions)
        self.asr = AsrScheduler(asr)
        self.asr_name = asr.name
        self.sessions: dict[str, Session] = {}
        self.counters = {"connections": 0, "sessions": 0, "protocol_errors": 0, "refused": 0}
        self._ws: WsServer | None = None
        self._started = time.monotonic()

    @property
    def port(self) -> int:
        assert self._ws is not None, "server not started"
        return self._ws.sockets[0].getsockname()[1]

    async def run(self, stop: asyncio.Event, *, ready: asyncio.Future[int] | None = None) -> None:
        """Serve until `stop` is set, then close every connection and stop the workers."""
        t = self.config.transport
        try:
            async with asyncio.TaskGroup() as tg:
                vad_task = tg.create_task(self.vad.run())
                asr_task = tg.create_task(self.asr.run())
                async with serve(
                    self._handle,
                    t.host,
                    t.port,
                    process_request=self._route,
                    max_size=t.max_message_bytes,
                    max_queue=16,
                    server_header=f"duplexd/{__version__}",
                ) as ws:
                    self._ws = ws
                    if ready is not None:
                        ready.set_result(self.port)
                    await stop.wait()
                    ws.close(close_connections=True)
                    await ws.wait_closed()
                vad_task.cancel()
                asr_task.cancel()
        finally:
            self.vad.close()
            self.asr.close()

    # -- HTTP ---------------------------------------------------------------------------------------

    def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == STREAM_PATH:
            return None  # go on with the WebSocket handshake
        if path == "/healthz":
            return _response(http.HTTPStatus.OK, "application/json", json.dumps(self.health()).encode())
        if path in ("/", "/index.html"):
            page = resources.files("duplexd.clients.web").joinpath("index.html").read_bytes()
            return _response(http.HTTPStatus.OK, "text/html; charset=utf-8", page)
        return _response(http.HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")

    def health(self) -> dict[str, Any]:
        stats = self.asr.stats
        recent = sorted(stats.recent_pass_s)
        return {
            "status": "ok",
            "version": __version__,
            "uptime_s": round(time.monotonic() - self._started, 1),
            "sessions": len(self.sessions),
            "models": {"vad": "silero-vad (onnx)", "asr": self.asr_name},
            "asr": {
                "passes": stats.passes,
                "busy_s": round(stats.busy_s, 3),
                "window_audio_s": round(stats.audio_s, 3),
                "pass_p50_s": round(recent[len(recent) // 2], 3) if recent else None,
            },
            "counters": dict(self.counters),
        }

    # -- WebSocket ----------------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        self.counters["connections"] += 1
        conn = _Connection(self, ws)
        try:
            await conn.run()
        finally:
            conn.release()


def _response(status: http.HTTPStatus, content_type: str, body: bytes) -> Response:
    headers = Headers({"Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store"})
    return Response(status.value, status.phrase, headers, body)


class _Connection:
    """One WebSocket: a reader that feeds the session core, a sender that drains a bounded queue."""

    def __init__(self, server: Server, ws: ServerConnection) -> None:
        self.server = server
        self.ws = ws
        self.session: Session | None = None
        self.errors = 0
        self._out: asyncio.Queue[str | None] = asyncio.Queue(maxsize=server.config.transport.outbound_queue)
        self._overflowed = False

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(self._send_loop())
                try:
                    await self._read_loop()
                    self.send(None)  # let the sender finish what is queued, then stop
                except _Closing as closing:
                    self.send(None)
                    await sender
                    await self.ws.close(closing.code, closing.reason)
        except* ConnectionClosed:
            pass

    def release(self) -> None:
        if self.session is not None:
            self.server.asr.unregister(self.session)
            self.server.sessions.pop(self.session.id, None)
            self.session = None

    # outbound

    def send(self, msg: dict[str, Any] | None) -> None:
        if self._overflowed:
            return
        try:
            self._out.put_nowait(None if msg is None else protocol.dumps(msg))
        except asyncio.QueueFull:
            # The client does not read fast enough; rather than buffer without bound, end the session.
            self._overflowed = True
            log.warning("closing slow client %s", self.session.id if self.session else "?")
            if self.ws.transport is not None:
                self.ws.transport.abort()

    def emit(self, events: list[Event]) -> None:
        for event in events:
            self.send(protocol.encode_event(event))

    async def _send_loop(self) -> None:
        while (msg := await self._out.get()) is not None:
            await self.ws.send(msg)

    # inbound

    async def _read_loop(self) -> None:
        async for message in self.ws:
            try:
                if isinstance(message, str):
                    done = await self._on_text(message)
                    if done:
                        return
                else:
                    await self._on_audio(message)
            except ProtocolError as exc:
                self._on_protocol_error(exc)
            except Overloaded as exc:
                self.send(protocol.error_message(ErrorCode.OVERLOADED, str(exc)))
                raise _Closing(CLOSE_TRY_AGAIN_LATER, "overloaded") from None

    def _on_protocol_error(self, exc: ProtocolError) -> None:
        self.server.counters["protocol_errors"] += 1
        self.errors += 1
        self.send(protocol.error_message(exc.code, exc.message))
        if exc.fatal:
            raise _Closing(_FATAL_CLOSE.get(exc.code, CLOSE_PROTOCOL_ERROR), exc.code.value)
        if self.errors >= self.server.config.transport.max_errors:
            self.send(protocol.error_message(ErrorCode.TOO_MANY_ERRORS, "too many protocol errors"))
            raise _Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

    async def _on_text(self, data: str) -> bool:
        msg = protocol.parse_text(data, self.server.limits)
        if isinstance(msg, protocol.SessionStart):
            if self.session is not None:
                raise ProtocolError(ErrorCode.ALREADY_STARTED, "session already started")
            self._start(msg)
            return False
        if self.session is None:
            raise ProtocolError(ErrorCode.NOT_STARTED, "session.end before session.start", fatal=True)
        await self._finish()
        return True

    def _start(self, msg: protocol.SessionStart) -> None:
        server = self.server
        if len(server.sessions) >= server.config.transport.max_sessions:
            server.counters["refused"] += 1
            raise Overloaded(f"server is full ({len(server.sessions)} sessions)")
        session = Session(uuid.uuid4().hex, msg.sample_rate, server.config)
        self.session = session
        server.sessions[session.id] = session
        server.counters["sessions"] += 1
        server.asr.register(session, self.emit)
        t = server.config.transport
        self.send(
            {
                "type": ServerType.SESSION_STARTED,
                "session_id": session.id,
                "version": protocol.PROTOCOL_VERSION,
                "sample_rate": msg.sample_rate,
                "limits": {
                    "max_message_bytes": t.max_message_bytes,
                    "max_frame_ms": t.max_frame_ms,
                    "ack_interval_ms": t.ack_interval_ms,
                },
                "models": {"vad": "silero-vad", "asr": server.asr_name},
            }
        )

    async def _on_audio(self, data: bytes) -> None:
        session = self.session
        if session is None:
            raise ProtocolError(ErrorCode.NOT_STARTED, "audio before session.start", fatal=True)
        frame = protocol.parse_binary(data, session.sample_rate, self.server.limits)
        chunks = session.accept_frame(frame.seq, frame.pcm, time.monotonic())
        await self._run_vad(session, chunks)

    async def _run_vad(self, session: Session, chunks: Any) -> None:
        probs = await self.server.vad.probabilities(session.vad_stream, chunks)
        self.emit(session.apply_vad(chunks, probs, time.monotonic()))
        if session.wants_pass():
            self.server.asr.notify()

    async def _finish(self) -> None:
        """session.end: decode what was heard, send the last transcripts, then say goodbye."""
        session = self.session
        assert session is not None
        await self._run_vad(session, session.flush_audio())
        session.end_of_stream()
        await self.server.asr.drained(session)
        self.emit(session.finish_without_pass())
        self.send({"type": ServerType.SESSION_ENDED, "session_id": session.id})
