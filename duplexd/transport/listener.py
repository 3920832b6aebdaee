"""The listening socket, opened before the models load.

`duplexd serve` binds its port first, so a busy port is reported at once rather than after the models have
loaded, and while they load the port already answers: `/healthz` 200 `{"status": "loading"}`, `/readyz` and
every other route 503 with a retry hint (a balancer or a person sees the server coming up, not a refused
connection). When the server is ready it takes the same listener over (`attach`): no connection is refused
in between.

Light on purpose: nothing here imports a model library, so the port answers while they are imported.
"""

from __future__ import annotations

import http
import json
import ssl
import time
from typing import Any, Protocol

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from duplexd import __version__
from duplexd.config import SecurityConfig, TransportConfig

LOADING_RETRY_S = 2


class Route(Protocol):
    def __call__(self, connection: ServerConnection, request: Request) -> Response | None: ...


class Handler(Protocol):
    async def __call__(self, ws: ServerConnection) -> None: ...


def tls_context(security: SecurityConfig) -> ssl.SSLContext | None:
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


def response(status: http.HTTPStatus, content_type: str, body: bytes, *, retry_after_s: int | None = None) -> Response:
    headers = Headers({"Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store"})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return Response(status.value, status.phrase, headers, body)


_LOADING_PAGE = (
    f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="{LOADING_RETRY_S}">'
    "<title>duplexd</title><p>duplexd is loading its models; this page reloads by itself.</p>\n"
).encode()


class Listener:
    """The WebSocket server on the configured port, with a route and a handler that can be swapped: it
    answers "loading" until `attach` hands it the real server's."""

    ws: WsServer

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._route: Route = self._loading
        self._handler: Handler | None = None

    @classmethod
    async def open(cls, transport: TransportConfig, security: SecurityConfig) -> Listener:
        """Bind and listen (an `OSError` for a busy port or a bad address, at once)."""
        listener = cls()
        listener.ws = await serve(
            listener._handle,
            transport.host,
            transport.port,
            process_request=listener._process_request,
            max_size=transport.max_message_bytes,
            max_queue=16,
            server_header=f"duplexd/{__version__}",
            ssl=tls_context(security),
        )
        return listener

    @property
    def port(self) -> int:
        return self.ws.sockets[0].getsockname()[1]

    def attach(self, route: Route, handler: Handler) -> None:
        """The server is ready: its routes and WebSocket handler answer from the next request on."""
        self._route, self._handler = route, handler

    async def close(self) -> None:
        self.ws.close(close_connections=True)
        await self.ws.wait_closed()

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        return self._route(connection, request)

    async def _handle(self, ws: ServerConnection) -> None:
        assert self._handler is not None, "a WebSocket was accepted before the server was attached"
        await self._handler(ws)

    def _loading(self, connection: ServerConnection, request: Request) -> Response:
        path = request.path.split("?", 1)[0]
        status: dict[str, Any] = {"status": "loading", "version": __version__}
        if path == "/healthz":  # alive, not ready: a liveness probe must not restart a loading server
            status["uptime_s"] = round(time.monotonic() - self._started, 1)
            return response(http.HTTPStatus.OK, "application/json", json.dumps(status).encode())
        unavailable = http.HTTPStatus.SERVICE_UNAVAILABLE
        retry = {"retry_after_s": LOADING_RETRY_S}
        if path == "/readyz":
            body = {"ready": False, **status, "retry_after_ms": 1000 * LOADING_RETRY_S}
            return response(unavailable, "application/json", json.dumps(body).encode(), **retry)
        if path in ("/", "/index.html"):
            return response(unavailable, "text/html; charset=utf-8", _LOADING_PAGE, **retry)
        error = {"error": {"code": "loading", "message": "the server is loading its models; try again shortly"}}
        return response(unavailable, "application/json", json.dumps(error).encode(), **retry)
