"""The HTTP side of the one port: which requests may open a WebSocket (API key, origin, connections per
address), the plain routes: `/healthz`, `/readyz`, `/metrics`, and the web client's files, and the POSTs of
WebRTC calls (`transport.webrtc`): `/v1/realtime/calls`, its `/hangup`, `/v1/realtime/client_secrets`."""

from __future__ import annotations

import http
import json
import math
from collections.abc import Awaitable
from importlib import resources
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from duplexd.transport.limits import authorized, origin_allowed, request_key
from duplexd.transport.listener import MAX_BODY_BYTES
from duplexd.transport.listener import response as _response
from duplexd.transport.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from duplexd.transport.webrtc import CallError

if TYPE_CHECKING:
    from duplexd.transport.server import Server

STREAM_PATH = "/v1/stream"
REALTIME_PATH = "/v1/realtime"  # OpenAI Realtime-compatible (transport.realtime_session)
CALLS_PATH = "/v1/realtime/calls"  # WebRTC (transport.webrtc)
SECRETS_PATH = "/v1/realtime/client_secrets"


def route(server: Server, connection: ServerConnection, request: Request) -> Response | Awaitable[Response] | None:
    """Every HTTP request: a WebSocket path goes on to the handshake (None) once it passes the checks;
    the other routes are answered here (placing a call is awaited)."""
    path = request.path.split("?", 1)[0]
    sec = server.config.security
    if request.method != "GET":
        return _post(server, connection, request, path)
    if path in (STREAM_PATH, REALTIME_PATH, "/metrics") and not authorized(
        sec.api_key, request.headers.get("Authorization"), request.path
    ):
        return json_error(http.HTTPStatus.UNAUTHORIZED, "unauthorized", "a valid API key is required", auth=True)
    if path in (STREAM_PATH, REALTIME_PATH):
        if not origin_allowed(sec.origins, request.headers.get("Origin")):
            return json_error(http.HTTPStatus.FORBIDDEN, "forbidden_origin", "this origin may not connect")
        ip = peer_ip(connection, sec.proxies)
        if server.per_ip[ip] >= sec.max_connections_per_ip:
            return _too_many(server)
        return None  # go on with the WebSocket handshake
    if path == "/healthz":
        return _response(http.HTTPStatus.OK, "application/json", json.dumps(server.health()).encode())
    if path == "/readyz":
        ready = server.admits()
        body = {
            "ready": ready,
            "sessions": len(server.sessions),
            "limit": server.admission.sessions,
            **({} if ready else {"retry_after_ms": server.config.admission.retry_after_ms}),
        }
        status = http.HTTPStatus.OK if ready else http.HTTPStatus.SERVICE_UNAVAILABLE
        return _response(status, "application/json", json.dumps(body).encode())
    if path == "/metrics":
        server.control.collect()
        return _response(http.HTTPStatus.OK, METRICS_CONTENT_TYPE, server.metrics.render())
    if path == "/":
        path = "/index.html"
    static = static_file(path)
    if static is not None:
        return _response(http.HTTPStatus.OK, *static)
    return _response(http.HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")


def _post(server: Server, connection: ServerConnection, request: Request, path: str) -> Response | Awaitable[Response]:
    """The WebRTC routes; any other request with another method than GET is refused."""
    hangup = path.startswith(CALLS_PATH + "/") and path.endswith("/hangup")
    if request.method != "POST" or not (path in (CALLS_PATH, SECRETS_PATH) or hangup):
        return json_error(http.HTTPStatus.METHOD_NOT_ALLOWED, "method_not_allowed", f"{request.method} {path}")
    if getattr(connection, "body_too_large", False):
        return json_error(
            http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request_too_large", f"the body is over {MAX_BODY_BYTES} bytes"
        )
    sec = server.config.security
    if not origin_allowed(sec.origins, request.headers.get("Origin")):
        return json_error(http.HTTPStatus.FORBIDDEN, "forbidden_origin", "this origin may not connect")
    authorization = request.headers.get("Authorization")
    secret = None if path == SECRETS_PATH else server.calls.secret(request_key(authorization, request.path))
    if secret is None and not authorized(sec.api_key, authorization, request.path):
        return json_error(http.HTTPStatus.UNAUTHORIZED, "unauthorized", "a valid API key is required", auth=True)
    body: bytes = getattr(connection, "body", None) or b""
    if hangup:
        call_id = path[len(CALLS_PATH) + 1 : -len("/hangup")]
        if not server.calls.hangup(call_id):
            return json_error(http.HTTPStatus.NOT_FOUND, "call_not_found", f"no call {call_id[:64]} in progress")
        return _response(http.HTTPStatus.OK, "application/json", b"{}")
    try:
        if path == SECRETS_PATH:
            return _response(http.HTTPStatus.OK, "application/json", json.dumps(server.calls.new_secret(body)).encode())
    except CallError as exc:
        return json_error(http.HTTPStatus(exc.status), exc.code, exc.message)
    ip = peer_ip(connection, sec.proxies)
    if server.per_ip[ip] >= sec.max_connections_per_ip:
        return _too_many(server)
    return _place_call(server, body, request.headers.get("Content-Type", ""), ip, secret)


def _too_many(server: Server) -> Response:
    """An address with `max_connections_per_ip` WebSockets and calls open asks for one more."""
    return json_error(
        http.HTTPStatus.TOO_MANY_REQUESTS,
        "too_many_connections",
        "too many connections from this address",
        retry_after_ms=server.config.admission.retry_after_ms,
    )


async def _place_call(server: Server, body: bytes, content_type: str, ip: str, secret: Any) -> Response:
    try:
        call_id, answer = await server.calls.create(body, content_type, ip, secret)
    except CallError as exc:
        retry = server.config.admission.retry_after_ms if exc.status == 503 else None
        return json_error(http.HTTPStatus(exc.status), exc.code, exc.message, retry_after_ms=retry)
    response = _response(http.HTTPStatus.CREATED, "application/sdp", answer.encode())
    response.headers["Location"] = f"{CALLS_PATH}/{call_id}"
    return response


def rounded(stats: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in stats.items()}


_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}


