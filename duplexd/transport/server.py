"""The WebSocket + HTTP shell. It moves bytes and events; the session cores decide, the workers compute.

The server builds the workers from the loaded models, serves one port (`transport.http` routes the
requests; `/v1/stream` and `/v1/realtime` are WebSockets) and keeps the sessions' handles: a
`transport.connection.Connection` per session, with the native codec or (on `/v1/realtime`) the Realtime
one. Its load loop (`transport.control`) feeds the metrics and the admission controller.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import resource
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from websockets.asyncio.server import ServerConnection

from duplexd import __version__, logs
from duplexd.asr.engine import AsrEngine
from duplexd.asr.turn_audio import WINDOW_S, TurnAudioModel
from duplexd.asr.vad import SileroVad
from duplexd.config import ServerConfig
from duplexd.errors import ErrorCode, ProtocolError
from duplexd.scheduler.admission import Aimd, AimdConfig
from duplexd.scheduler.dialog import DialogWorker, LlmEngine
from duplexd.scheduler.hrrn import PassCost
from duplexd.scheduler.tts import TtsWorker
from duplexd.scheduler.workers import AsrScheduler, TurnAudioWorker, VadWorker
from duplexd.streaming.session import Session, SessionConfig
from duplexd.tools.mcp import McpHub
from duplexd.transport import protocol
from duplexd.transport.connection import Connection
from duplexd.transport.control import LoadControl
from duplexd.transport.datagram import DatagramEndpoint
from duplexd.transport.http import REALTIME_PATH, STREAM_PATH, peer_ip, rounded, route
from duplexd.transport.listener import Listener
from duplexd.transport.looplag import LoopLag
from duplexd.transport.metrics import Metrics
from duplexd.transport.native import NativeCodec
from duplexd.transport.protocol import Limits
from duplexd.transport.realtime_session import RealtimeCodec
from duplexd.transport.resume import same_token
from duplexd.transport.shell import WebSocketShell
from duplexd.transport.webrtc import Calls
from duplexd.tts.engine import TtsEngine

__all__ = ["REALTIME_PATH", "STREAM_PATH", "Engines", "Server"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Engines:
    """The loaded models. Without `dialog` and `tts` the server only transcribes."""

    vad: SileroVad
    asr: AsrEngine
    dialog: LlmEngine | None = None  # DialogEngine, or RemoteDialogEngine (`[dialog] backend`)
    tts: TtsEngine | None = None
    turn_audio: TurnAudioModel | None = None  # how the user stopped talking (`turn.audio_model`)
    tools: McpHub | None = None  # the MCP servers of `[tools]` (closed with the server)


class Server:
    def __init__(self, config: ServerConfig, engines: Engines) -> None:
        self.config = config
        t = config.transport
        self.limits = Limits(t.min_sample_rate, t.max_sample_rate, t.max_frame_ms, t.max_message_bytes)
        self.session_config = SessionConfig(
            config.vad,
            config.asr,
            config.turn.pause_ms,
            t.ack_interval_ms,
            keep_audio_s=WINDOW_S if engines.turn_audio and engines.dialog else 0.0,
        )
        self.vad = VadWorker(engines.vad, max_pending=4 * t.max_sessions)
        # LLM steps and recognizer passes take turns on the cores (`dialog.take_turns_with_asr`)
        self.cores = threading.Lock() if config.dialog.take_turns_with_asr else None
        self.asr = AsrScheduler(engines.asr, self.cores)
        self.asr_name = engines.asr.name
        self.dialog = (
            DialogWorker(
                engines.dialog,
                config.dialog.system_prompt,
                speculation=config.speculation,
                yield_to=self._others_busy if config.speculation.yield_to_asr else None,
                head_start=self._no_reply_synthesis,
                max_reply_tokens=config.dialog.max_reply_tokens,
                max_reply_sentences=config.dialog.max_reply_sentences,
                contended=self._others_busy,
                cores=self.cores,
            )
            if engines.dialog and engines.tts
            else None
        )
        self.tts = TtsWorker(engines.tts) if engines.dialog and engines.tts else None
        self.turn_audio = (
            TurnAudioWorker(engines.turn_audio, max_pending=t.max_sessions)
            if engines.turn_audio and self.dialog
            else None
        )
        self.engines_tools = engines.tools
        self.sessions: dict[str, Session] = {}
        self.handles: dict[str, Connection] = {}  # every session's handle, attached or awaiting a resume
        self.datagram: DatagramEndpoint | None = None
        self.draining = False  # SIGTERM: no new sessions; replies in progress finish
        self.per_ip: Counter[str] = Counter()  # open WebSocket connections and WebRTC calls by client address
        self.calls = Calls(self)  # WebRTC calls (`/v1/realtime/calls`)
        self.counters = {
            "connections": 0,
            "sessions": 0,
            "protocol_errors": 0,
            "refused": 0,
            "detached": 0,
            "resumed": 0,
            "expired": 0,
            "slow_consumers": 0,
            "calls": 0,
        }
        a = config.admission
        capacity = t.max_sessions if self.dialog is None else min(t.max_sessions, config.dialog.max_sessions)
        self.admission = Aimd(
            AimdConfig(
                {"frame_lag_ms": a.frame_deadline_ms, "asr_lag_s": a.asr_lag_s, "reply_lag_s": a.reply_lag_s},
                initial=float(a.initial_sessions or capacity),
                increase=a.increase,
                beta=a.beta,
                settle_periods=max(1, math.ceil(a.settle_s / a.period_s)),
                confirm_periods=max(1, math.ceil(a.confirm_s / a.period_s - 1e-9)),
                recover_s=a.recover_s,
            ),
            capacity,
        )
        self.metrics = Metrics()
        self.control = LoadControl(self)
        self.loop_lag = LoopLag(self.metrics.loop_lag.observe)
        self.underrun_closed_s = 0.0  # reply underrun of sessions that have ended
        self.starting = 0  # admitted handshakes not yet registered (they count against the limit)
        self._listener: Listener | None = None
        self._started = time.monotonic()

    async def drain(self) -> None:
        """Stop admitting; let replies in progress finish (up to `drain_timeout_s`); then tell every client
        the server is going away (the connections are closed with 1001 next)."""
        self.draining = True
        deadline = time.monotonic() + self.config.security.drain_timeout_s
        log.info("draining: %d sessions", len(self.sessions), extra={"event": "server.draining"})
        while time.monotonic() < deadline:
            if not any(c.busy_replying for c in self.handles.values() if c.attached):
                break
            await asyncio.sleep(0.05)  # (a reply ends through many paths; polling them is simplest)
        for conn in list(self.handles.values()):
            if conn.attached:
                conn.ended = True
                conn.codec.error(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
                await conn.flush(timeout_s=1.0)

    @property
    def port(self) -> int:
        assert self._listener is not None, "server not started"
        return self._listener.port

    async def run(
        self, stop: asyncio.Event, *, ready: asyncio.Future[int] | None = None, listener: Listener | None = None
    ) -> None:
        """Serve until `stop` is set, then close every connection and stop the workers. `listener`: the port
        already open (`duplexd serve` opens it before the models load); else the server opens its own."""
        t = self.config.transport
        redact = logs.Redact(self.config.security.api_key)
        for name in logs.REDACTED_LOGGERS:  # (the key can arrive in a request line: `?token=...`)
            logging.getLogger(name).addFilter(redact)
        if t.datagram:
            self.datagram = await DatagramEndpoint.open(t.datagram_host or t.host, t.datagram_port)
        try:
            async with asyncio.TaskGroup() as tg:
                workers = [
                    tg.create_task(self.vad.run()),
                    tg.create_task(self.asr.run()),
                    tg.create_task(self.control.run()),
                    tg.create_task(self.loop_lag.run()),
                ]
                if self.dialog is not None and self.tts is not None:
                    workers += [tg.create_task(self.dialog.run()), tg.create_task(self.tts.run())]
                if listener is None:
                    listener = await Listener.open(t, self.config.security)
                self._listener = listener
                try:
                    listener.attach(functools.partial(route, self), self._handle)
                    if ready is not None:
                        ready.set_result(self.port)
                    await stop.wait()
                    await self.drain()
                finally:
                    await self.calls.close()
                    await listener.close()
                for task in workers:
                    task.cancel()
        finally:
            for name in logs.REDACTED_LOGGERS:
                logging.getLogger(name).removeFilter(redact)
            for conn in list(self.handles.values()):
                conn.release()
            if self.datagram is not None:
                self.datagram.close()
            self.vad.close()
            self.asr.close()
            if self.turn_audio is not None:
                self.turn_audio.close()
            if self.engines_tools is not None:
                self.engines_tools.close()
            if self.dialog is not None and self.tts is not None:
                self.dialog.close_worker()
                self.tts.close()

    # -- admission ----------------------------------------------------------------------------------

    def admits(self) -> bool:
        """A new session would be admitted now (below the hard limit and, if enabled, the AIMD limit)."""
        if self.draining:
            return False
        n = len(self.sessions) + self.starting
        if n >= self.config.transport.max_sessions:
            return False
        return not self.config.admission.enabled or self.admission.admit(n)

    def _others_busy(self) -> bool:
        """A recognizer pass or a reply's synthesis is running: drafts (speculative work) wait."""
        return self.asr.busy or (self.tts is not None and self.tts.busy)

    def _no_reply_synthesis(self) -> bool:
        """No reply is being synthesized (a draft's head start may run beside a recognizer pass)."""
        return not (self.tts is not None and self.tts.busy)

    def threads(self) -> dict[str, object]:
        """Each model's compute threads, and how idle OpenMP threads wait (they share the cores)."""
        stepping = None if self.dialog is None else self.dialog.engine.stats.get("threads")
        return {
            "dialog": stepping or None,  # (as the engine's own thread sees them; None before its first step)
            "asr": self.config.asr.cpu_threads or os.cpu_count(),
            "tts": None if self.tts is None else self.config.tts.threads,
            "vad": 1,
            "openmp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},  # (cli.openmp_setup)
        }

    def models(self) -> dict[str, str | None]:
        return {
            "vad": "silero-vad (onnx)",
            "asr": self.asr_name,
            "llm": self.dialog.name if self.dialog else None,
            "tts": self.tts.engine.name if self.tts else None,
        }

    def health(self) -> dict[str, Any]:
        stats = self.asr.stats
        recent = sorted(stats.recent_pass_s)
        return {
            "status": "ok",
            "version": __version__,
            "node": self.config.transport.node or None,
            "uptime_s": round(time.monotonic() - self._started, 1),
            "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # (Linux: KiB)
            "sessions": len(self.sessions),
            "models": self.models(),
            "asr": {
                "passes": stats.passes,
                "busy_s": round(stats.busy_s, 3),
                "window_audio_s": round(stats.audio_s, 3),
                "pass_p50_s": round(recent[len(recent) // 2], 3) if recent else None,
                "pass_cost": _cost(self.asr.cost.full),
                "preview_pass_cost": _cost(self.asr.cost.preview),
                "contested_choices": sum(len(c.ratios) > 1 for c in self.asr.schedule),
            },
            "echo": {  # the echo cancellers' cost, on the VAD worker's thread
                "audio_s": round(self.vad.echo_audio_s, 3),
                "busy_s": round(self.vad.echo_s, 3),
                "echo_only_chunks": self.vad.echo_gated,
                "ms_per_s": round(1000 * self.vad.echo_s / self.vad.echo_audio_s, 2) if self.vad.echo_audio_s else None,
            },
            "event_loop": self.loop_lag.summary(),
            "counters": dict(self.counters),
            "detached_sessions": sum(not c.attached for c in self.handles.values()),
            "outbound_bytes_max": max((c.outbound_bytes for c in self.handles.values() if c.attached), default=0),
            "datagram": None if self.datagram is None else {"port": self.datagram.port, **asdict(self.datagram.stats)},
            "admission": {
                "enabled": self.config.admission.enabled,
                "limit": self.admission.sessions,
                "capacity": self.admission.capacity,
                "ready": self.admits(),
            },
            "llm": None if self.dialog is None else rounded(self.dialog.engine.stats),
            "llm_engine": None if self.dialog is None else self.dialog.engine.tuning,
            # (the remote backend with `dialog.turn_model`: the local model scoring P(end of turn))
            "turn_scorer": self._turn_scorer(),
            # (`dialog.mode = "relay"`: the local model that speaks replies' first words, and how often it did)
            "relay": self._relay(),
            "tools": self._tools(),
            "turn_audio": None if self.turn_audio is None else self.turn_audio.report(),
            "llm_steps": None if self.dialog is None else self.dialog.step_times(),
            "threads": self.threads(),
            "speculation": None if self.dialog is None else self.dialog.stats.as_dict(),
            "tts": None
            if self.tts is None
            else {
                "pieces": self.tts.stats.pieces,
                "busy_s": round(self.tts.stats.busy_s, 3),
                "audio_s": round(self.tts.stats.audio_s, 3),
                "rtf": round(self.tts.stats.busy_s / self.tts.stats.audio_s, 4) if self.tts.stats.audio_s else None,
                "prefetched": self.tts.stats.prefetched,
                "prefetch_hits": self.tts.stats.prefetch_hits,
            },
        }

    def _turn_scorer(self) -> dict[str, object] | None:
        from duplexd.dialog.turn_scorer import TurnScoredEngine

        engine = None if self.dialog is None else self.dialog.engine
        return engine.scorer_report() if isinstance(engine, TurnScoredEngine) else None

    def _tools(self) -> dict[str, object] | None:
        """`[tools]`: the MCP servers' tools, and what their calls did (`tools.runner.ToolRunner.stats`)."""
        runner = None if self.dialog is None else getattr(self.dialog.engine, "runner", None)
        if runner is None:
            return None
        tools = [{"name": s.name, "server": s.server, "read_only": runner.read_only(s)} for s in runner.specs]
        return {"tools": tools, "speculate": runner.config.speculate, **runner.stats}

    def _relay(self) -> dict[str, object] | None:
        from duplexd.dialog.relay import RelayDialogEngine

        engine = None if self.dialog is None else self.dialog.engine
        return engine.relay_report() if isinstance(engine, RelayDialogEngine) else None

    # -- WebSocket ----------------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        ip = peer_ip(ws, self.config.security.proxies)
        if size := self.config.transport.send_buffer_bytes:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        self.per_ip[ip] += 1
        try:
            await self._serve_connection(ws)
        finally:
            self.per_ip[ip] -= 1
            if self.per_ip[ip] <= 0:
                del self.per_ip[ip]

    async def _serve_connection(self, ws: ServerConnection) -> None:
        self.counters["connections"] += 1
        realtime = ws.request is not None and ws.request.path.split("?", 1)[0] == REALTIME_PATH
        conn = Connection(self, RealtimeCodec if realtime else NativeCodec, time.monotonic())
        idle_s = self.config.security.idle_timeout_s
        await WebSocketShell(conn, ws, idle_s).run()
        if conn.resume is not None:  # the connection asked to continue a session: hand it over
            target, msg = conn.resume
            await WebSocketShell(target, ws, idle_s).run(resume=msg)

    def find_resumable(self, msg: protocol.SessionResume) -> Connection:
        """The session `msg` asks to continue, if the token is its own; else `resume_refused`."""
        conn = self.handles.get(msg.session_id)
        if conn is None or not same_token(msg.resume_token, conn.resume_token):
            raise ProtocolError(
                ErrorCode.RESUME_REFUSED, "no such session to resume (ended, expired, or not yours)", fatal=True
            )
        return conn


def _cost(line: PassCost) -> dict[str, float]:
    return {"fixed_s": round(line.fixed_s, 3), "per_audio_s": round(line.per_s, 4)}
