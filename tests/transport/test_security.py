"""Who may connect and how much they may send, on a real server: bearer keys (header or query), origins,
connections per address, input audio faster than real time, idle clients, TLS, secrets kept out of logs."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from duplexd.config import SecurityConfig, ServerConfig
from duplexd.transport.protocol import encode_audio_frame

pytestmark = pytest.mark.slow

KEY = "k-3f9a1c7e5b2d4a60"
START = json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000, "dialog": False})


def secured(**fields: object) -> ServerConfig:
    return ServerConfig(security=SecurityConfig(**fields))  # type: ignore[arg-type]


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def handshake(url: str, **kwargs: object) -> int:
    """101 if the WebSocket opened (and started a session), else the HTTP status of the refusal."""
    try:
        async with connect(url, open_timeout=10, **kwargs) as ws:  # type: ignore[arg-type]
            await ws.send(START)
            assert json.loads(await ws.recv())["type"] == "session.started"
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def test_a_key_is_required_everywhere_but_the_probes(make_server, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="websockets.server")  # (`duplexd serve` keeps it at WARNING)
    srv = await make_server(secured(api_key=KEY))
    assert await handshake(srv.url) == 401
    assert await handshake(srv.url, additional_headers={"Authorization": "Bearer wrong"}) == 401
    assert await handshake(srv.url, additional_headers={"Authorization": f"Bearer {KEY}"}) == 101
    assert await handshake(srv.url + f"?token={KEY}") == 101  # browsers: the key in the URL
    realtime = srv.url.replace("/v1/stream", "/v1/realtime")
    assert await handshake(realtime) == 401
    assert await asyncio.to_thread(http_status, srv.http + "/metrics") == 401
    assert await asyncio.to_thread(http_status, srv.http + "/metrics", {"Authorization": f"Bearer {KEY}"}) == 200
    assert await asyncio.to_thread(http_status, srv.http + "/healthz") == 200  # probes stay open
    assert await asyncio.to_thread(http_status, srv.http + "/readyz") == 200
    # The key never reaches a server log line (it came in headers and in a query string); the test's own
    # client logs its requests (websockets.client) and is not the server.
    server_side = [r for r in caplog.records if not r.name.startswith("websockets.client")]
    assert any(r.name.startswith("websockets.server") for r in server_side)
    assert not any(KEY in r.getMessage() for r in server_side)


async def test_without_a_key_configured_anyone_may_connect(make_server) -> None:
    srv = await make_server()
    assert await handshake(srv.url) == 101


async def test_browsers_from_other_origins_are_refused(make_server) -> None:
    srv = await make_server(secured(allowed_origins="https://app.example, https://other.example/"))
    assert await handshake(srv.url, origin="https://evil.example") == 403
    assert await handshake(srv.url, origin="https://app.example") == 101
    assert await handshake(srv.url, origin="https://other.example") == 101
    assert await handshake(srv.url) == 101  # not a browser: no Origin header


async def test_connections_per_address_are_limited(make_server) -> None:
    srv = await make_server(secured(max_connections_per_ip=2))
    async with connect(srv.url) as a, connect(srv.url) as b:
        assert a and b
        assert await handshake(srv.url) == 429
    await asyncio.sleep(0.2)
    assert await handshake(srv.url) == 101  # a place is free again


async def test_behind_a_trusted_balancer_the_limit_counts_the_forwarded_clients(make_server) -> None:
    def via(client: str) -> dict[str, object]:
        return {"additional_headers": {"X-Forwarded-For": f"203.0.113.9, {client}"}}  # the last hop is what counts

    srv = await make_server(secured(max_connections_per_ip=1, trusted_proxies="127.0.0.1"))
    async with connect(srv.url, **via("198.51.100.1")):  # type: ignore[arg-type]
        assert await handshake(srv.url, **via("198.51.100.2")) == 101  # another client behind the balancer
        assert await handshake(srv.url, **via("198.51.100.1")) == 429  # the same client again
    await asyncio.sleep(0.2)
    untrusted = await make_server(secured(max_connections_per_ip=1))
    async with connect(untrusted.url, **via("198.51.100.1")):  # type: ignore[arg-type]
        # Not a trusted proxy: its header is anyone's word, and the peer address counts.
        assert await handshake(untrusted.url, **via("198.51.100.2")) == 429


async def test_audio_faster_than_real_time_beyond_the_burst_gets_an_error_not_a_backlog(make_server) -> None:
    srv = await make_server(secured(audio_burst_s=1.0))
    async with connect(srv.url) as ws:
        await ws.send(START)
        await ws.recv()
        frame = np.zeros(3200, "<i2").tobytes()  # 200 ms
        for seq in range(1, 16):  # 3 s of audio at once
            await ws.send(encode_audio_frame(seq, frame))
        errors = []
        try:
            while True:  # every answer to the burst, until the server has nothing more to say
                msg = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                if msg["type"] == "error":
                    errors.append(msg)
        except TimeoutError:
            pass
        assert len(errors) >= 8 and {e["code"] for e in errors} == {"rate_limited"}, errors
        (session,) = srv.server.sessions.values()
        assert session.stream_s <= 1.25  # what was taken: the burst (and the moment that passed), no more
        await asyncio.sleep(1.0)
        await ws.send(encode_audio_frame(100, frame))  # back at real-time pace: taken again
        await ws.send(json.dumps({"type": "session.end"}))
        async for raw in ws:
            if isinstance(raw, str) and json.loads(raw)["type"] == "error":
                pytest.fail(f"refused at real-time pace: {raw}")
    assert ws.close_code == 1000


async def test_an_idle_connection_is_closed_with_a_reason(make_server) -> None:
    srv = await make_server(secured(idle_timeout_s=0.5))
    events = []
    async with connect(srv.url) as ws:
        await ws.send(START)
        await ws.recv()
        with pytest.raises(ConnectionClosedError):
            while True:
                events.append(json.loads(await ws.recv()))
    assert events[-1]["code"] == "idle_timeout" and ws.close_code == 1008


async def test_tls_from_cert_and_key_files(make_server, tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    await asyncio.to_thread(
        subprocess.run,
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    srv = await make_server(secured(tls_cert=str(cert), tls_key=str(key)))
    trust = ssl.create_default_context(cafile=str(cert))
    assert await handshake(srv.url.replace("ws://", "wss://"), ssl=trust) == 101
    with pytest.raises((OSError, asyncio.TimeoutError, InvalidStatus, Exception)):
        await handshake(srv.url)  # plain ws to a TLS port fails