def static_file(path: str) -> tuple[str, bytes] | None:
    """A file of the web client (`duplexd/clients/web/`, flat, no subfolders): (content type, bytes)."""
    name = path.removeprefix("/")
    content_type = _CONTENT_TYPES.get(name[name.rfind(".") :] if "." in name else "")
    if content_type is None or "/" in name or name.startswith("."):
        return None
    file = resources.files("duplexd.clients.web").joinpath(name)
    return (content_type, file.read_bytes()) if file.is_file() else None


def peer_ip(connection: ServerConnection, proxies: frozenset[str] = frozenset()) -> str:
    """The client's address: the peer's, or, when the peer is a trusted balancer, the last address its
    `X-Forwarded-For` names (the one it saw; earlier entries are the client's word)."""
    address = connection.remote_address
    peer = str(address[0]) if address else "?"
    if peer in proxies and connection.request is not None:
        forwarded = connection.request.headers.get("X-Forwarded-For", "")
        if last := forwarded.rsplit(",", 1)[-1].strip():
            return last
    return peer


def json_error(
    status: http.HTTPStatus, code: str, message: str, *, auth: bool = False, retry_after_ms: int | None = None
) -> Response:
    """`retry_after_ms`: a refusal worth retrying says when (`Retry-After`, whole seconds, and in the body)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if retry_after_ms is not None:
        error["retry_after_ms"] = retry_after_ms
    response = _response(status, "application/json", json.dumps({"error": error}).encode())
    if auth:
        response.headers["WWW-Authenticate"] = 'Bearer realm="duplexd"'
    if retry_after_ms is not None:
        response.headers["Retry-After"] = str(math.ceil(retry_after_ms / 1000))
    return response
